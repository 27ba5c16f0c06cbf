"""Language identification (transformer/data/langid.py): the off-target rate transformer-evaluate reports for
a multilingual model, and the cleaning rule data.langid (whole corpus or one corpus of a mixture),
against py3langid asked one sentence at a time."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from tests.helpers import compose_config
from transformer.config import ConfigError, CorpusConfig, DataConfig
from transformer.data import cleaning as cleaning_module
from transformer.data import langid
from transformer.data.corpus import encoded_split
from transformer.data.mixture import corpus_config
from transformer.data.sources import DataError, InMemory
from transformer.data.tokenizer import build_tokenizer

ENGLISH = [
    "A man in a blue shirt is standing on a ladder and cleaning the windows.",
    "Two young girls are playing in the sand at the beach.",
    "A brown dog runs through the green grass with a ball in its mouth.",
]
GERMAN = [
    "Ein Mann in einem blauen Hemd steht auf einer Leiter und putzt die Fenster.",
    "Zwei junge Mädchen spielen am Strand im Sand.",
    "Ein brauner Hund läuft mit einem Ball im Maul durch das grüne Gras.",
]
FRENCH = [
    "Un homme en chemise bleue est debout sur une échelle et nettoie les fenêtres.",
    "Deux jeunes filles jouent dans le sable à la plage.",
    "Un chien brun court dans l'herbe verte avec une balle dans la gueule.",
]


def test_off_target_counts_translations_in_another_of_the_models_languages():
    hypotheses = ENGLISH + [GERMAN[0], FRENCH[0], FRENCH[1], "  "]  # the blank one is not counted
    assert langid.off_target(hypotheses, "en", ["de", "en", "fr"]) == {
        "off_target": 50.0,
        "off_target_count": 3,
        "off_target_languages": {"fr": 2, "de": 1},
        "off_target_among": ["de", "en", "fr"],
    }
    assert langid.off_target(GERMAN, "de", ["de", "en"])["off_target"] == 0.0
    assert langid.off_target(GERMAN, "de_DE", ["de_DE", "en"])["off_target_count"] == 0  # our codes, its codes
    assert langid.off_target(ENGLISH, "en", ["en", "xx"]) is None  # a language py3langid does not know
    assert langid.off_target(ENGLISH, "en", ["en"]) is None  # nothing to tell apart


def _reference_flags(src, tgt, src_lang, tgt_lang):
    """One sentence at a time, straight from py3langid."""
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    identifier = LanguageIdentifier.from_model_file(MODEL_FILE)
    return [
        (1 if s.strip() and identifier.classify(s)[0] != src_lang else 0)
        | (2 if t.strip() and identifier.classify(t)[0] != tgt_lang else 0)
        for s, t in zip(src, tgt)
    ]


def test_language_flags_mark_each_side_and_the_process_pool_agrees(monkeypatch):
    src = GERMAN + ENGLISH + ["", GERMAN[1]] + GERMAN
    tgt = ENGLISH + ENGLISH + [ENGLISH[0], " "] + FRENCH
    chunks = [(src[:5], tgt[:5]), (src[5:], tgt[5:])]
    expected = [0, 0, 0, 1, 1, 1, 0, 0, 2, 2, 2]
    assert _reference_flags(src, tgt, "de", "en") == expected
    assert langid.language_flags(chunks, "de", "en", len(src)).tolist() == expected
    done = []
    monkeypatch.setattr(langid, "PARALLEL_FROM", 1)  # spawned processes, batches of 4
    monkeypatch.setattr(langid, "BATCH_LINES", 4)
    assert langid.language_flags(chunks, "de", "en", len(src), done.append).tolist() == expected
    assert done == [4, 1, 4, 2] and sum(done) == len(src)
    with pytest.raises(
        DataError, match="^langid: py3langid does not know the language code\\(s\\) xx \\(the corpus's src_lang"
    ):
        langid.language_flags(chunks, "xx", "en", len(src))


def test_data_langid_drops_pairs_in_another_language_counts_them_and_identifies_once(tmp_path, caplog, monkeypatch):
    src = GERMAN + [ENGLISH[0], GERMAN[0], GERMAN[2]]
    tgt = ENGLISH + [ENGLISH[1], FRENCH[0], ENGLISH[0]]
    tokenizer = build_tokenizer(InMemory(src * 5, tgt * 5, "unit"), vocab_size=150, cache_dir=tmp_path)
    plain = DataConfig(name="unit", embedded=True, cache_dir=str(tmp_path))
    cleaned = DataConfig(name="unit", embedded=True, cache_dir=str(tmp_path), langid=True)
    assert len(encoded_split(InMemory(src, tgt, "unit"), tokenizer, plain, "train")) == 6
    # prepared already, languages not yet identified: a reader without the lock gets nothing
    assert encoded_split(InMemory(src, tgt, "unit"), tokenizer, cleaned, "train", build=False) is None
    with caplog.at_level(logging.INFO):
        corpus = encoded_split(InMemory(src, tgt, "unit"), tokenizer, cleaned, "train")
        corpus.report()
    assert "identified the languages of 6 pairs" in caplog.text and "1 sources not de, 1 targets not en" in caplog.text
    assert "dropped 2 of 6 pairs (language: 2; max_len=256, " in caplog.text
    assert "max_len_ratio=9, langid=true)" in caplog.text and "data.langid=true" not in caplog.text
    kept = tokenizer.decode_tgt([corpus.ids(i)[1] for i in range(len(corpus))])
    assert kept == ENGLISH + [ENGLISH[0]]
    np.testing.assert_array_equal(np.load(corpus.directory / "langid.de-en.npy"), [0, 0, 0, 1, 2, 0])

    def never(*args, **kwargs):
        raise AssertionError("identified again")

    monkeypatch.setattr(cleaning_module, "language_flags", never)
    assert len(encoded_split(InMemory(src, tgt, "unit"), tokenizer, cleaned, "train")) == 4  # read, not found again
    assert len(encoded_split(InMemory(src, tgt, "unit"), tokenizer, cleaned, "validation")) == 6  # never cleaned
    # a file cut short by a killed run is found again
    (corpus.directory / "langid.de-en.npy").write_bytes(b"\x93NUMPY")
    monkeypatch.undo()
    assert len(encoded_split(InMemory(src, tgt, "unit"), tokenizer, cleaned, "train")) == 4


def test_a_corpus_of_a_mixture_may_set_its_own_cleaning_rules():
    data = DataConfig(path="/clean", drop_copies=True, max_len_ratio=9.0)
    crawled = corpus_config(data, CorpusConfig(path="/crawled", langid=True, drop_copies=False))
    assert (crawled.langid, crawled.drop_copies, crawled.max_len_ratio, crawled.drop_duplicates) == (
        True,
        False,
        9.0,
        True,
    )
    clean = corpus_config(data, CorpusConfig(path="/clean"))
    assert (clean.langid, clean.drop_copies) == (False, True)
    cfg = compose_config(
        [
            "data=custom",
            "data.path=/clean",
            "data.corpora=[{path: /clean}, {path: /crawled, langid: true, max_len_ratio: 3}]",
        ]
    )
    assert [c.langid for c in cfg.data.corpora] == [None, True] and cfg.data.corpora[1].max_len_ratio == 3.0
    with pytest.raises(ConfigError, match="data.corpora\\[1\\].max_len_ratio=0.5 must be 0 \\(off\\) or at least 1"):
        compose_config(
            ["data=custom", "data.path=/clean", "data.corpora=[{path: /clean}, {path: /crawled, max_len_ratio: 0.5}]"]
        )


def test_a_language_code_py3langid_does_not_know_is_refused_before_any_corpus_is_read():
    """Found only when the cleaning rule first ran (after the corpus was read and SentencePiece trained):
    now when the run's config is checked, for one corpus and for a data.corpora entry with its own rule."""
    for data in (
        DataConfig(name="unit", src_lang="xx", tgt_lang="en", langid=True),
        DataConfig(
            name="unit",
            src_lang="de",
            tgt_lang="en",
            corpora=[
                CorpusConfig(path="/nowhere", src_lang="de", tgt_lang="en"),
                CorpusConfig(path="/elsewhere", src_lang="yy", tgt_lang="en", langid=True),
            ],
        ),
    ):
        with pytest.raises(
            ConfigError,
            match=r"^langid: py3langid does not know the language code\(s\) "
            rf"{data.directions()[-1][0]} .* it knows .*\bde\b",
        ):
            data.validate_for_training()
    DataConfig(name="unit", src_lang="xx", tgt_lang="en").validate_for_training()  # the rule off: any code
    DataConfig(name="unit", src_lang="de", tgt_lang="en", langid=True).validate_for_training()
