import pytest

from transformer.inference.scoring import score


def test_score_uses_sacrebleu_defaults():
    result = score(["The dog runs ."], ["The dog runs ."])
    assert result["bleu"] == pytest.approx(100.0)
    assert "tok:13a" in result["bleu_signature"] and "case:mixed" in result["bleu_signature"]


def test_bleu_tokenizes_for_the_target_language():
    from transformer.inference.scoring import score

    hyps, refs = ["我喜欢猫和狗"], ["我喜欢狗和猫"]
    chinese = score(hyps, refs, "zh")
    assert "tok:zh" in chinese["bleu_signature"] and chinese["bleu"] > 0
    assert score(hyps, refs, "en")["bleu"] == 0.0  # 13a sees one word each: no match
    assert "tok:13a" in score(["a b"], ["a b"], "de")["bleu_signature"]


def test_bleu_without_the_japanese_extras_falls_back_to_characters(caplog):
    import importlib.util

    from transformer.inference.scoring import bleu_metric, score

    bleu_metric.cache_clear()  # the fallback is announced once per process
    result = score(["猫が好きです"], ["猫が好きです"], "ja")
    if importlib.util.find_spec("MeCab") is None:
        assert "tok:char" in result["bleu_signature"] and "sacrebleu[ja]" in caplog.text
    assert result["bleu"] == pytest.approx(100.0)


def test_references_in_another_unicode_form_score_the_same():
    import unicodedata

    from transformer.inference.scoring import score

    hypotheses = ["Der Mann fährt über die Brücke.", "Ein Café in Köln öffnet früh.", "Zoë naïve résumé."]
    decomposed = [unicodedata.normalize("NFD", line) for line in hypotheses]
    assert decomposed != hypotheses
    composed = score(hypotheses, hypotheses, "de")
    assert composed["bleu"] == pytest.approx(100.0) and composed["chrf"] == pytest.approx(100.0)
    for hyps, refs in ((hypotheses, decomposed), (decomposed, hypotheses), (decomposed, decomposed)):
        assert score(hyps, refs, "de") == composed
    assert composed["bleu_signature"].endswith("|norm:nfc") and composed["chrf_signature"].endswith("|norm:nfc")


def test_the_literature_bleu_tokenizes_and_lowercases_our_output_like_its_references():
    from transformer.inference.scoring import literature_tokenize, tokenized_lowercased_bleu

    hypotheses = ['One man\'s head, "down" & out.', "A dog runs."]
    assert literature_tokenize(hypotheses, "en") == [
        "one man &apos;s head , &quot; down &quot; &amp; out .",
        "a dog runs .",
    ]
    references = ["one man &apos;s head , &quot; down &quot; &amp; out .", "a dog runs ."]
    assert tokenized_lowercased_bleu(hypotheses, references, "en")["bleu_tokenized_lc"] == pytest.approx(100.0)
    # the cased detokenized score of the same output against the raw references is a different number
    raw = ['One man\'s head, "down" & out.', "The dog runs."]
    literature = tokenized_lowercased_bleu(hypotheses, literature_tokenize(raw, "en"), "en")
    assert literature["bleu_tokenized_lc"] != pytest.approx(score(hypotheses, raw, "en")["bleu"])
    assert "tok:none" in literature["bleu_tokenized_lc_signature"]
    assert "case:lc" in literature["bleu_tokenized_lc_signature"]


@pytest.mark.parametrize("lang", ["en", "de", "cs"])
def test_the_literature_tokenization_reproduces_multi30k_tokenized_references(multi30k_dir, lang):
    from transformer.inference.scoring import literature_tokenize

    raw = (multi30k_dir / f"test_2016_flickr.{lang}").read_text(encoding="utf-8").splitlines()
    tokenized = (multi30k_dir / "tok" / f"test_2016_flickr.lc.norm.tok.{lang}").read_text(encoding="utf-8").splitlines()
    assert literature_tokenize(raw, lang) == tokenized  # every one of the 1,000 lines


def test_evaluate_reports_the_literature_bleu_beside_ours(untrained_checkpoint, tmp_path, capsys):
    import json
    import shutil

    from transformer.cli.evaluate import main

    checkpoint = tmp_path / "best.pt"
    shutil.copy(untrained_checkpoint, checkpoint)
    src, ref, tok = tmp_path / "s.de", tmp_path / "r.en", tmp_path / "r.tok.en"
    src.write_text("Ein Hund.\nZwei Katzen.\n")
    ref.write_text("A dog.\nTwo cats.\n")
    tok.write_text("a dog .\ntwo cats .\n")
    common = [str(checkpoint), "--src", str(src), "--ref", str(ref), "--beam", "1", "--max-len-b", "3"]
    assert main(common + ["--tokenized-lc", str(tok)]) == 0
    out = capsys.readouterr().out
    assert "BLEU tokenized and lowercased, as the literature reports it" in out
    scores = json.loads((tmp_path / "best.s.de.beam1.json").read_text())
    assert {"bleu", "bleu_tokenized_lc", "bleu_tokenized_lc_signature"} <= set(scores)
    tok.write_text("a dog .\n")
    assert main(common + ["--tokenized-lc", str(tok)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"transformer-evaluate: error: --tokenized-lc {tok}: 1 lines for 2 sources; give the tokenized "
        "references of the same s.de lines"
    ]


def test_the_validator_computes_and_returns_without_writing(tmp_path, data_cache, caplog, monkeypatch):
    """`Validator.run`: the loss of the whole validation split, BLEU of trainer.val_max_sentences of it,
    the samples and the attention pictures, returned; nothing logged, nothing written."""
    import logging

    import torch

    from tests.helpers import FAST, compose_config
    from transformer.data.prepare import prepare
    from transformer.inference.translator import Translator
    from transformer.model import build_model
    from transformer.training.validate import Validator, validation_loss

    cfg = compose_config(FAST + ["trainer.val_max_sentences=7", "trainer.attention_heatmaps=heads"], data_cache)
    data = prepare(cfg.data)
    tok = data.tokenizer
    torch.manual_seed(0)
    model = build_model(cfg.model, tok.src_vocab_size, tok.tgt_vocab_size, tok.joint)
    translator = Translator(model, tok, cfg, torch.device("cpu"))
    text = data.sources["validation"].read_all()
    validator = Validator(cfg, model, translator, data.valid, text, torch.device("cpu"), translator.autocast, "heads")
    monkeypatch.chdir(tmp_path)
    caplog.clear()  # what preparing the data logged
    with caplog.at_level(logging.DEBUG):
        result = validator.run()
    assert not caplog.records and list(tmp_path.iterdir()) == []
    loss, nll, accuracy = validation_loss(
        model, data.valid, cfg.trainer.max_tokens, "cpu", translator.autocast, cfg.trainer.label_smoothing
    )
    assert (result.metrics["loss"], result.metrics["nll"], result.metrics["accuracy"]) == (loss, nll, accuracy)
    hypotheses = translator.translate(text[0][:7], beam_size=cfg.trainer.val_beam_size)
    assert result.samples == list(zip(text[0][:7], text[1][:7], hypotheses))
    assert result.metrics["bleu"] == score(hypotheses, text[1][:7], cfg.data.tgt_lang)["bleu"]
    assert len(result.panels) == len(validator.drawn) > 0
    kind, panels = result.detail
    assert kind == "heads" and [label for *_, label in panels] == [
        f"last layer, head {h + 1}" for h in range(cfg.model.n_heads)
    ]
    # ranks other than 0 draw nothing
    quiet = Validator(cfg, model, translator, data.valid, text, torch.device("cpu"), translator.autocast, None)
    assert quiet.run().panels == [] and quiet.run().detail is None


def test_the_validator_scores_noised_copies_as_transformer_evaluate_makes_them(data_cache, caplog):
    """trainer.val_augment: each variant's copy of the validation sentences decoded and scored beside the clean
    one (bleu_<variant>, chrf_<variant>), with the evaluation's seed; the log line names each; a bad name refused."""
    import logging

    import pytest
    import torch

    from tests.helpers import FAST, compose_config
    from transformer.config import ConfigError
    from transformer.data.augment import EVALUATION_SEED, augment_pairs
    from transformer.data.prepare import prepare
    from transformer.inference.translator import Translator
    from transformer.model import build_model
    from transformer.training.selection import _log_validation
    from transformer.training.validate import Validator

    cfg = compose_config(FAST + ["trainer.val_max_sentences=6", "trainer.val_augment=[upper,typos]"], data_cache)
    data = prepare(cfg.data)
    tok = data.tokenizer
    torch.manual_seed(0)
    model = build_model(cfg.model, tok.src_vocab_size, tok.tgt_vocab_size, tok.joint)
    translator = Translator(model, tok, cfg, torch.device("cpu"))
    text = data.sources["validation"].read_all()
    metrics = Validator(cfg, model, translator, data.valid, text, torch.device("cpu"), translator.autocast, None).run()
    metrics = metrics.metrics
    for name in ("upper", "typos"):
        sources, references = augment_pairs(text[0][:6], text[1][:6], name, EVALUATION_SEED)
        assert sources != text[0][:6]
        expected = score(translator.translate(sources, beam_size=1), references, cfg.data.tgt_lang)
        assert (metrics[f"bleu_{name}"], metrics[f"chrf_{name}"]) == (expected["bleu"], expected["chrf"])
    assert "bleu_title" not in metrics
    with caplog.at_level(logging.INFO):
        _log_validation(100, {**metrics, "bleu_raw": 1.0}, "raw", "", "")
    assert (
        caplog.records[-1]
        .getMessage()
        .endswith(f"| upper BLEU {metrics['bleu_upper']:.2f} | typos BLEU {metrics['bleu_typos']:.2f}")
    )
    with pytest.raises(ConfigError, match=r"trainer.val_augment=\['upper', 'caps'\]: 'caps' is not a variant"):
        compose_config(FAST + ["trainer.val_augment=[upper,caps]"], data_cache)
