import json
import logging

import pytest

from transformer import toy
from transformer.config import DataConfig
from transformer.data import (
    DataError,
    TokenBatchSampler,
    batches_in_order,
    collate,
    encode_split,
    load_split_text,
    read_lines,
)
from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizer


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
    with pytest.raises(DataError, match=r"train\.de:3: invalid UTF-8 \(byte 0xe9 at column 3\)"):
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


def test_unknown_hub_dataset_fails_with_the_key(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match="data.hub_id=no-such/dataset"):
        load_split_text(DataConfig(hub_id="no-such/dataset"), "train")


def test_tsv_and_jsonl_sources(tmp_path):
    _write(tmp_path / "train.tsv", b"Hallo\tHello\nJa\tYes\n")
    assert load_split_text(DataConfig(path=str(tmp_path)), "train") == (["Hallo", "Ja"], ["Hello", "Yes"])
    _write(tmp_path / "test.tsv", b"only one field\n")
    with pytest.raises(DataError, match=r"test\.tsv:1: expected 2 tab-separated fields"):
        load_split_text(DataConfig(path=str(tmp_path)), "test")
    rows = [{"translation": {"de": "Haus", "en": "house"}}, {"translation": {"de": "Maus", "en": "mouse"}}]
    (tmp_path / "validation.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert load_split_text(DataConfig(path=str(tmp_path)), "validation") == (["Haus", "Maus"], ["house", "mouse"])


def test_empty_nul_and_overlong_pairs_are_dropped_and_counted(tmp_path, caplog):
    src = ["ein Hund", "", "eine Katze", "a\0b", "sehr " * 50, "das Haus"]
    tgt = ["a dog", "nothing", "", "x", "very " * 50, "the house"]
    tokenizer = build_tokenizer(src * 5, tgt * 5, vocab_size=60, cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        split = encode_split(src, tgt, tokenizer, cache_dir=tmp_path, max_len=20, name="unit")
    assert split.src_text == ["ein Hund", "das Haus"]
    assert "dropped 4 of 6 pairs (empty: 2, NUL byte: 1, too long: 1" in caplog.text


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
    assert toy.generate(50, 10, 10) == toy.generate(50, 10, 10)       # deterministic


def _sampler(n=600, max_tokens=120, seed=3):
    import random
    rng = random.Random(0)
    src_lens = [rng.randint(1, 30) for _ in range(n)]
    tgt_lens = [max(1, s + rng.randint(-3, 3)) for s in src_lens]
    return TokenBatchSampler(src_lens, tgt_lens, max_tokens, seed), src_lens, tgt_lens


def test_batches_respect_the_token_budget_and_cover_every_pair_once():
    sampler, src_lens, tgt_lens = _sampler()
    for epoch in range(3):
        batches = sampler.batches(epoch)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(src_lens)))                 # each pair exactly once
        for batch in batches:
            width = max(max(src_lens[i], tgt_lens[i]) + 1 for i in batch)
            assert len(batch) * width <= 120
    assert sampler.batches(1) == _sampler()[0].batches(1)                 # same seed, same epoch: same batches
    assert sampler.batches(1) != sampler.batches(2)                       # reshuffled per epoch
    assert _sampler(seed=4)[0].batches(1) != sampler.batches(1)


def test_length_bucketing_keeps_padding_low():
    sampler, src_lens, tgt_lens = _sampler(n=3000, max_tokens=1024)
    real = padded = 0
    for batch in sampler.batches(0):
        width_src = max(src_lens[i] for i in batch) + 1
        width_tgt = max(tgt_lens[i] for i in batch) + 1
        real += sum(src_lens[i] + 1 + tgt_lens[i] + 1 for i in batch)
        padded += len(batch) * (width_src + width_tgt)
    assert 1 - real / padded < 0.10


def test_max_tokens_smaller_than_a_sentence_is_refused():
    with pytest.raises(DataError, match="trainer.max_tokens=10 is smaller than the longest sentence"):
        TokenBatchSampler([5, 30], [5, 4], max_tokens=10, seed=1)


def test_collate_shapes_and_special_tokens(tmp_path):
    from transformer.data import EncodedSplit
    split = EncodedSplit(src=[[7, 8, 9], [10]], tgt=[[11, 12], [13, 14, 15]], src_text=["", ""], tgt_text=["", ""])
    batch = collate(split, [0, 1])
    assert batch.src.tolist() == [[7, 8, 9, EOS_ID], [10, EOS_ID, PAD_ID, PAD_ID]]
    assert batch.tgt_in.tolist() == [[BOS_ID, 11, 12, PAD_ID], [BOS_ID, 13, 14, 15]]
    assert batch.tgt_out.tolist() == [[11, 12, EOS_ID, PAD_ID], [13, 14, 15, EOS_ID]]
    assert batch.num_tgt_tokens == 7
    assert batches_in_order([5, 1, 3], max_tokens=100) == [[1, 2, 0]]


def test_multi30k_loads_from_local_files(multi30k_dir):
    cfg = DataConfig(name="multi30k_de_en", path=str(multi30k_dir), src_lang="de", tgt_lang="en",
                     valid_split="validation", test_split="test",
                     local_splits={"validation": "val", "test": "test_2016_flickr"})
    src, tgt = load_split_text(cfg, "train")
    assert len(src) == len(tgt) == 29000
    assert len(load_split_text(cfg, "test")[0]) == 1000
    assert len(load_split_text(cfg, "validation")[0]) == 1014
