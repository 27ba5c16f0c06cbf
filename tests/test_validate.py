import pytest

from transformer.validate import score


def test_score_uses_sacrebleu_defaults():
    result = score(["The dog runs ."], ["The dog runs ."])
    assert result["bleu"] == pytest.approx(100.0)
    assert "tok:13a" in result["bleu_signature"] and "case:mixed" in result["bleu_signature"]
