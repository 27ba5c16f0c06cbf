"""transformer-export --format transformers against the real `transformers` package: the export loads with
AutoModelForSeq2SeqLM / AutoTokenizer offline and without remote code, its tokenizer gives our ids, its
logits are ours for every architecture it maps (random weights, fast), and a trained model's forced-decoding
scores and greedy / beam-5 translations through `generate` are ours (slow)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import run_main
from transformer.checkpoint import load_checkpoint, model_from_checkpoint
from transformer.cli import export as export_command
from transformer.data.batching import pad_sequences
from transformer.data.tokenizer import Tokenizer, train_sentencepiece
from transformer.data.toy import generate
from transformer.inference.hf_export import export_transformers, refusal
from transformer.model import build_model
from transformer.special import BOS_ID, EOS_ID, UNK_ID

transformers = pytest.importorskip("transformers")

SOURCES = ["Der Hund läuft schnell.", "Die Katze schläft.", "Ein Mann liest ein Buch im Park €.", ""]
TARGETS = ["The dog runs fast.", "The cat sleeps.", "A man reads a book in the park.", "Nothing."]  # A, N: <unk>


def _load(out):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    return AutoModelForSeq2SeqLM.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)


def _random_model(config, tokenizer, seed=3):
    """Random weights, LayerNorms and biases away from their (1, 0) and 0 start, so that a swapped or
    unpermuted one shows."""
    torch.manual_seed(seed)
    model = build_model(config.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.3)
    return model


def _separate(tokenizer):
    src, tgt = generate(400, 10, 10)["train"]
    target_model = train_sentencepiece(tgt * 3, vocab_size=110, model_type="bpe", character_coverage=1.0, sample=10_000)
    separate = Tokenizer(tokenizer.src_model_bytes, target_model)
    assert not separate.joint
    return separate


@pytest.mark.parametrize(
    "pre_norm,tied,joint,architecture",
    [
        (True, True, True, "PegasusForConditionalGeneration"),
        (False, True, True, "MarianMTModel"),
        (False, False, True, "MarianMTModel"),
        (False, True, False, "MarianMTModel"),
        (False, False, False, "MarianMTModel"),
    ],
)
def test_the_export_computes_our_logits_and_tokens(pre_norm, tied, joint, architecture, untrained_checkpoint, tmp_path):
    _, tokenizer, config = model_from_checkpoint(load_checkpoint(untrained_checkpoint))
    tokenizer = tokenizer if joint else _separate(tokenizer)
    config.model.pre_norm, config.model.tie_embeddings = pre_norm, tied
    model = _random_model(config, tokenizer)
    out = export_transformers(model, tokenizer, config, tmp_path / "hf")
    hf_model, hf_tokenizer = _load(out)
    assert type(hf_model).__name__ == architecture and type(hf_tokenizer).__name__ == "MarianTokenizer"
    assert json.loads((out / "export-manifest.json").read_text())["format"] == "transformers"
    assert not (out / "spm.model").exists()  # the tokenizer's files carry the SentencePiece models
    assert all(str(tmp_path).encode() not in path.read_bytes() for path in out.iterdir())  # no staging path

    batch = hf_tokenizer(SOURCES, text_target=TARGETS, return_tensors="pt", padding=True)
    ours_src, ours_tgt = tokenizer.encode_src(SOURCES), tokenizer.encode_tgt(TARGETS)
    for row, ids in zip(batch["input_ids"].tolist(), ours_src):
        assert row[: len(ids) + 1] == ids + [EOS_ID]  # then padding
    for row, ids in zip(batch["labels"].tolist(), ours_tgt):
        assert row[: len(ids) + 1] == ids + [EOS_ID]
    known = [ids for ids in ours_tgt if UNK_ID not in ids]  # <unk> is a special token there: skipped
    assert len(known) >= 2
    assert hf_tokenizer.batch_decode(known, skip_special_tokens=True) == tokenizer.decode_tgt(known)

    src = pad_sequences(ours_src, suffix=[EOS_ID])  # (B, S)
    tgt_in = pad_sequences(ours_tgt, prefix=[BOS_ID])  # (B, T)
    with torch.no_grad():
        theirs = hf_model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        ).logits  # (B, T, V)
        ours = model(src, tgt_in)
    real = tgt_in != 0
    real[:, 0] = True
    assert theirs.shape == ours.shape
    assert torch.allclose(theirs[real], ours[real], atol=1e-4), (theirs[real] - ours[real]).abs().max()


@pytest.mark.parametrize(
    "tied,joint,key", [(False, True, "model.tie_embeddings=false"), (True, False, "separate source and target")]
)
def test_a_pre_norm_model_no_native_class_computes_is_refused_in_one_line(
    tied, joint, key, untrained_checkpoint, tmp_path, capsys
):
    _, tokenizer, config = model_from_checkpoint(load_checkpoint(untrained_checkpoint))
    tokenizer = tokenizer if joint else _separate(tokenizer)
    config.model.pre_norm, config.model.tie_embeddings = True, tied
    reason = refusal(config, tokenizer)
    assert reason and key in reason and "model.pre_norm=true" in reason
    model = _random_model(config, tokenizer)
    with pytest.raises(ValueError, match="cannot export to transformers: model.pre_norm=true"):
        export_transformers(model, tokenizer, config, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_residual_free_encoder_layer_is_refused_by_both_exports_with_the_key(untrained_checkpoint, tmp_path):
    from transformer.inference.ctranslate2 import export_ctranslate2

    _, tokenizer, config = model_from_checkpoint(load_checkpoint(untrained_checkpoint))
    config.model.residual_free_layer = 1
    reason = refusal(config, tokenizer)
    assert reason and "model.residual_free_layer=1" in reason and "--format safetensors" in reason
    model = _random_model(config, tokenizer)
    with pytest.raises(ValueError, match="cannot export to transformers: model.residual_free_layer=1"):
        export_transformers(model, tokenizer, config, tmp_path / "hf")
    with pytest.raises(ValueError, match="model.residual_free_layer=1: .*CTranslate2.*--format safetensors"):
        export_ctranslate2(model, tokenizer, tmp_path / "ct2")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "ct2").exists()


def test_a_multilingual_model_takes_marians_target_language_tag(untrained_checkpoint, tmp_path):
    src, tgt = generate(400, 10, 10)["train"]
    model_bytes = train_sentencepiece(
        src + tgt, vocab_size=130, model_type="bpe", character_coverage=1.0, sample=10_000, symbols=["<2de>", "<2en>"]
    )
    tokenizer = Tokenizer(model_bytes)
    assert tokenizer.target_languages == ["de", "en"]
    _, _, config = model_from_checkpoint(load_checkpoint(untrained_checkpoint))
    model = _random_model(config, tokenizer)
    out = export_transformers(model, tokenizer, config, tmp_path / "hf")
    _, hf_tokenizer = _load(out)
    for language in ("de", "en"):
        tagged = [f">>{language}<< {line}" for line in SOURCES[:3]]
        ids = hf_tokenizer(tagged)["input_ids"]
        assert ids == [row + [EOS_ID] for row in tokenizer.encode_src(SOURCES[:3], tgt_lang=language)]
    assert ">>en<<" in (out / "README.md").read_text()


def test_the_export_command_writes_a_transformers_directory_and_replaces_it_with_force(
    untrained_checkpoint, tmp_path, capsys
):
    out = tmp_path / "de-en-hf"
    code, stdout, stderr = run_main(export_command.main, capsys, untrained_checkpoint, out, "--format", "transformers")
    assert code == 0 and "(transformers)" in stdout, stderr
    names = sorted(p.name for p in out.iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md"} <= set(names)
    assert {"source.spm", "target.spm", "vocab.json", "tokenizer_config.json"} <= set(names)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["decoder_start_token_id"] == BOS_ID and generation["eos_token_id"] == EOS_ID
    assert generation["num_beams"] == 5 and generation["early_stopping"] is True
    code, _, stderr = run_main(export_command.main, capsys, untrained_checkpoint, out, "--format", "transformers")
    assert code == 2 and "pass --force" in stderr
    code, _, _ = run_main(export_command.main, capsys, untrained_checkpoint, out, "--format", "transformers", "--force")
    assert code == 0 and sorted(p.name for p in out.iterdir()) == names


# ----- a trained model: forced decoding and generate against ours on 300 sentences ------------------

MAX_NEW_TOKENS = 64  # ours: max_len_a=0, max_len_b=64, the same fixed limit (EOS included) for every sentence


@pytest.fixture(scope="module")
def trained_export(trained_checkpoint, tmp_path_factory):
    """(our Translator, the transformers model and tokenizer of its export, 300 sources, references)."""
    from transformer import Translator
    from transformer.data.sources import load_split_text
    from transformer.inference.test_results import test_results_for

    state = load_checkpoint(trained_checkpoint)
    model, tokenizer, config = model_from_checkpoint(state)
    assert config.model.pre_norm  # the default; post-norm's mapping is checked above with random weights
    tested = test_results_for(trained_checkpoint, state["step"])  # training wrote test_results.json
    assert tested and tested["split"] == "test" and tested["bleu_signature"].startswith("nrefs:1")
    trained = {"step": state["step"], "metrics": state["metrics"], "test": tested}
    out = export_transformers(model, tokenizer, config, tmp_path_factory.mktemp("export") / "hf", trained=trained)
    assert f"BLEU {tested['bleu']:.2f}" in (out / "README.md").read_text()
    sources, references = load_split_text(config.data, "validation")
    assert len(sources) >= 300
    translator = Translator(model, tokenizer, config, torch.device("cpu"), "fp32")
    return (translator, *_load(out), sources[:300], references[:300])


def _generate(hf_model, hf_tokenizer, sources, **options) -> list[str]:
    outputs = []
    for start in range(0, len(sources), 60):
        batch = hf_tokenizer(sources[start : start + 60], return_tensors="pt", padding=True)
        with torch.no_grad():
            ids = hf_model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, **options)
        outputs += hf_tokenizer.batch_decode(ids, skip_special_tokens=True)
    return outputs


@pytest.mark.slow
def test_forced_decoding_scores_of_the_export_are_ours(trained_export):
    translator, hf_model, hf_tokenizer, sources, references = trained_export
    ours = translator.score(sources, references)
    theirs = []
    for start in range(0, len(sources), 60):
        batch = hf_tokenizer(
            sources[start : start + 60], text_target=references[start : start + 60], return_tensors="pt", padding=True
        )
        labels = batch["labels"]
        labels = labels.masked_fill(labels == hf_tokenizer.pad_token_id, -100)  # (B, T): padding not scored
        with torch.no_grad():
            logits = hf_model(**batch.data | {"labels": labels}).logits  # (B, T, V)
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(2, labels.clamp(min=0)[:, :, None]).squeeze(2)
        theirs += logprobs.masked_fill(labels == -100, 0.0).sum(dim=1).tolist()
    assert max(abs(a - b) for a, b in zip(theirs, ours)) < 1e-4
    assert sum(ours) / len(ours) > -15  # a model that learned something: the check is not between two noises


@pytest.mark.slow
@pytest.mark.parametrize("beam", [1, 5])
def test_generate_translates_as_transformer_translate(beam, trained_export):
    translator, hf_model, hf_tokenizer, sources, references = trained_export
    penalty = {"alpha": 0.0} if beam > 1 else {}  # greedy search has no length penalty (and says so)
    ours = translator.translate(sources, beam_size=beam, max_len_a=0.0, max_len_b=MAX_NEW_TOKENS, **penalty)
    # The export's generation_config.json: early_stopping, forced EOS and the never-generated tokens as ours;
    # the beam and the length penalty given here as transformer-translate's (alpha=0: raw log-probabilities).
    theirs = _generate(hf_model, hf_tokenizer, sources, num_beams=beam, length_penalty=0.0)
    assert sum(a == b for a, b in zip(theirs, ours)) >= 0.99 * len(sources)
    assert sum(a == b for a, b in zip(ours, references)) >= 0.2 * len(sources)  # it translates


def test_the_card_of_a_tested_checkpoint_holds_its_test_scores_and_no_path_of_this_machine(
    untrained_checkpoint, tmp_path, capsys, monkeypatch
):
    import yaml

    from transformer.checkpoint import save_checkpoint
    from transformer.inference.test_results import test_results_for, write_test_results

    state = load_checkpoint(untrained_checkpoint)
    home = tmp_path / "home" / "alice"
    state["config"]["data"].update(name="custom", embedded=False, path=str(home / "corpus"))
    state["config"]["run_dir"] = str(home / "runs" / "today")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    save_checkpoint(state, run / "checkpoints" / "best.pt")
    signature = "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.5.1|norm:nfc"
    scores = {"bleu": 31.416, "chrf": 55.5, "bleu_signature": signature, "chrf_signature": "nrefs:1|c"}
    details = {"split": "test", "sentences": 500, "beam": 5, "src_lang": "de", "tgt_lang": "en"}
    write_test_results(run, run / "checkpoints" / "best.pt", 10, details, scores)
    assert test_results_for(run / "checkpoints" / "best.pt", 11) is None  # other weights than those tested
    assert test_results_for(run / "checkpoints" / "last.pt", 10) is None
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "de-en-hf"
    best = run / "checkpoints" / "best.pt"
    code, _, err = run_main(export_command.main, capsys, best, out, "--format", "transformers")
    assert code == 0, err
    for path in out.iterdir():
        for where in (str(tmp_path), "/alice/"):
            assert where.encode() not in path.read_bytes(), (path.name, where)
    card = (out / "README.md").read_text()
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["library_name"] == "transformers" and meta["language"] == ["de", "en"] and meta["license"]
    (result,) = meta["model-index"][0]["results"]
    assert result["task"] == {"type": "translation", "name": "Translation de-en"}
    assert result["dataset"]["split"] == "test" and result["dataset"]["name"] == "custom"
    assert [(m["type"], m["value"]) for m in result["metrics"]] == [("bleu", 31.42), ("chrf", 55.5)]
    assert result["metrics"][0]["args"] == signature
    for text in (
        "On the test split (`test`, 500 sentences, beam 5)",
        "BLEU 31.42",
        f"Test BLEU signature: `{signature}`",
        'AutoModelForSeq2SeqLM.from_pretrained("de-en-hf")',
        'AutoTokenizer.from_pretrained("de-en-hf")',
        "num_beams=5",
        "PegasusForConditionalGeneration",
        "--format safetensors",
    ):
        assert text in card, text
