"""data.validate_zero_shot / trainer.select_zero_shot (issue 74): a multilingual run validates the directions
it never trains where data.path has text in both languages, with each direction's off-target rate, and
counts them in best.pt's choice only when asked."""

from __future__ import annotations

import pytest

from tests.helpers import FAST, compose_config
from transformer.data.toy import generate
from transformer.data.zero_shot import zero_shot_directions


def _three_languages(directory, fr_apart: bool = False):
    """Toy text in de, en and fr (the English reversed); corpora de <-> en and en <-> fr, data.path the
    directory of all three (`fr_apart`: the French corpus in a directory of its own, data.path without fr)."""
    french = directory / "fr" if fr_apart else directory
    french.mkdir(parents=True, exist_ok=True)
    for split, (src, tgt) in generate(300, 30, 30, seed=5).items():
        (directory / f"{split}.de").write_text("\n".join(src) + "\n")
        for folder in {directory, french}:
            (folder / f"{split}.en").write_text("\n".join(tgt) + "\n")
        (french / f"{split}.fr").write_text("\n".join(" ".join(t.split()[::-1]) for t in tgt) + "\n")
    pairs = ((directory, "de", "en"), (directory, "en", "de"), (french, "en", "fr"), (french, "fr", "en"))
    return [
        f"data.path={directory}",
        "data.name=three",
        "data.embedded=false",
        "data.corpora=[" + ", ".join(f"{{path: {d}, src_lang: {a}, tgt_lang: {b}}}" for d, a, b in pairs) + "]",
    ]


def test_the_zero_shot_directions_are_the_untrained_pairs_into_a_target_language(tmp_path):
    cfg = compose_config(FAST + _three_languages(tmp_path / "toy"))
    assert zero_shot_directions(cfg.data) == [("de", "fr"), ("fr", "de")]


@pytest.mark.slow
def test_a_run_validates_zero_shot_directions_and_counts_them_only_when_asked(tmp_path, data_cache):
    from transformer.training.trainer import train

    common = (
        FAST
        + _three_languages(tmp_path / "toy")
        + [
            "data.validate_zero_shot=true",
            "trainer.max_steps=4",
            "trainer.validate_every=4",
            "trainer.val_max_sentences=10",
            "decode.beam_size=1",
            "trainer.test_at_end=false",
            "trainer.max_minutes=0",
            "trainer.ema_decay=0",
            "trainer.attention_heatmaps=off",
        ]
    )
    logged = train(compose_config(common, data_cache), tmp_path / "logged")
    log = (tmp_path / "logged" / "train.log").read_text()
    for what in ("de-en", "en-fr", "de-fr", "fr-de", "mean of 2 zero-shot directions", "mean of 4 directions |"):
        assert f"validation step 4 {what}" in log, what
    assert "zero-shot validation: de-fr 30 pairs, fr-de 30 pairs" in log
    de_fr = next(line for line in log.splitlines() if "validation step 4 de-fr" in line)
    assert "| off-target " in de_fr
    entry = logged["val_history"][-1]
    trained = [entry[f"bleu_{d}"] for d in ("de-en", "en-de", "en-fr", "fr-en")]
    assert entry["bleu"] == pytest.approx(sum(trained) / 4)
    counted = train(compose_config(common + ["trainer.select_zero_shot=true"], data_cache), tmp_path / "counted")
    entry = counted["val_history"][-1]
    every = [entry[f"bleu_{d}"] for d in ("de-en", "en-de", "en-fr", "fr-en", "de-fr", "fr-de")]
    assert entry["bleu"] == pytest.approx(sum(every) / 6)
    assert "mean of 6 directions (zero-shot included)" in (tmp_path / "counted" / "train.log").read_text()


def test_a_zero_shot_direction_without_text_is_named_and_left_out(tmp_path, data_cache, caplog):
    import logging

    from transformer.data.prepare import prepare

    cfg = compose_config(
        FAST + _three_languages(tmp_path / "toy", fr_apart=True) + ["data.validate_zero_shot=true"],
        data_cache,
    )
    with caplog.at_level(logging.INFO):
        data = prepare(cfg.data)
    assert data.zero_shot == {}
    assert "no validation text in data.path / data.hub_id for de-fr, fr-de" in caplog.text
