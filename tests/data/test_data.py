import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer.config import ConfigError, DataConfig
from transformer.data import lines as lines_module
from transformer.data import toy
from transformer.data.arrays import compact
from transformer.data.batching import (
    TokenBatchSampler,
    UpdateSampler,
    batches_in_order,
    pack_sorted,
    pad_sequences,
)
from transformer.data.cleaning import Cleaning
from transformer.data.corpus import EncodedCorpus, encoded_split
from transformer.data.lines import read_lines
from transformer.data.prepare import prepare
from transformer.data.sources import DataError, InMemory, ParallelFiles, load_split_text, open_split
from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizer


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_line_count_mismatch_names_both_files_and_counts(tmp_path):
    _write(tmp_path / "train.de", b"a\nb\nc\n")
    _write(tmp_path / "train.en", b"a\nb\n")
    cfg = DataConfig(path=str(tmp_path))
    with pytest.raises(DataError) as error:
        load_split_text(cfg, "train")
    message = str(error.value)
    assert "train.de has 3 lines" in message and "train.en has 2" in message


def test_invalid_utf8_names_file_and_line(tmp_path):
    _write(tmp_path / "train.de", b"eins\nzwei\n" + b"dr\xe9i\n")
    _write(tmp_path / "train.en", b"one\ntwo\nthree\n")
    with pytest.raises(DataError, match=r"train\.de:3: invalid UTF-8 \(byte 0xe9 at column 3\); .*`iconv -f latin1 "):
        load_split_text(DataConfig(path=str(tmp_path)), "train")
    _write(tmp_path / "train.de", "eins\nzwei\ndrei\n".encode("utf-16"))  # with its byte-order mark
    with pytest.raises(
        DataError,
        match=r"train\.de:1: invalid UTF-8 \(byte 0xff at column 1; the file is UTF-16\); "
        r"re-encode the file as UTF-8, e.g. `iconv -f utf-16 -t utf-8`",
    ):
        load_split_text(DataConfig(path=str(tmp_path)), "train")


def test_bom_crlf_and_unicode_line_separators(tmp_path):
    # U+2028 inside a line must not split it (str.splitlines would), CRLF and a BOM are stripped.
    path = _write(tmp_path / "x.de", "\ufeffa\r\nb\u2028c\r\n".encode())
    assert read_lines(path) == ["a", "b\u2028c"]


def test_missing_path_and_split_name_the_key(tmp_path):
    with pytest.raises(DataError, match="data.path=.*no such file"):
        load_split_text(DataConfig(path=str(tmp_path / "nope")), "train")
    with pytest.raises(DataError, match="no files for split 'train'"):
        load_split_text(DataConfig(path=str(tmp_path)), "train")


@pytest.mark.parametrize("kind", ["a FIFO", "a character device", "a directory"])
def test_a_split_file_that_is_not_a_regular_file_is_named_as_such(tmp_path, kind):
    (tmp_path / "train.en").write_text("a dog\n")
    make = {
        "a FIFO": os.mkfifo,
        "a character device": lambda path: path.symlink_to("/dev/null"),
        "a directory": Path.mkdir,
    }[kind]
    make(tmp_path / "train.de")
    with pytest.raises(
        DataError,
        match=rf"^{tmp_path}/train.de: is not a regular file \(it is {kind}\); "
        "give the text in a regular file$",
    ):
        open_split(DataConfig(path=str(tmp_path)), "train")


def test_a_data_path_or_tsv_that_is_not_a_regular_file_is_named_as_such(tmp_path):
    (tmp_path / "train.tsv").mkdir()
    with pytest.raises(DataError, match=r"train.tsv: is not a regular file \(it is a directory\)"):
        open_split(DataConfig(path=str(tmp_path)), "train")
    with pytest.raises(
        DataError,
        match=r"^data.path=/dev/null: is not a regular file or a directory \(it is a "
        r"character device\); point it at the directory of your corpus files$",
    ):
        open_split(DataConfig(path="/dev/null"), "train")


def test_unknown_hub_dataset_fails_with_the_key(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match="data.hub_id=no-such/dataset"):
        load_split_text(DataConfig(hub_id="no-such/dataset"), "train")


def test_without_network_the_hub_is_not_retried_for_half_a_minute(monkeypatch):
    """huggingface_hub retried an unresolvable host five times (about 25 s of "Retrying in 8s" lines);
    now the host is resolved first, and without it only the local cache is asked, at once."""
    import socket
    import time

    import datasets.config
    from huggingface_hub import constants

    from transformer.data.hub import cache_only_without_network

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # restored after the test
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    asked = []
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port: asked.append(host) or [("resolved",)])
    assert cache_only_without_network() is None and not constants.HF_HUB_OFFLINE  # a network: as before

    def unresolvable(host, port):
        asked.append(host)
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unresolvable)
    started = time.monotonic()
    with pytest.raises(
        DataError,
        match=r"^data.hub_id=no-such/dataset: cannot load split 'train' from the "
        r"HuggingFace hub \(no network: huggingface.co does not resolve, so only "
        r"the local HuggingFace cache was searched\)",
    ):
        load_split_text(DataConfig(hub_id="no-such/dataset"), "train")
    assert time.monotonic() - started < 15 and asked == ["huggingface.co", "huggingface.co"]
    assert constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE
    assert cache_only_without_network() is None and len(asked) == 2  # offline already: not asked again


def test_tsv_and_jsonl_sources(tmp_path):
    _write(tmp_path / "train.tsv", b"Hallo\tHello\nJa\tYes\n")
    assert load_split_text(DataConfig(path=str(tmp_path)), "train") == (["Hallo", "Ja"], ["Hello", "Yes"])
    _write(tmp_path / "test.tsv", b"only one field\n")
    with pytest.raises(DataError, match=r"test\.tsv:1: expected 2 tab-separated fields"):
        load_split_text(DataConfig(path=str(tmp_path)), "test")
    rows = [{"translation": {"de": "Haus", "en": "house"}}, {"translation": {"de": "Maus", "en": "mouse"}}]
    (tmp_path / "validation.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert load_split_text(DataConfig(path=str(tmp_path)), "validation") == (["Haus", "Maus"], ["house", "mouse"])


def test_a_tsv_header_is_skipped_and_csv_quoting_is_said_not_guessed(tmp_path, caplog):
    """pandas' df.to_csv(sep="\\t") writes the column names first and quotes a field holding a quote: the
    header is no pair; quoted fields are kept as they are (a sentence may be in quotes) with one warning."""
    for header in (b"de\ten\n", b"Source\tTarget\n", b"src\ttgt\n"):
        _write(tmp_path / "train.tsv", header + b"Hallo\tHello\n")
        with caplog.at_level(logging.INFO, logger="transformer.data.sources"):
            assert load_split_text(DataConfig(path=str(tmp_path)), "train") == (["Hallo"], ["Hello"])
        assert "line 1 (" in caplog.text and "is a header, not a pair: skipped" in caplog.text
    _write(tmp_path / "train.tsv", b"Hallo\tHello\nde\ten\n")  # not on line 1: a pair like any other
    assert load_split_text(DataConfig(path=str(tmp_path)), "train") == (["Hallo", "de"], ["Hello", "en"])
    caplog.clear()
    _write(tmp_path / "train.tsv", b'"Er sagte ""ja"""\t"He said ""yes"""\n"Hallo"\tHello\n')
    with caplog.at_level(logging.WARNING, logger="transformer.data.sources"):
        for _ in range(2):
            assert load_split_text(DataConfig(path=str(tmp_path)), "train") == (
                ['"Er sagte ""ja"""', '"Hallo"'],
                ['"He said ""yes"""', "Hello"],
            )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "train.tsv:1: a field in CSV quotes" in warnings[0] and "QUOTE_NONE" in warnings[0]
    caplog.clear()
    _write(tmp_path / "validation.tsv", b'"Hallo"\tHello\n"Ja" und "Nein"\tYes and no\n')  # quotes in text
    with caplog.at_level(logging.WARNING, logger="transformer.data.sources"):
        load_split_text(DataConfig(path=str(tmp_path)), "validation")
    assert not caplog.records
    _write(tmp_path / "test.tsv", b'"Ein\tTab"\tA tab\n')
    with pytest.raises(
        DataError,
        match=r"test.tsv:1: expected 2 tab-separated fields .*found 3; a field in CSV "
        r"quotes holding a TAB",
    ):
        load_split_text(DataConfig(path=str(tmp_path)), "test")


def test_a_single_file_is_a_training_split_only(tmp_path):
    """data.path=FILE once served every split: validation (and best.pt) and test ran on the training data."""
    _write(tmp_path / "train.tsv", b"Hallo\tHello\nJa\tYes\n")
    cfg = DataConfig(path=str(tmp_path / "train.tsv"))
    assert load_split_text(cfg, "train") == (["Hallo", "Ja"], ["Hello", "Yes"])
    _write(tmp_path / "train.de", b"Hallo\n")
    with pytest.raises(
        DataError,
        match=r"data.path=.*train.de: one file must be .tsv, .jsonl or .parquet, holding "
        r"both sides; plain text comes as two files \(train.de \+ train.en\)",
    ):
        load_split_text(DataConfig(path=str(tmp_path / "train.de")), "train")
    with pytest.raises(
        ConfigError,
        match=r"data.path=.*train.tsv: one file can be a training split only, and a run "
        r"needs a validation split too",
    ):  # refused before a run starts
        DataConfig(path=str(tmp_path / "train.tsv")).validate_for_training()
    for split in ("validation", "test"):
        with pytest.raises(
            DataError,
            match=rf"data.path=.*train.tsv: one file is a training split only \(the {split} "
            r"split would be the training data itself",
        ):
            load_split_text(cfg, split)


def _corpus(tmp_path, src, tgt, max_len=20, vocab=60):
    tokenizer = build_tokenizer(InMemory(src * 5, tgt * 5, "unit"), vocab_size=vocab, cache_dir=tmp_path)
    cfg = DataConfig(name="unit", embedded=True, cache_dir=str(tmp_path), max_len=max_len)
    return encoded_split(InMemory(src, tgt, "unit"), tokenizer, cfg, "train"), tokenizer


def test_empty_nul_and_overlong_pairs_are_dropped_and_counted(tmp_path, caplog):
    src = ["ein Hund", "", "eine Katze", "a\0b", "sehr " * 50, "das Haus", "  "]
    tgt = ["a dog", "nothing", "", "x", "very " * 50, "the house", "blank source"]
    corpus, tokenizer = _corpus(tmp_path, src, tgt)
    with caplog.at_level(logging.WARNING):
        corpus.report()
    assert "dropped 5 of 7 pairs (empty: 3, NUL byte: 1, too long: 1" in caplog.text
    kept = [corpus.ids(i) for i in range(len(corpus))]
    assert tokenizer.decode_tgt([t for _, t in kept]) == ["a dog", "the house"]
    assert [s for s, _ in kept] == tokenizer.encode_src(["ein Hund", "das Haus"])
    # the filter is applied at load time: another max_len reuses the same files
    assert len(EncodedCorpus(corpus.directory, None, "unit")) == 3


def test_cleaning_rules_are_counted_and_change_nothing_prepared(tmp_path, caplog):
    src = ["ein Hund", "ein Hund ", "Hallo", "eine Katze", "ein " * 12 + "Haus", "das Haus", "ein Hund"]
    tgt = ["a dog", "a dog", "Hallo", "a cat", "house", "the house", "the dog"]
    tokenizer = build_tokenizer(InMemory(src * 5, tgt * 5, "unit"), vocab_size=60, cache_dir=tmp_path)
    cfg = DataConfig(name="unit", embedded=True, cache_dir=str(tmp_path), max_len_ratio=3.0)
    corpus = encoded_split(InMemory(src, tgt, "unit"), tokenizer, cfg, "train")
    with caplog.at_level(logging.INFO):
        corpus.report()
    assert "dropped 3 of 7 pairs (duplicate: 1, copy: 1, length ratio: 1;" in caplog.text
    assert "WARNING" not in caplog.text  # cleaning is information
    assert tokenizer.decode_tgt([corpus.ids(i)[1] for i in range(len(corpus))]) == [
        "a dog",
        "a cat",
        "the house",
        "the dog",
    ]
    # the rules apply at load time: off, the same prepared files give every pair back
    off = DataConfig(
        name="unit", embedded=True, cache_dir=str(tmp_path), drop_duplicates=False, drop_copies=False, max_len_ratio=0.0
    )
    again = encoded_split(InMemory(src, tgt, "unit"), tokenizer, off, "train")
    assert again.directory == corpus.directory and len(again) == 7
    # and never on the validation split
    assert len(encoded_split(InMemory(src, tgt, "unit"), tokenizer, cfg, "validation")) == 7
    with pytest.raises(ConfigError, match="data.max_len_ratio=0.5 must be 0 \\(off\\) or at least 1"):
        DataConfig(max_len_ratio=0.5).validate()


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"character_coverage": 0.9}, r"data.character_coverage=0.9 must be in \[0.98, 1\]"),
        ({"character_coverage": 1.5}, r"data.character_coverage=1.5 must be in \[0.98, 1\]"),
        ({"tokenizer_sample": 50}, r"data.tokenizer_sample=50 must be above 100 sentences .*or 0 for every sentence"),
        ({"tokenizer_sample": -1}, r"data.tokenizer_sample=-1 must be above 100"),
    ],
)
def test_sentencepiece_settings_outside_its_bounds_are_refused_before_reading_the_corpus(setting, message):
    """SentencePiece checks them only after the whole corpus is read, with its own INTERNAL error."""
    with pytest.raises(ConfigError, match=message):
        DataConfig(path="/corpus", **setting).validate_for_training()
    DataConfig(path="/corpus", **setting).validate()  # a saved config (an older checkpoint's) still loads
    DataConfig(path="/corpus", character_coverage=0.9995, tokenizer_sample=0).validate_for_training()  # both valid


def test_a_split_with_no_usable_pair_names_its_source(tmp_path):
    corpus, _ = _corpus(tmp_path, ["ein Hund", "", "x"], ["a dog", "y", ""], max_len=1)
    with pytest.raises(DataError, match=r"unit.* no usable sentence pairs left"):
        corpus.report()
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "train.de").write_text("\n \n\n")
    (tmp_path / "blank" / "train.en").write_text(" \n\n\n")
    for lang in ("de", "en"):
        (tmp_path / "blank" / f"validation.{lang}").write_text("x\n")
    with pytest.raises(DataError, match=r"blank/train.de \+ train.en: no usable sentence to train the tokenizer"):
        prepare(DataConfig(path=str(tmp_path / "blank"), cache_dir=str(tmp_path / "c")))


def test_prepared_corpus_round_trips_and_pickles_as_its_directory(tmp_path):
    import pickle

    src, tgt = toy.generate(300, 5, 5)["train"]
    corpus, tokenizer = _corpus(tmp_path, src, tgt, max_len=100, vocab=120)
    assert len(corpus) == 300
    assert [corpus.ids(i) for i in range(300)] == list(zip(tokenizer.encode_src(src), tokenizer.encode_tgt(tgt)))
    blob = pickle.dumps(corpus)
    assert len(blob) < 1000  # a path, not the arrays
    again = pickle.loads(blob)
    assert all(
        torch.equal(a, b)
        for a, b in zip(vars(again.collate([3, 1, 2])).values(), vars(corpus.collate([3, 1, 2])).values())
        if isinstance(a, torch.Tensor)
    )


RACE = """
import logging, sys, time
import transformer.data.corpus as corpus
from transformer.config import DataConfig
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
real = corpus._encode_to
def slow(*args, **kwargs):
    time.sleep(1.0)                 # hold the lock long enough for the other process to arrive
    real(*args, **kwargs)
corpus._encode_to = slow
from transformer.data.prepare import prepare
prepared = prepare(DataConfig(name="race", embedded=True, embedded_pairs=300, vocab_size=80,
                                     cache_dir=sys.argv[1]))
print("pairs", len(prepared.train))
"""


def test_concurrent_preparations_encode_once_and_share_the_files(tmp_path):
    import subprocess
    import sys

    procs = [
        subprocess.Popen([sys.executable, "-c", RACE, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    encoded = [out.count("tokens ->") for out in outputs]
    assert sorted(encoded) == [0, 2], outputs  # one process encoded train and validation
    assert all("pairs 300" in out for out in outputs)
    assert len(list((tmp_path / "corpus").iterdir())) == 2
    assert len(list((tmp_path / "spm").glob("*.model"))) == 1


def test_a_failed_preparation_leaves_no_temporary_files_and_its_own_error(tmp_path):
    for lang, lines in (("de", "ein Hund\neine Katze\nein Haus\n"), ("en", "a dog\na cat\n")):
        (tmp_path / f"train.{lang}").write_text(lines)
        (tmp_path / f"validation.{lang}").write_text(lines)
    cfg = DataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache"), vocab_size=30)
    with pytest.raises(DataError, match=r"^line counts differ: .*train.de has 3 lines"):  # not wrapped by SentencePiece
        prepare(cfg)
    from transformer.data.tokenizer import Tokenizer

    tokenizer = build_tokenizer(
        InMemory(["ein Hund"] * 5, ["a dog"] * 5, "unit"), vocab_size=30, cache_dir=tmp_path / "cache"
    )
    assert isinstance(tokenizer, Tokenizer)
    (tmp_path / "train.en").write_text("a dog\na cat\na house\n")  # train fine, validation not
    with pytest.raises(DataError, match=r"line counts differ: .*validation.de has 3 lines"):
        prepare(cfg, tokenizer)
    assert not [p for p in (tmp_path / "cache" / "corpus").iterdir() if ".tmp" in p.name]


def test_streaming_across_blocks_keeps_line_numbers_and_alignment(tmp_path, monkeypatch):
    monkeypatch.setattr(lines_module, "_BLOCK_BYTES", 16)  # many tiny blocks
    de = [f"Zeile {i} " + "ä" * (i % 7) for i in range(200)]
    en = [f"line {i}" for i in range(200)]
    (tmp_path / "train.de").write_text("\ufeff" + "\r\n".join(de) + "\r\n")
    (tmp_path / "train.en").write_text("\n".join(en))  # no final newline
    source = ParallelFiles(tmp_path / "train.de", tmp_path / "train.en")
    chunks = list(source.chunks(size=37))
    assert [len(s) for s, _ in chunks] == [37] * 5 + [15]
    assert source.read_all() == (de, en)
    raw = (tmp_path / "train.de").read_bytes()
    (tmp_path / "train.de").write_bytes(raw.replace(b"Zeile 150 ", b"Zeile\xff150 "))
    with pytest.raises(DataError, match=r"train\.de:151: invalid UTF-8 \(byte 0xff at column 6\)"):
        source.read_all()


def test_arrow_sources_stream_in_chunks(tmp_path):
    rows = [{"translation": {"de": f"Haus {i}", "en": f"house {i}"}} for i in range(25)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    source = open_split(DataConfig(path=str(tmp_path)), "train")
    assert [len(s) for s, _ in source.chunks(size=10)] == [10, 10, 5]
    assert source.read_all() == ([f"Haus {i}" for i in range(25)], [f"house {i}" for i in range(25)])
    with pytest.raises(
        DataError, match=r"'translation' column must map 'fr' and 'en' to text \(found keys \['de', 'en'\]\)"
    ):
        open_split(DataConfig(path=str(tmp_path), src_lang="fr"), "train")
    (tmp_path / "test.jsonl").write_text(json.dumps({"translation": "Haus -> house"}) + "\n")
    with pytest.raises(DataError, match=r"test.jsonl: the 'translation' column must map .* \(found type string\)"):
        open_split(DataConfig(path=str(tmp_path)), "test")


def test_a_jsonl_or_parquet_value_that_is_not_text_is_refused_and_utf8_bytes_are_decoded(tmp_path):
    """One non-string JSONL value makes `datasets` type the whole column as JSON: read with str(), every
    target would be trained with its quotes ('"house"') and every umlaut escaped; refused instead, naming
    the record. A Parquet binary column is UTF-8 text, decoded (str() gave "b'Zwei wei\\xc3\\x9fe'")."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"de": "weiße Häuser", "en": "white houses"}, {"de": "eine Maus", "en": 1999}]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(
        DataError, match=r"train.jsonl: column 'en' must hold text in every record \(record 2 holds 1999\)"
    ):
        open_split(DataConfig(path=str(tmp_path)), "train")
    nested = [{"translation": {"de": "Haus", "en": "house"}}, {"translation": {"de": ["Maus"], "en": "mouse"}}]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in nested) + "\n")
    with pytest.raises(DataError, match=r"column 'translation.de' must hold text .*record 2 holds \['Maus'\]"):
        open_split(DataConfig(path=str(tmp_path)), "train")
    nulls = [{"de": "weiße Häuser", "en": None}, {"de": None, "en": "a mouse"}]  # null: an empty side
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in nulls) + "\n")
    assert open_split(DataConfig(path=str(tmp_path)), "train").read_all() == (["weiße Häuser", ""], ["", "a mouse"])
    (tmp_path / "train.jsonl").unlink()
    table = pa.table({"de": pa.array(["weiße Häuser".encode(), None], pa.binary()), "en": ["white houses", "x"]})
    pq.write_table(table, tmp_path / "train.parquet")
    assert open_split(DataConfig(path=str(tmp_path)), "train").read_all() == (
        ["weiße Häuser", ""],
        ["white houses", "x"],
    )
    bad = pa.table({"de": pa.array([b"gut", b"wei\xdfe"], pa.binary()), "en": ["good", "white"]})
    pq.write_table(bad, tmp_path / "train.parquet")
    with pytest.raises(DataError, match=r"column 'de', record 2: bytes that are not UTF-8"):
        open_split(DataConfig(path=str(tmp_path)), "train").read_all()


def test_a_jsonl_file_rewritten_with_its_old_modification_time_is_read_again(tmp_path):
    """datasets keys its Arrow copy by path and modification time: `cp -p`, `rsync -a` or `touch -r` of
    a new version brought the old rows back, and the prepared corpus (keyed on datasets' fingerprint) too."""
    import os

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"de": f"Haus {i}", "en": f"house {i}"}) + "\n" for i in range(20)))
    old = os.stat(path)
    first = open_split(DataConfig(path=str(tmp_path)), "train")
    assert len(first.read_all()[0]) == 20
    path.write_text("".join(json.dumps({"de": f"Maus {i}", "en": f"mouse {i}"}) + "\n" for i in range(10)))
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
    again = open_split(DataConfig(path=str(tmp_path)), "train")
    assert again.read_all() == ([f"Maus {i}" for i in range(10)], [f"mouse {i}" for i in range(10)])
    assert again.fingerprint() != first.fingerprint()
    assert open_split(DataConfig(path=str(tmp_path)), "train").fingerprint() == again.fingerprint()  # stable


def test_embedded_corpus_is_a_real_translation_task():
    splits = toy.generate(3000, 200, 200)
    train_src, train_tgt = splits["train"]
    held_out = set(splits["test"][0]) | set(splits["validation"][0])
    assert not held_out & set(train_src)
    assert len(train_src) == 3000 and len(splits["test"][0]) == 200
    # not a copy: source and target vocabularies barely overlap
    src_words = {w for s in train_src for w in s.lower().split()}
    tgt_words = {w for s in train_tgt for w in s.lower().split()}
    assert len(src_words & tgt_words) < 0.1 * len(tgt_words)
    # reordering: German subordinate clauses put the verb last, English does not
    pair = next((s, t) for s, t in zip(train_src, train_tgt) if ", dass" in s and "hat." in s)
    assert pair[0].endswith("hat.") and " has " in pair[1]
    assert toy.generate(50, 10, 10) == toy.generate(50, 10, 10)  # deterministic


def _lengths(n=600, seed=0):
    import random

    rng = random.Random(seed)
    src_lens = [rng.randint(1, 30) for _ in range(n)]
    tgt_lens = [max(1, s + rng.randint(-3, 3)) for s in src_lens]
    return src_lens, tgt_lens


def _sampler(n=600, max_tokens=120, seed=3):
    src_lens, tgt_lens = _lengths(n)
    return TokenBatchSampler(src_lens, tgt_lens, max_tokens, seed), src_lens, tgt_lens


def test_batches_respect_the_token_budget_and_cover_every_pair_once():
    sampler, src_lens, tgt_lens = _sampler()
    for epoch in range(3):
        batches = sampler.batches(epoch).tolist()
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(src_lens)))  # each pair exactly once
        for batch in batches:
            width = max(max(src_lens[i], tgt_lens[i]) + 1 for i in batch)
            assert len(batch) * width <= 120
    assert sampler.batches(1).tolist() == _sampler()[0].batches(1).tolist()  # same seed and epoch: same
    assert sampler.batches(1).tolist() != sampler.batches(2).tolist()  # reshuffled per epoch
    assert _sampler(seed=4)[0].batches(1).tolist() != sampler.batches(1).tolist()


def _reference_batches(src_lens, tgt_lens, flags, max_len, max_tokens, seed, epoch, max_len_ratio=0.0):
    """The slow, obvious version of filtering + bucketing: a loop over pairs, Python sorting, one
    sentence at a time into the open batch. `flags[i]`: pair i is dropped whatever its lengths."""
    kept = [
        i
        for i in range(len(src_lens))
        if not flags[i]
        and 0 < src_lens[i] <= max_len
        and 0 < tgt_lens[i] <= max_len
        and not (max_len_ratio and max(src_lens[i], tgt_lens[i]) > max_len_ratio * min(src_lens[i], tgt_lens[i]))
    ]
    rng = np.random.default_rng([seed, epoch])
    tie = rng.random(len(kept))

    def key(k):
        s, t = src_lens[kept[k]] + 1, tgt_lens[kept[k]] + 1
        return (max(s, t), s, t, tie[k])

    order = sorted(range(len(kept)), key=key)
    batches, current, width = [], [], 0
    for k in order:
        new_width = max(width, key(k)[0])
        if current and (len(current) + 1) * new_width > max_tokens:
            batches.append(current)
            current, new_width = [], key(k)[0]
        current.append(k)
        width = new_width
    batches.append(current)
    return [[kept[k] for k in batches[b]] for b in rng.permutation(len(batches))]


@pytest.mark.parametrize("chunk", [1 << 20, 61])
def test_vectorised_filtering_and_batching_equal_the_slow_reference(tmp_path, monkeypatch, chunk):
    """Filtering, sorting and packing a chunk of pairs at a time (61: the loading, the epoch's sort and the
    width counts cross many chunk boundaries) give the batches of the obvious loop, epoch by epoch."""
    import random

    from transformer.data import batching, ordering
    from transformer.data import corpus as corpus_module

    for module in (batching, corpus_module, ordering):
        monkeypatch.setattr(module, "CHUNK_PAIRS", chunk)
    rng = random.Random(5)
    words = ["Hund", "Katze", "Haus", "rot", "läuft", "schnell", "ein", "der", "über", "Brücke"]
    src = [" ".join(rng.choices(words, k=rng.randint(0, 25))) for _ in range(700)]
    tgt = [" ".join(rng.choices(words, k=rng.randint(0, 25))) for _ in range(700)]
    for i in rng.sample(range(700), 20):
        src[i] = src[i] + "\0"
    for i in rng.sample(range(700), 30):  # copies, some with other spaces at the ends
        tgt[i] = src[i] + (" " if i % 2 else "")
    for i in rng.sample(range(1, 700), 40):  # repeats of an earlier pair
        j = rng.randrange(i)
        src[i], tgt[i] = " " + src[j], tgt[j]
    corpus, tokenizer = _corpus(tmp_path, src, tgt, max_len=40, vocab=80)
    src_all = [len(x) for x in tokenizer.encode_src(src)]
    tgt_all = [len(x) for x in tokenizer.encode_tgt(tgt)]
    seen, flags = set(), []
    for s, t in zip(src, tgt):
        pair = (s.strip(), t.strip())
        flags.append("\0" in s or not pair[0] or not pair[1] or pair in seen or pair[0] == pair[1])
        seen.add(pair)
    ratio_dropped = [not f and max(a, b) > 3 * max(min(a, b), 1) for f, a, b in zip(flags, src_all, tgt_all)]
    assert sum(ratio_dropped) > 20 and sum(flags) > 80  # every rule has work to do
    corpus = EncodedCorpus(corpus.directory, 40, "unit", Cleaning(duplicates=True, copies=True, max_len_ratio=3.0))
    sampler = TokenBatchSampler(corpus.src_lens, corpus.tgt_lens, max_tokens=300, seed=7)
    for epoch in range(3):
        ours = [corpus.pair_index[b].tolist() for b in sampler.batches(epoch)]
        assert ours == _reference_batches(src_all, tgt_all, flags, 40, 300, 7, epoch, max_len_ratio=3.0)
    assert corpus.dropped["duplicate"] > 0 and corpus.dropped["copy"] > 0 and corpus.dropped["length ratio"] > 0


def _greedy(widths, max_tokens):
    starts, count = [], 0
    for i, w in enumerate(widths):
        if count and (count + 1) * w > max_tokens:
            count = 0
        if count == 0:
            starts.append(i)
        count += 1
    return starts


@settings(max_examples=200, deadline=None)
@given(widths=st.lists(st.integers(1, 40), max_size=80), max_tokens=st.integers(1, 120))
def test_pack_sorted_equals_one_sentence_at_a_time(widths, max_tokens):
    widths = sorted(widths)
    assert pack_sorted(np.array(widths, dtype=np.int64), max_tokens).tolist() == _greedy(widths, max_tokens)


def test_collate_equals_padding_each_sentence_in_a_loop(tmp_path):
    src, tgt = toy.generate(200, 5, 5)["train"]
    corpus, tokenizer = _corpus(tmp_path, src, tgt, max_len=100, vocab=120)
    positions = [17, 3, 150, 42, 99]
    batch = corpus.collate(positions)
    pairs = [corpus.ids(p) for p in positions]
    width_s = max(len(s) for s, _ in pairs) + 1
    width_t = max(len(t) for _, t in pairs) + 1
    for row, (s, t) in enumerate(pairs):
        assert batch.src[row].tolist() == s + [EOS_ID] + [PAD_ID] * (width_s - len(s) - 1)
        assert batch.tgt_in[row].tolist() == [BOS_ID] + t + [PAD_ID] * (width_t - len(t) - 1)
        assert batch.tgt_out[row].tolist() == t + [EOS_ID] + [PAD_ID] * (width_t - len(t) - 1)
    assert batch.num_tgt_tokens == sum(len(t) + 1 for _, t in pairs)
    real = sum(len(s) + len(t) + 2 for s, t in pairs)
    assert batch.padding_share == pytest.approx(1 - real / (len(pairs) * (width_s + width_t)))
    assert batch.src.dtype == torch.int64


def test_length_bucketing_keeps_padding_low():
    sampler, src_lens, tgt_lens = _sampler(n=3000, max_tokens=1024)
    real = padded = 0
    for batch in sampler.batches(0).tolist():
        width_src = max(src_lens[i] for i in batch) + 1
        width_tgt = max(tgt_lens[i] for i in batch) + 1
        real += sum(src_lens[i] + 1 + tgt_lens[i] + 1 for i in batch)
        padded += len(batch) * (width_src + width_tgt)
    assert 1 - real / padded < 0.10


def test_update_plan_splits_global_batches_over_ranks_and_micro_batches():
    sampler, _, _ = _sampler(n=200, max_tokens=120)
    batches = sampler.batches(0).tolist()
    n = len(batches)
    one = list(UpdateSampler(sampler, update_freq=2))
    assert [[b.tolist() for b, *_ in plan] for plan, _ in one] == [batches[i : i + 2] for i in range(0, n, 2)]
    assert [key for plan, _ in one for *_, key in plan] == [(0, i) for i in range(n)]  # (epoch, batch)
    ranks = [list(UpdateSampler(sampler, update_freq=1, rank=r, world=2)) for r in (0, 1)]
    for k, ((plan0, used0), (plan1, used1)) in enumerate(zip(*ranks)):
        assert used0 == used1 == min(2, n - 2 * k)
        assert plan0[0][0].tolist() == batches[2 * k]
        if 2 * k + 1 < n:
            assert plan1 == [(plan1[0][0], 1.0, (0, 2 * k + 1))] and plan1[0][0].tolist() == batches[2 * k + 1]
        else:  # past the end: a weight-0 repeat keeps the ranks' backward passes equal
            assert plan1[0][1] == 0.0
    resumed = UpdateSampler(sampler, update_freq=2)
    resumed.start(0, 4)
    assert [[b.tolist() for b, *_ in p] for p, _ in resumed] == [batches[i : i + 2] for i in range(4, n, 2)]


def test_max_tokens_smaller_than_a_sentence_is_refused():
    with pytest.raises(DataError, match="trainer.max_tokens=10 is smaller than the longest sentence"):
        TokenBatchSampler([5, 30], [5, 4], max_tokens=10, seed=1)


def test_pad_sequences_and_batches_in_order():
    assert pad_sequences([[7, 8, 9], [10]], suffix=[EOS_ID]).tolist() == [
        [7, 8, 9, EOS_ID],
        [10, EOS_ID, PAD_ID, PAD_ID],
    ]
    assert pad_sequences([[11, 12], [13, 14, 15]], prefix=[BOS_ID]).tolist() == [
        [BOS_ID, 11, 12, PAD_ID],
        [BOS_ID, 13, 14, 15],
    ]
    assert batches_in_order([5, 1, 3], max_tokens=100) == [[1, 2, 0]]
    assert batches_in_order([5, 1, 3, 1], max_tokens=6) == [[1, 3], [2], [0]]


def test_multi30k_loads_from_local_files(multi30k_dir):
    cfg = DataConfig(
        name="multi30k_de_en",
        path=str(multi30k_dir),
        src_lang="de",
        tgt_lang="en",
        valid_split="validation",
        test_split="test",
        local_splits={"validation": "val", "test": "test_2016_flickr"},
    )
    src, tgt = load_split_text(cfg, "train")
    assert len(src) == len(tgt) == 29000
    assert len(load_split_text(cfg, "test")[0]) == 1000
    assert len(load_split_text(cfg, "validation")[0]) == 1014


def _sampled_corpus(tmp_path, sampling=0.1):
    import random

    rng = random.Random(3)
    words = ["Hund", "Katze", "Haus", "rot", "läuft", "schnell", "ein", "der", "über", "Brücke", "Straße"]
    src = [" ".join(rng.choices(words, k=rng.randint(3, 12))) for _ in range(300)]
    tgt = [" ".join(rng.choices(words, k=rng.randint(3, 12))) for _ in range(300)]
    tokenizer = build_tokenizer(InMemory(src, tgt, "unit"), vocab_size=120, cache_dir=tmp_path)
    cfg = DataConfig(name="unit", embedded=True, cache_dir=str(tmp_path), subword_sampling=sampling)
    return encoded_split(InMemory(src, tgt, "unit"), tokenizer, cfg, "train"), tokenizer, src, tgt


def test_subword_sampling_is_fresh_per_epoch_fixed_per_key_and_keeps_the_text(tmp_path):
    import pickle

    corpus, tokenizer, src, tgt = _sampled_corpus(tmp_path)
    plain = corpus.collate(range(40))
    corpus.enable_subword_sampling(tokenizer, 0.1, -1, seed=1)
    assert torch.equal(corpus.collate(range(40)).src, plain.src)  # no key: validation, the fixed segmentation
    first = corpus.collate(range(40), (0, 3))
    again = corpus.collate(range(40), (0, 3))
    worker = pickle.loads(pickle.dumps(corpus)).collate(range(40), (0, 3))  # as a DataLoader worker collates it
    assert all(
        torch.equal(getattr(first, k), getattr(b, k)) for b in (again, worker) for k in ("src", "tgt_in", "tgt_out")
    )
    next_epoch = corpus.collate(range(40), (1, 3))
    assert first.src.shape != plain.src.shape or not torch.equal(first.src, plain.src)
    assert first.src.shape != next_epoch.src.shape or not torch.equal(first.src, next_epoch.src)
    # other pieces, the same sentences
    pairs = corpus.pair_index[np.arange(40)]

    def rows(t, eos):
        return [[i for i in row if i not in (PAD_ID, eos)] for row in t.tolist()]

    assert tokenizer.src.decode(rows(first.src, EOS_ID)) == [src[p] for p in pairs]
    assert tokenizer.decode_tgt(rows(first.tgt_out, EOS_ID)) == [tgt[p] for p in pairs]
    assert first.num_tgt_tokens > plain.num_tgt_tokens  # BPE-dropout: more, smaller pieces


def test_subword_sampling_needs_the_kept_text_and_valid_settings(tmp_path):
    corpus, tokenizer, _, _ = _sampled_corpus(tmp_path, sampling=0.0)
    with pytest.raises(DataError, match="prepared without its text; data.subword_sampling needs it"):
        corpus.enable_subword_sampling(tokenizer, 0.1, -1, seed=1)
    with pytest.raises(ConfigError, match="data.subword_sampling=1.0 must be in \\[0, 1\\)"):
        DataConfig(subword_sampling=1.0).validate()
    with pytest.raises(ConfigError, match="data.subword_nbest=0 must be -1"):
        DataConfig(subword_nbest=0).validate()
    with pytest.raises(ConfigError, match="data.subword_nbest=4 applies to unigram sampling only"):
        DataConfig(subword_sampling=0.1, subword_nbest=4).validate_for_training()  # BPE-dropout has no n-best
    DataConfig(subword_sampling=0.1, subword_nbest=4, tokenizer_type="unigram").validate_for_training()


@pytest.mark.parametrize("name", ["web/crawl", "a\\b", "..", ""])
def test_a_data_name_that_cannot_name_a_directory_is_refused(name):
    with pytest.raises(ConfigError, match=f"data.name={re.escape(repr(name))} names directories and files"):
        DataConfig(name=name, path="corpus").validate()


def test_sampled_epochs_are_packed_by_their_own_lengths(tmp_path):
    """The sampler sees each epoch's sampled lengths, and collating reproduces them: every sampled batch
    keeps to the token budget (packing by the fixed lengths did not: a third of it was padding)."""
    corpus, tokenizer, _, _ = _sampled_corpus(tmp_path)
    corpus.enable_subword_sampling(tokenizer, 0.1, -1, seed=1)
    sampler = TokenBatchSampler(
        corpus.src_lens, corpus.tgt_lens, max_tokens=400, seed=7, epoch_lengths=corpus.epoch_lengths
    )
    for epoch in (0, 1):
        src_lens, tgt_lens = corpus.epoch_lengths(epoch)
        assert not np.array_equal(src_lens, corpus.src_lens)  # not the fixed segmentation
        for number, positions in enumerate(sampler.batches(epoch)):
            batch = corpus.collate(positions, (epoch, number))
            real_src = (batch.src != PAD_ID).sum(dim=1).numpy() - 1  # without EOS
            assert real_src.tolist() == src_lens[positions].tolist()
            assert ((batch.tgt_out != PAD_ID).sum(dim=1).numpy() - 1).tolist() == tgt_lens[positions].tolist()
            width = max(batch.src.size(1), batch.tgt_in.size(1))
            assert len(positions) == 1 or len(positions) * width <= 400


def test_a_corpus_file_written_to_while_it_is_prepared_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    """A file rewritten in place during `transformer-prepare` left a prepared corpus mixing old and new
    lines under the old content's key, reused by every later run on that file."""
    from transformer.data import corpus as corpus_module

    (tmp_path / "train.de").write_text("".join(f"Haus {i}\n" for i in range(50)))
    (tmp_path / "train.en").write_text("".join(f"house {i}\n" for i in range(50)))
    source = ParallelFiles(tmp_path / "train.de", tmp_path / "train.en")
    tokenizer = build_tokenizer(source, vocab_size=60, cache_dir=tmp_path)
    cfg = DataConfig(name="unit", embedded=True, cache_dir=str(tmp_path))
    write_split = corpus_module._write_split

    def written_to_meanwhile(*args, **kwargs):
        meta = write_split(*args, **kwargs)
        (tmp_path / "train.en").write_text("".join(f"home {i}\n" for i in range(50)))  # same line count
        return meta

    monkeypatch.setattr(corpus_module, "_write_split", written_to_meanwhile)
    with pytest.raises(
        DataError,
        match=r"train.en: changed while it was being prepared .* nothing was kept: run "
        "again once it is written",
    ):
        encoded_split(source, tokenizer, cfg, "train")
    assert not list((tmp_path / "corpus").glob("unit.train.*"))
    monkeypatch.setattr(corpus_module, "_write_split", write_split)
    fresh = ParallelFiles(tmp_path / "train.de", tmp_path / "train.en")  # the file as it is now
    assert len(encoded_split(fresh, tokenizer, cfg, "train")) == 50


def test_a_dangling_or_looping_symbolic_link_is_named_as_such(tmp_path):
    """Both were "file not found" / "no such file or directory" while the path was plainly there."""
    (tmp_path / "train.de").symlink_to(tmp_path / "gone.de")
    (tmp_path / "train.en").write_text("house\n")
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    with pytest.raises(DataError, match=r"train.de: a symbolic link to .*gone.de, which does not exist"):
        load_split_text(DataConfig(path=str(tmp_path)), "train")
    with pytest.raises(DataError, match=r"data.path=.*loop1: a symbolic link in a loop$"):
        load_split_text(DataConfig(path=str(tmp_path / "loop1")), "train")


@pytest.mark.parametrize("tie_bits", [32, 3])
@pytest.mark.parametrize("chunk", [7, 1000, 1 << 20])
def test_the_epochs_sort_equals_lexsort_over_many_groups_and_chunks(monkeypatch, chunk, tie_bits):
    """length_sorted_order is np.lexsort((tie, tgt, src, max(src, tgt))) without its int64 arrays: over
    groups that span chunks, groups larger than a chunk, equal tie-breaks (kept in index order), tie-break
    prefixes of 3 bits (nearly every pair shares its prefix with others of its group: the exact values
    decide), and the lexsort fallback for lengths beyond the group table."""
    from transformer.data import ordering
    from transformer.data.ordering import TieBreaks

    monkeypatch.setattr(ordering, "CHUNK_PAIRS", chunk)
    monkeypatch.setattr(ordering, "TIE_BITS", tie_bits)
    rng = np.random.default_rng(11)
    for count, top in [(0, 3), (1, 3), (5000, 3), (20000, 130)]:
        src, tgt = (compact(rng.integers(0, top, count)) for _ in range(2))
        tie = rng.random(count)
        tie[::3] = 0.25  # a third of them equal
        expected = np.lexsort((tie, tgt, src, np.maximum(src, tgt)))
        order = ordering.length_sorted_order(src, tgt, TieBreaks.of(tie))
        assert order.dtype == np.uint32 and np.array_equal(order, expected)
    monkeypatch.setattr(ordering, "GROUP_TABLE_ENTRIES", 4)
    assert np.array_equal(ordering.length_sorted_order(src, tgt, TieBreaks.of(tie)), expected)


@pytest.mark.parametrize("tie_bits", [32, 4])
def test_tie_breaks_drawn_in_chunks_sort_as_rng_random_and_leave_the_generator_as_it_does(monkeypatch, tie_bits):
    """An epoch draws its tie-breaks a chunk at a time and keeps their prefixes; the order equals the lexsort
    by `rng.random(count)`'s values, and the generator goes on (to the batch permutation) as after that call."""
    from transformer.data import ordering
    from transformer.data.ordering import TieBreaks

    monkeypatch.setattr(ordering, "CHUNK_PAIRS", 1000)
    monkeypatch.setattr(ordering, "TIE_BITS", tie_bits)
    lengths = np.random.default_rng(5)
    src, tgt = compact(lengths.integers(0, 9, 7777)), compact(lengths.integers(0, 9, 7777))
    ours, reference = np.random.default_rng([3, 1]), np.random.default_rng([3, 1])
    order = ordering.length_sorted_order(src, tgt, TieBreaks(ours, len(src)))
    tie = reference.random(len(src))
    assert np.array_equal(order, np.lexsort((tie, tgt, src, np.maximum(src, tgt))))
    assert np.array_equal(ours.permutation(500), reference.permutation(500))
    some = np.array([7000, 3, 3, 999, 1000, 0])
    assert np.array_equal(TieBreaks(np.random.default_rng([3, 1]), len(src)).exact(some), tie[some])


def test_a_corpus_keeps_a_few_bytes_a_pair_for_the_run(tmp_path):
    """The per-pair state a warm start keeps: positions uint32 and lengths uint16 (8 bytes a kept pair,
    int64 arrays held 24), shared by the sampler, which makes no copy of them."""
    corpus, _ = _corpus(tmp_path, ["ein Hund läuft"] * 50, ["a dog runs"] * 50, max_len=40, vocab=60)
    assert corpus.pair_index.dtype == np.uint32
    assert corpus.src_lens.dtype == corpus.tgt_lens.dtype == np.uint16
    sampler = TokenBatchSampler(corpus.src_lens, corpus.tgt_lens, max_tokens=300, seed=7)
    assert sampler.src_lens is corpus.src_lens and sampler.tgt_lens is corpus.tgt_lens
    assert compact(np.array([65534])).dtype == np.uint16 and compact(np.array([65535])).dtype == np.uint32
