"""transformer-evaluate --pivot (issue 74): a multilingual model's zero-shot direction scored beside the
translation through a third language by the same model, with the off-target rate of each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import FAST, compose_config
from transformer.checkpoint import save_checkpoint
from transformer.data.prepare import prepare
from transformer.data.toy import generate
from transformer.inference.evaluate import EvaluationSet, Models, evaluate
from transformer.inference.request import DecodeRequest
from transformer.inference.scoring import score
from transformer.inference.translator import Translator
from transformer.model import build_model


@pytest.fixture(scope="module")
def three_languages(tmp_path_factory):
    """An untrained model of de <-> en and en <-> fr (so de <-> fr is zero-shot), on toy text whose `fr`
    is the English reversed, with test files in all three languages."""
    root = tmp_path_factory.mktemp("pivot")
    corpus = root / "toy"
    corpus.mkdir()
    for split, (src, tgt) in generate(300, 30, 30, seed=5).items():
        (corpus / f"{split}.de").write_text("\n".join(src) + "\n")
        (corpus / f"{split}.en").write_text("\n".join(tgt) + "\n")
        (corpus / f"{split}.fr").write_text("\n".join(" ".join(line.split()[::-1]) for line in tgt) + "\n")
    overrides = [
        f"data.path={corpus}",
        "data.name=three",
        "data.embedded=false",
        "data.corpora=["
        + ", ".join(
            f"{{path: {corpus}, src_lang: {a}, tgt_lang: {b}}}"
            for a, b in map(str.split, ("de en", "en de", "en fr", "fr en"))
        )
        + "]",
    ]
    cfg = compose_config(FAST + overrides, root / "cache")
    tok = prepare(cfg.data).tokenizer
    torch.manual_seed(0)
    model = build_model(cfg.model, tok.src_vocab_size, tok.tgt_vocab_size, tok.joint)
    path = root / "best.pt"
    state = {"model": model.state_dict(), "config": cfg.to_dict(), "tokenizer": tok.state_dict(), "step": 0}
    save_checkpoint(state, path)
    return corpus, path


def test_the_pivot_is_the_same_models_two_steps_scored_beside_the_direct_translation(three_languages):
    corpus, path = three_languages
    result = evaluate(
        Models((path,), device="cpu"),
        EvaluationSet(split="test", src_lang="de", pivot="en"),
        DecodeRequest(tgt_lang="fr", beam_size=2),
    )
    translator = Translator.from_checkpoint(path, device="cpu")
    sources = (corpus / "test.de").read_text().splitlines()
    references = (corpus / "test.fr").read_text().splitlines()
    direct = translator.translate(sources, beam_size=2, tgt_lang="fr")
    middle = translator.translate(sources, beam_size=2, tgt_lang="en")
    through = translator.translate(middle, beam_size=2, tgt_lang="fr")
    assert result["bleu"] == score(direct, references, "fr")["bleu"]
    pivot = result["pivot"]
    assert pivot["via"] == "en" and pivot["bleu"] == score(through, references, "fr")["bleu"]
    assert pivot["chrf"] == score(through, references, "fr")["chrf"]
    assert Path(pivot["hypotheses_file"]).read_text().splitlines() == through
    assert Path(pivot["hypotheses_file"]).name == "best.test.de-fr.pivot-en.beam2.hyp"
    assert json.loads(Path(result["scores_file"]).read_text())["pivot"]["bleu"] == pivot["bleu"]
    for rate in ("off_target", "off_target_into_pivot"):  # an untrained model's: any share, but a share
        assert 0 <= pivot[rate] <= 100
    assert Translator.from_checkpoint(path, device="cpu").tgt_lang is None  # nothing left changed


@pytest.mark.parametrize(
    "args, message",
    [
        (["--src-lang", "de", "--tgt-lang", "fr", "--pivot", "fr"], "--pivot fr: it is an end of de -> fr"),
        (["--src-lang", "de", "--tgt-lang", "fr", "--pivot", "cs"], "--pivot cs: not a language this model"),
        (["--src-lang", "de", "--tgt-lang", "fr", "--pivot", "en", "--augment", "upper"], "leave out --augment"),
    ],
)
def test_a_pivot_that_cannot_work_is_refused_in_one_line(three_languages, capsys, args, message):
    from transformer.cli.evaluate import main

    _, path = three_languages
    assert main([str(path), "--beam", "1", *args]) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1


def test_the_command_prints_the_pivot_row_and_the_directions_table_its_columns(three_languages, capsys):
    from transformer.cli.evaluate import main

    _, path = three_languages
    assert main([str(path), "--src-lang", "de", "--tgt-lang", "fr", "--beam", "1", "--pivot", "en"]) == 0
    out = capsys.readouterr().out
    assert "through en: BLEU " in out and "(direct - pivot: BLEU " in out and "the step into en " in out
    assert main([str(path), "--directions", "de-fr,fr-de", "--beam", "1", "--pivot", "en"]) == 0
    out = capsys.readouterr().out
    assert "off-target pivot en off-target" in out
    mean = float(out.split("mean of 2")[1].splitlines()[0].split()[-1])  # the pivot's mean beside the direct one
    lines = [line for line in out.splitlines() if line.startswith(("de-fr ", "fr-de "))]
    assert mean == pytest.approx(sum(float(line.split()[4]) for line in lines) / 2, abs=0.01)
    assert out.count("through en: BLEU") == 2  # each direction's line as it ends
