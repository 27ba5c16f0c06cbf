"""One model for several language pairs: corpora into more than one target language get target tags
(`<2xx>` pieces of the joint SentencePiece model, first in every source), and translating with such a
model needs a target language, refused in one line when missing or unknown."""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import torch

from tests.helpers import FAST, ROOT, compose_config
from transformer.checkpoint import load_checkpoint, save_checkpoint
from transformer.config import ConfigError
from transformer.data.prepare import prepare
from transformer.data.tokenizer import ANGLE_FORMS
from transformer.data.toy import generate
from transformer.inference.translator import Translator
from transformer.model import build_model


def _write_corpus(directory: Path, pairs: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for split, (src, tgt) in generate(pairs, 30, 30, seed=3).items():
        (directory / f"{split}.de").write_text("\n".join(src) + "\n")
        (directory / f"{split}.en").write_text("\n".join(tgt) + "\n")
    return directory


def _overrides(corpus: Path) -> list[str]:
    """de->en and en->de from the same files: one model into two languages."""
    return [
        f"data.path={corpus}",
        "data.name=both",
        "data.embedded=false",
        f"data.corpora=[{{path: {corpus}, src_lang: de, tgt_lang: en}}, "
        f"{{path: {corpus}, src_lang: en, tgt_lang: de, weight: 0.5}}]",
    ]


@pytest.fixture(scope="module")
def multilingual(tmp_path_factory):
    """(prepared data, path of an untrained multilingual checkpoint)."""
    root = tmp_path_factory.mktemp("multilingual")
    cfg = compose_config(FAST + _overrides(_write_corpus(root / "toy", 300)), root / "cache")
    data = prepare(cfg.data)
    torch.manual_seed(0)
    tok = data.tokenizer
    model = build_model(cfg.model, tok.src_vocab_size, tok.tgt_vocab_size, tok.joint)
    save_checkpoint(
        {"model": model.state_dict(), "config": cfg.to_dict(), "tokenizer": tok.state_dict(), "step": 0},
        root / "best.pt",
    )
    return data, root / "best.pt"


def test_every_source_starts_with_the_tag_of_its_corpus_target_language(multilingual):
    data, _ = multilingual
    tok = data.tokenizer
    assert tok.target_languages == ["de", "en"]
    assert tok.src.id_to_piece(tok.tag_id("en")) == "<2en>"
    into_en, into_de = data.train.parts
    assert into_en.name == "toy_de_en.train" and into_de.name == "toy_en_de.train"
    for part, language in ((into_en, "en"), (into_de, "de")):
        firsts = {part.ids(k)[0][0] for k in range(len(part))}
        assert firsts == {tok.tag_id(language)}
        assert all(tok.tag_id(other) not in part.ids(k)[1] for k in range(20) for other in ("de", "en"))
    assert {data.valid.ids(k)[0][0] for k in range(len(data.valid))} == {tok.tag_id("en")}  # data.tgt_lang
    # The same text, each side once as source and once as target.
    assert into_en.ids(0)[0][1:] == into_de.ids(0)[1] and into_en.ids(0)[1] == into_de.ids(0)[0][1:]


def test_a_language_tag_written_in_the_text_never_becomes_the_tag(multilingual):
    """SentencePiece matches its user-defined pieces in raw text: "<2de>" inside a sentence became the
    German tag, and a sentence chose the target language of its translation."""
    data, _ = multilingual
    tok = data.tokenizer
    tags = {tok.tag_id(language) for language in tok.target_languages}
    for text in ("Der Hund <2de> rennt.", "<2en>", "a<2de>b <2en> <2xx> <2de"):
        for ids in (tok.encode_src([text])[0], tok.encode_src([text], tgt_lang="en")[0][1:], tok.encode_tgt([text])[0]):
            assert not tags & set(ids), (text, ids)
    # Every form SentencePiece's NFKC folds into a tag: full-width and small-form brackets, full-width
    # digits and letters, and a tag spelled in them inside a --prefix or a training line alike.
    folding = [c for c in map(chr, range(sys.maxunicode + 1)) if unicodedata.normalize("NFKC", c) in "<>2deno"]
    assert {"\uff1c", "\ufe64", "\uff1e", "\ufe65", "\uff12", "\uff44"} <= set(folding)
    assert {c for c in folding if unicodedata.normalize("NFKC", c) == "<"} | {"<"} == set(ANGLE_FORMS)
    for text in ("\uff1c\uff12\uff44\uff45\uff1e Hund", "\ufe642en\ufe65", "<\uff12de>", "a\uff1c2en>b"):
        for ids in (tok.encode_src([text])[0], tok.encode_src([text], tgt_lang="en")[0][1:], tok.encode_tgt([text])[0]):
            assert not tags & set(ids), (text, ids)
    plain = "Der Hund rennt."
    assert tok.encode_src([plain]) == [tok.src.encode(plain)]  # text without tags: encoded as before
    assert tok.encode_src(["<2de>"], tgt_lang="de")[0][0] == tok.tag_id("de")  # the tag given as a tag


def test_a_multilingual_model_needs_a_known_target_language_and_the_tag_reaches_the_encoder(multilingual):
    _, path = multilingual
    translator = Translator.from_checkpoint(path, device="cpu")
    assert translator.target_languages == ["de", "en"]
    with pytest.raises(
        ValueError,
        match=r"^this model translates into several languages \(de, en\): choose one "
        r"with tgt_lang=LANG$",
    ):
        translator.translate(["Der Hund."])
    with pytest.raises(ValueError, match="tgt_lang=fr: not a target language of this model; it translates into de, en"):
        translator.translate(["Der Hund."], tgt_lang="fr")
    assert translator.translate(["Der Hund .", ""], tgt_lang="en", beam_size=2)[1] == ""
    into_en = translator.score(["Der Hund ."], ["The dog ."], tgt_lang="en")
    into_de = translator.score(["Der Hund ."], ["The dog ."], tgt_lang="de")
    assert into_en != into_de  # the tag is part of what the encoder reads
    assert translator.score(["Der Hund ."], ["The dog ."], tgt_lang="en") == into_en
    # an empty source is scored with its tag too: the tag is all that says which language the reference is in
    assert translator.score([""], ["The dog ."], tgt_lang="en") != translator.score([""], ["The dog ."], tgt_lang="de")


def test_a_bilingual_model_needs_no_target_language_and_refuses_another(untrained_checkpoint):
    translator = Translator.from_checkpoint(untrained_checkpoint, device="cpu")
    assert translator.target_languages == []
    plain = translator.score(["Der Hund ."], ["The dog ."])
    assert translator.score(["Der Hund ."], ["The dog ."], tgt_lang="en") == plain
    with pytest.raises(ValueError, match="tgt_lang=fr: this model translates de -> en only"):
        translator.translate(["Der Hund ."], tgt_lang="fr")
    translator.tgt_lang = "fr"  # a default that cannot apply is refused too
    with pytest.raises(ValueError, match=r"^Translator.tgt_lang=fr: this model translates de -> en only"):
        translator.translate(["Der Hund ."])
    translator.tgt_lang = "en"
    assert translator.score(["Der Hund ."], ["The dog ."]) == plain


def test_the_length_penalty_follows_the_target_language_unless_one_is_given(multilingual, monkeypatch):
    import transformer.inference.translator as translator_module

    _, path = multilingual
    translator = Translator.from_checkpoint(path, device="cpu")
    translator.config.decode.alpha, translator.config.decode.alpha_by_language = 0.6, {"de": 1.5}
    used = []
    real = translator_module.translate_ids
    monkeypatch.setattr(
        translator_module,
        "translate_ids",
        lambda models, sources, search, **kwargs: used.append(search.alpha) or real(models, sources, search, **kwargs),
    )
    for language, alpha in (("de", None), ("en", None), ("de", 3.0)):
        translator.translate(["Der Hund ."], tgt_lang=language, beam_size=2, alpha=alpha)
    assert used == [1.5, 0.6, 3.0]  # de's own, decode.alpha for a language left out, the one given


def test_an_empty_source_with_a_prefix_is_decoded_with_its_language_tag(multilingual, monkeypatch):
    import transformer.inference.translator as translator_module

    _, path = multilingual
    translator = Translator.from_checkpoint(path, device="cpu")
    decoded = []
    real = translator_module.translate_ids
    monkeypatch.setattr(
        translator_module,
        "translate_ids",
        lambda models, sources, *search, **kwargs: decoded.append(sources) or real(models, sources, *search, **kwargs),
    )
    translator.translate(["", "", "Der Hund ."], tgt_lang="de", prefixes=["Der", "", ""], beam_size=1)
    tag = translator.tokenizer.tag_id("de")
    assert decoded[0][0] == [tag]  # the prefixed empty source: its tag, what says "into German"
    assert len(decoded[0]) == 2 and decoded[0][1][0] == tag  # the empty one without a prefix is not decoded


def test_a_length_penalty_per_language_names_only_target_languages(tmp_path):
    corpus = tmp_path / "toy"
    cfg = compose_config(_overrides(corpus) + ["decode.alpha=1", "decode.alpha_by_language.en=2.5"])
    assert (cfg.decode.alpha_for("en"), cfg.decode.alpha_for("de"), cfg.decode.alpha_for(None)) == (2.5, 1.0, 1.0)
    for extra, message in (
        (
            ["decode.alpha_by_language.fr=2"],
            "decode.alpha_by_language: fr is not a target language of this model; it translates into de, en",
        ),
        (["decode.alpha_by_language.en=-1"], r"decode.alpha_by_language.en=-1.0: must be a finite number >= 0"),
    ):
        with pytest.raises(ConfigError, match=message):
            compose_config(_overrides(corpus) + extra)
    with pytest.raises(
        ConfigError, match="this model translates into en only; set its length penalty with decode.alpha"
    ):
        compose_config(["decode.alpha_by_language.en=2"])


@pytest.mark.parametrize(
    "flags, code, message",
    [
        (
            [],
            2,
            "transformer-translate: error: this model translates into several languages (de, en): choose one with "
            "--tgt-lang LANG",
        ),
        (
            ["--tgt-lang", "cs"],
            2,
            "transformer-translate: error: --tgt-lang cs: not a target language of this model; it "
            "translates into de, en",
        ),
        (["--tgt-lang", "de"], 0, ""),
    ],
)
def test_the_cli_refuses_a_missing_or_unknown_target_language_in_one_line(multilingual, flags, code, message):
    _, path = multilingual
    result = subprocess.run(
        [sys.executable, "-m", "transformer.cli.translate", str(path), "--beam", "1", *flags],
        input="Der Hund .\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == code, result.stderr
    assert result.stderr.strip() == message
    assert len(result.stdout.splitlines()) == (1 if code == 0 else 0)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "data.corpora=[{path: a, src_lang: en, tgt_lang: en}]",
            "data.corpora\\[0\\]: src_lang and tgt_lang are both 'en'",
        ),
        (
            "data.corpora=[{path: a, tgt_lang: de, src_lang: en}, {path: a}]",
            "a multilingual model needs one vocabulary",
        ),
    ],
)
def test_a_bad_multilingual_config_is_refused(override, message):
    overrides = [override] + (["data.joint_vocab=false"] if "vocabulary" in message else [])
    with pytest.raises(ConfigError, match=message):
        compose_config(overrides)


def test_corpora_of_one_directory_are_named_by_their_languages():
    cfg = compose_config(
        ["data.corpora=[{path: /d/multi30k, src_lang: fr}, {path: /d/multi30k, tgt_lang: cs}, {path: /d/other}]"]
    )
    assert [c.label(cfg.data) for c in cfg.data.corpora] == ["multi30k_fr_en", "multi30k_de_cs", "other"]
    assert cfg.data.directions() == [("fr", "en"), ("de", "cs"), ("de", "en")]
    assert cfg.data.target_languages() == ["cs", "en"]


@pytest.mark.slow
def test_a_multilingual_run_validates_each_direction_and_keeps_the_best_by_their_mean(tmp_path, data_cache):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from transformer.training.trainer import train

    corpus = _write_corpus(tmp_path / "toy", 300)
    cfg = compose_config(
        FAST
        + _overrides(corpus)
        + [
            "trainer.max_steps=6",
            "trainer.validate_every=3",
            "trainer.val_max_sentences=10",
            "decode.beam_size=1",
            "trainer.test_at_end=false",
            "trainer.max_minutes=0",
            "trainer.ema_decay=0",
            "trainer.attention_heatmaps=mean",
        ],
        data_cache,
    )
    metrics = train(cfg, tmp_path / "run")
    log = (tmp_path / "run" / "train.log").read_text()
    for what in ("de-en", "en-de", "mean of 2 directions"):
        assert f"validation step 3 {what} | loss" in log, what
    for step in (3, 6):
        entry = next(v for v in metrics["val_history"] if v["step"] == step)
        assert entry["bleu"] == pytest.approx((entry["bleu_de-en"] + entry["bleu_en-de"]) / 2)
    assert metrics["best_bleu"] == max(v["bleu"] for v in metrics["val_history"])
    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"val/de-en/bleu", "val/en-de/bleu", "val/de-en/chrf", "val/bleu", "loss/valid"} <= scalars
    assert "val/de-en/cross_attention_1" in events.Tags()["images"]  # drawn for the first direction
    assert "val/en-de/cross_attention_1" not in events.Tags()["images"]


def test_evaluate_scores_a_chosen_direction_and_refuses_an_unknown_one(multilingual, capsys):
    from transformer.cli.evaluate import main
    from transformer.inference.evaluate import EvaluationSet, Models, evaluate
    from transformer.inference.request import DecodeRequest

    _, path = multilingual
    result = evaluate(
        Models((path,), device="cpu"),
        EvaluationSet(split="test", src_lang="en"),
        DecodeRequest(tgt_lang="de", beam_size=1),
    )
    assert result["split"] == "test.en-de" and result["sentences"] == 30
    assert Path(result["hypotheses_file"]).name == "best.test.en-de.beam1.hyp"
    assert "|tok:13a|" in result["bleu_signature"] and "alpha" not in result  # greedy: no length penalty
    state = load_checkpoint(path)
    state["config"]["decode"]["alpha_by_language"] = {"de": 1.75}  # what the beam's results record
    save_checkpoint(state, path.parent / "per-language.pt")
    for tgt_lang, alpha, used in (
        ("de", None, 1.75),
        ("en", None, state["config"]["decode"]["alpha"]),
        ("de", 0.25, 0.25),
    ):
        assert (
            evaluate(
                Models((path.parent / "per-language.pt",), device="cpu"),
                EvaluationSet(split="test", src_lang="de" if tgt_lang == "en" else "en"),
                DecodeRequest(tgt_lang=tgt_lang, beam_size=2, alpha=alpha),
            )["alpha"]
            == used
        )
    # an untrained model's output, in whatever language: its off-target rate, among the model's languages
    assert result["off_target_among"] == ["de", "en"] and 0 <= result["off_target"] <= 100
    assert result["off_target_count"] == sum(result["off_target_languages"].values())
    assert set(result["off_target_languages"]) <= {"en"}
    default = evaluate(
        Models((path,), device="cpu"), EvaluationSet(split="test"), DecodeRequest(beam_size=1)
    )  # the checkpoint's data pair
    assert default["split"] == "test" and default["sentences"] == 30
    assert main([str(path), "--src-lang", "en", "--tgt-lang", "de", "--beam", "1"]) == 0
    assert "off-target: " in capsys.readouterr().out
    assert (
        main(
            [
                str(path),
                "--split",
                "validation",
                "--src-lang",
                "de",
                "--tgt-lang",
                "en",
                "--beam",
                "2",
                "--alpha",
                "1,2",
                "--max-len-b",
                "3",
            ]
        )
        == 0
    )
    searched = capsys.readouterr()
    assert "best on validation.de-en (beam 2): --alpha " in searched.out and searched.err == ""
    assert "as the model's default: decode.alpha_by_language.en=" in searched.out
    assert main([str(path), "--tgt-lang", "fr", "--beam", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "transformer-evaluate: error: --tgt-lang fr: not a target language of this model; it translates into de, en"
    )


def test_evaluate_scores_every_direction_and_chooses_a_length_penalty_per_target_language(multilingual, capsys):
    from transformer.cli.evaluate import main

    _, path = multilingual
    assert (
        main(
            [
                str(path),
                "--directions",
                "all",
                "--split",
                "validation",
                "--beam",
                "2",
                "--alpha",
                "0.5,2",
                "--max-len-b",
                "3",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert err == ""
    results = {
        (r["src_lang"], r["tgt_lang"], r["alpha"]): r
        for r in (
            json.loads(Path(f"{path.with_suffix('')}.validation.{pair}.alpha{a}.beam2.json").read_text())
            for pair in ("de-en", "en-de")
            for a in ("0.5", "2")
        )
    }
    assert len(results) == 4  # each direction at each alpha, in its own files
    best = {
        tgt: max((0.5, 2.0), key=lambda a: results[(src, tgt, a)]["bleu"]) for src, tgt in (("de", "en"), ("en", "de"))
    }
    assert f"as the model's defaults: decode.alpha_by_language='{{de: {best['de']:g}, en: {best['en']:g}}}'" in out
    mean = (results[("de", "en", best["en"])]["bleu"] + results[("en", "de", best["de"])]["bleu"]) / 2
    assert f"{'mean of 2':10} {mean:6.2f}" in out
    assert f"for this model: --alpha de={best['de']:g},en={best['en']:g}" in out
    for flags, message in (
        (
            ["--directions", "all", "--tgt-lang", "en"],
            "--directions scores the split in each direction: leave out --src-lang, --tgt-lang, --src and --ref",
        ),
        (["--directions", "de-en,en"], "--directions de-en,en: 'en' is not SRC-TGT"),
        (
            ["--directions", "all", "--tokenized-lc", "ref.tok"],
            "--tokenized-lc ref.tok: the directions have several target languages; write {tgt} where the language goes",
        ),
    ):
        assert main([str(path), "--beam", "1", *flags]) == 2
        assert message in capsys.readouterr().err


def test_evaluate_takes_a_length_penalty_per_target_language(multilingual, capsys):
    """The values a search chose per target language could only be used by retraining with
    decode.alpha_by_language: `--alpha de=0.5,en=2` scores each direction with its language's value."""
    from transformer.cli.evaluate import main

    _, path = multilingual
    default = load_checkpoint(path)["config"]["decode"]["alpha"]
    for given, expected in (("de=0.5,en=2", {"de": 0.5, "en": 2.0}), ("en=0.25", {"de": default, "en": 0.25})):
        assert (
            main(
                [
                    str(path),
                    "--directions",
                    "all",
                    "--split",
                    "validation",
                    "--beam",
                    "2",
                    "--alpha",
                    given,
                    "--max-len-b",
                    "3",
                ]
            )
            == 0
        )
        out, err = capsys.readouterr()
        assert err == ""
        for src, tgt in (("de", "en"), ("en", "de")):
            recorded = json.loads(Path(f"{path.with_suffix('')}.validation.{src}-{tgt}.beam2.json").read_text())
            assert recorded["alpha"] == expected[tgt]
            assert f"{src}-{tgt:7} {recorded['bleu']:6.2f} {recorded['chrf']:6.2f}  {expected[tgt]:g}" in out
    assert (
        main(
            [
                str(path),
                "--src-lang",
                "en",
                "--tgt-lang",
                "de",
                "--split",
                "validation",
                "--beam",
                "2",
                "--alpha",
                "de=1.25,en=3",
                "--max-len-b",
                "3",
            ]
        )
        == 0
    )  # one direction: its language's
    capsys.readouterr()
    assert json.loads(Path(f"{path.with_suffix('')}.validation.en-de.beam2.json").read_text())["alpha"] == 1.25
    assert (
        main(
            [
                str(path),
                "--directions",
                "de-en",
                "--split",
                "validation",
                "--beam",
                "2",
                "--alpha",
                "de=1,en=2",
                "--max-len-b",
                "3",
            ]
        )
        == 0
    )
    assert "note: --alpha de=1: no direction scored here translates into de" in capsys.readouterr().err
    greedy = load_checkpoint(path)
    greedy["config"]["decode"]["beam_size"] = 1
    save_checkpoint(greedy, path.parent / "greedy.pt")
    for checkpoint, flags, message in (
        (path, ["--alpha", "fr=1"], "--alpha fr=1: the model does not translate into fr; it translates into de, en"),
        (
            path,
            ["--alpha", "en=1", "--beam", "1"],
            "--alpha en=1: a length penalty per language needs a beam "
            "of 2 or more (--beam 5): greedy search has no length penalty",
        ),
        (path, ["--alpha", "en=1,de=-1"], "--alpha de=-1: must be a finite number >= 0 and <= 100"),
        (
            path.parent / "greedy.pt",
            ["--alpha", "en=1"],
            "--alpha en=1: a length penalty per language needs a beam of 2 or more",
        ),
    ):  # the checkpoint's beam of 1: refused before anything is decoded
        assert main([str(checkpoint), "--directions", "all", *flags]) == 2
        assert capsys.readouterr().err.strip().startswith(f"transformer-evaluate: error: {message}")
    assert not list(path.parent.glob("greedy.*.hyp"))
    for given in ("en=2,1.5", "=2", "en=x", "en=1,en=2"):
        with pytest.raises(SystemExit):
            main([str(path), "--directions", "all", "--beam", "2", "--alpha", given])
        assert f"argument --alpha: {given!r}: " in capsys.readouterr().err


def test_the_joint_tokenizer_reads_each_language_once_and_at_most_its_share(tmp_path):
    from transformer.data.mixture import corpus_config, tokenizer_input
    from transformer.data.sources import open_split

    corpus = _write_corpus(tmp_path / "toy", 300)
    cfg = compose_config(FAST + _overrides(corpus) + ["data.tokenizer_sample=400"]).data
    parts = [corpus_config(cfg, c) for c in cfg.corpora]
    sample = tokenizer_input(cfg, parts, [open_split(p, "train") for p in parts])
    lines = list(sample.lines("src", "tgt"))
    german = (corpus / "train.de").read_text().splitlines()
    english = (corpus / "train.en").read_text().splitlines()
    assert lines == german[:200] + english[:200]  # de-en and en-de share their files: each side once
    every = compose_config(FAST + _overrides(corpus) + ["data.tokenizer_sample=0"]).data  # 0: every line
    parts = [corpus_config(every, c) for c in every.corpora]
    assert (
        list(tokenizer_input(every, parts, [open_split(p, "train") for p in parts]).lines("src", "tgt"))
        == german + english
    )
    bilingual = compose_config(
        FAST + [f"data.path={corpus}", "data.embedded=false", f"data.corpora=[{{path: {corpus}}}]"]
    ).data
    part = corpus_config(bilingual, bilingual.corpora[0])
    assert len(list(tokenizer_input(bilingual, [part], [open_split(part, "train")]).lines("src", "tgt"))) == 600


def test_exports_keep_the_tag_a_safetensors_card_says_how_and_ctranslate2_scores_like_ours(multilingual, tmp_path):
    from transformer.checkpoint import load_checkpoint, model_from_checkpoint
    from transformer.inference.ctranslate2 import export_ctranslate2
    from transformer.inference.pretrained import save_pretrained

    _, path = multilingual
    model, tokenizer, config = model_from_checkpoint(load_checkpoint(path))
    directory = save_pretrained(model, tokenizer, config, tmp_path / "both")
    card = (directory / "README.md").read_text()
    assert 'language:\n- "de"\n- "en"\n' in card and "multilingual translation (de → en, en → de)" in card
    assert 'translator.translate(["..."], tgt_lang="en")' in card and "--tgt-lang en" in card
    corpus = Path(config.data.corpora[0].path).name  # an export holds no absolute path: the last part
    assert (
        f"2 corpora mixed in each epoch by (weight × pairs)^(1/1) (data preset `both`): `toy_de_en`: `{corpus}`, "
        f"de → en, weight 1; `toy_en_de`: `{corpus}`, en → de, weight 0.5. Validation and test: local files in "
        f"`{corpus}`."
    ) in card
    loaded = Translator.from_pretrained(directory, device="cpu", precision="fp32")
    original = Translator.from_checkpoint(path, device="cpu", precision="fp32")
    sources = ["Der Hund .", "Ein Mann ."]
    assert loaded.translate(sources, tgt_lang="de", beam_size=2) == original.translate(
        sources, tgt_lang="de", beam_size=2
    )
    ctranslate2 = pytest.importorskip("ctranslate2")
    out = export_ctranslate2(model.eval(), tokenizer, tmp_path / "ct2")
    references = ["The dog .", "A man ."]
    for language in ("de", "en"):  # the tag as the first token of each tokenized source
        pieces = [[f"<2{language}>", *tokenizer.src.encode(s, out_type=str)] for s in sources]
        targets = [tokenizer.tgt.encode(r, out_type=str) for r in references]
        theirs = ctranslate2.Translator(str(out), device="cpu").score_batch(pieces, targets)
        ours = original.score(sources, references, tgt_lang=language)
        assert [sum(r.log_probs) for r in theirs] == pytest.approx(ours, abs=1e-3)


def test_a_bilingual_models_tokenizer_cannot_continue_into_a_multilingual_mixture(tmp_path, untrained_checkpoint):
    from transformer.checkpoint import load_checkpoint
    from transformer.data.tokenizer import Tokenizer
    from transformer.errors import DataError

    bilingual = Tokenizer.from_state_dict(load_checkpoint(untrained_checkpoint)["tokenizer"])
    assert bilingual.target_languages == []
    cfg = compose_config(FAST + _overrides(_write_corpus(tmp_path / "toy", 100)), tmp_path / "cache")
    with pytest.raises(
        DataError,
        match="data.corpora translate into de, en, but the tokenizer this run continues "
        "with .* is a bilingual model's, without target-language tags",
    ):
        prepare(cfg.data, tokenizer=bilingual)  # what trainer.init_from or a resume hands over


def test_evaluate_refuses_a_source_the_model_never_saw_or_a_target_equal_to_the_source(
    multilingual, untrained_checkpoint
):
    from transformer.errors import DataError
    from transformer.inference.evaluate import EvaluationSet, Models, evaluate
    from transformer.inference.request import DecodeRequest

    _, path = multilingual
    with pytest.raises(
        DataError,
        match="--src-lang en into the checkpoint's data.tgt_lang en: source and target "
        "are the same language; give another --tgt-lang",
    ):
        evaluate(Models((path,), device="cpu"), EvaluationSet(src_lang="en"), DecodeRequest(beam_size=1))
    with pytest.raises(DataError, match="--src-lang fr: the model was trained on de, en only; give one of those"):
        evaluate(Models((path,), device="cpu"), EvaluationSet(src_lang="fr"), DecodeRequest(tgt_lang="de", beam_size=1))
    for source in ("fr", "en"):  # a bilingual de -> en model: en is its target, never a source
        with pytest.raises(
            DataError, match=f"--src-lang {source}: this model translates de -> en only; leave --src-lang out"
        ):
            evaluate(
                Models((untrained_checkpoint,), device="cpu"),
                EvaluationSet(src_lang=source),
                DecodeRequest(beam_size=1),
            )


def test_evaluating_one_source_file_into_each_target_keeps_each_result(multilingual, tmp_path):
    from transformer.inference.evaluate import EvaluationSet, Models, evaluate
    from transformer.inference.request import DecodeRequest

    _, path = multilingual
    model = tmp_path / "best.pt"
    model.write_bytes(path.read_bytes())
    source, reference = tmp_path / "in.txt", tmp_path / "ref.txt"
    source.write_text("Der Hund .\nDie Katze .\n")
    reference.write_text("The dog .\nThe cat .\n")
    results = {
        lang: evaluate(
            Models((model,), device="cpu"),
            EvaluationSet(src_file=str(source), ref_file=str(reference)),
            DecodeRequest(tgt_lang=lang, beam_size=1, max_len_b=5),
        )
        for lang in ("de", "en")
    }
    for lang, result in results.items():
        assert Path(result["hypotheses_file"]).name == f"best.in.txt.to-{lang}.beam1.hyp"
        assert json.loads(Path(result["scores_file"]).read_text())["tgt_lang"] == lang


def test_word_dropout_never_drops_a_language_tag(tmp_path):
    from transformer.training.trainer import Trainer

    cfg = compose_config(
        FAST + _overrides(_write_corpus(tmp_path / "toy", 300)) + ["model.src_word_dropout=0.5"], tmp_path / "cache"
    )
    trainer = Trainer(cfg, tmp_path / "run")
    tok = trainer.data.tokenizer
    tags = sorted(tok.tag_id(language) for language in tok.target_languages)
    assert tags == [4, 5] and tok.protected_ids == 6  # after pad, unk, bos, eos: never dropped
    assert trainer.model.protected_ids == 6  # the trainer builds the model with them
    trainer.model.train()
    tagged = torch.tensor([[4, 40, 41, 42, 3], [5, 43, 44, 45, 3]])
    for _ in range(20):
        keep = trainer.model._word_keep(tagged, 0.5).squeeze(-1)
        assert (keep[:, 0] == 1).all() and (keep[:, -1] == 1).all()  # the tag and </s>: kept, unscaled
