import pytest

from transformer.validate import score


def test_score_uses_sacrebleu_defaults():
    result = score(["The dog runs ."], ["The dog runs ."])
    assert result["bleu"] == pytest.approx(100.0)
    assert "tok:13a" in result["bleu_signature"] and "case:mixed" in result["bleu_signature"]


def test_bleu_tokenizes_for_the_target_language():
    from transformer.validate import score
    hyps, refs = ["我喜欢猫和狗"], ["我喜欢狗和猫"]
    chinese = score(hyps, refs, "zh")
    assert "tok:zh" in chinese["bleu_signature"] and chinese["bleu"] > 0
    assert score(hyps, refs, "en")["bleu"] == 0.0        # 13a sees one word each: no match
    assert "tok:13a" in score(["a b"], ["a b"], "de")["bleu_signature"]


def test_bleu_without_the_japanese_extras_falls_back_to_characters(caplog):
    import importlib.util

    from transformer.validate import bleu_metric, score
    bleu_metric.cache_clear()                             # the fallback is announced once per process
    result = score(["猫が好きです"], ["猫が好きです"], "ja")
    if importlib.util.find_spec("MeCab") is None:
        assert "tok:char" in result["bleu_signature"] and "sacrebleu[ja]" in caplog.text
    assert result["bleu"] == pytest.approx(100.0)


def test_references_in_another_unicode_form_score_the_same():
    import unicodedata

    from transformer.validate import score
    hypotheses = ["Der Mann fährt über die Brücke.", "Ein Café in Köln öffnet früh.", "Zoë naïve résumé."]
    decomposed = [unicodedata.normalize("NFD", line) for line in hypotheses]
    assert decomposed != hypotheses
    composed = score(hypotheses, hypotheses, "de")
    assert composed["bleu"] == pytest.approx(100.0) and composed["chrf"] == pytest.approx(100.0)
    for hyps, refs in ((hypotheses, decomposed), (decomposed, hypotheses), (decomposed, decomposed)):
        assert score(hyps, refs, "de") == composed
    assert composed["bleu_signature"].endswith("|norm:nfc") and composed["chrf_signature"].endswith("|norm:nfc")
