"""The tokenizer's sample of a large plain-text corpus: drawn by line number with a fixed seed, read by
finding newlines in the bytes, and the same in every process (SentencePiece's own reservoir is not)."""

import numpy as np
import pytest

from transformer.data import lines as lines_module
from transformer.data import toy
from transformer.data.lines import count_lines, lines_at, read_lines
from transformer.data.sources import DataError, ParallelFiles

TEXTS = {
    "plain": b"ein Hund\neine Katze\n\nzwei Hunde\n",
    "no final newline": b"ein Hund\neine Katze\nzwei Hunde",
    "crlf and a BOM": b"\xef\xbb\xbfein Hund\r\neine Katze\r\n\r\nletzte\r\n",
    "empty": b"",
    "one blank line": b"\n",
}


@pytest.mark.parametrize("block", [1, 5, 8 << 20])
@pytest.mark.parametrize("name", sorted(TEXTS))
def test_lines_are_counted_and_picked_as_the_file_is_read(tmp_path, monkeypatch, name, block):
    monkeypatch.setattr(lines_module, "_BLOCK_BYTES", block)  # lines across every block boundary
    path = tmp_path / "text"
    path.write_bytes(TEXTS[name])
    every = read_lines(path)
    assert count_lines(path) == len(every)
    for wanted in [list(range(len(every))), list(range(0, len(every), 2)), [len(every) - 1] if every else []]:
        assert lines_at(path, np.array(wanted, dtype=np.int64)) == [every[i] for i in wanted]


def test_a_picked_line_that_is_not_utf8_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "text"
    path.write_bytes(b"gut\nschlecht \xff\ngut\n")
    assert lines_at(path, np.array([0, 2])) == ["gut", "gut"]
    with pytest.raises(DataError, match=r"text:2: invalid UTF-8 \(byte 0xff at column 10"):
        lines_at(path, np.array([1]))


def test_a_sample_is_uniform_over_both_sides_and_the_same_every_time(tmp_path):
    src = [f"quelle {i}" for i in range(3000)]
    tgt = [f"target {i}" for i in range(2000)]
    (tmp_path / "train.de").write_text("\n".join(src) + "\n")
    (tmp_path / "train.en").write_text("\n".join(tgt) + "\n")
    source = ParallelFiles(tmp_path / "train.de", tmp_path / "train.en")
    sample = source.sample_lines(("src", "tgt"), 1000)
    assert len(sample) == len(set(sample)) == 1000 and set(sample) <= set(src) | set(tgt)
    assert 540 < sum(line.startswith("quelle") for line in sample) < 660  # 3/5 of the lines are sources
    assert sample == source.sample_lines(("src", "tgt"), 1000)
    assert set(source.sample_lines(("tgt",), 500)) <= set(tgt)
    assert source.sample_lines(("src", "tgt"), 5000) is None  # no more lines than the sample: every line


def test_the_tokenizer_of_a_large_corpus_trains_on_the_drawn_sample_alone(tmp_path, monkeypatch):
    """SentencePiece gets the drawn lines and no reservoir of its own (which differs from process to process:
    two processes sampling 2,000 of 40,000 Multi30k lines trained different models; on the same lines it
    trains the same model every time)."""
    from transformer.data import tokenizer as tokenizer_module

    src, tgt = toy.generate(3000, 0, 0)["train"]
    (tmp_path / "train.de").write_text("\n".join(src) + "\n")
    (tmp_path / "train.en").write_text("\n".join(tgt) + "\n")
    source = ParallelFiles(tmp_path / "train.de", tmp_path / "train.en")
    seen = []
    real = tokenizer_module.train_sentencepiece

    def recorded(lines, **kwargs):
        lines = list(lines)
        seen.append((lines, kwargs["sample"]))
        return real(lines, **kwargs)

    monkeypatch.setattr(tokenizer_module, "train_sentencepiece", recorded)
    tokenizer_module.build_tokenizer(source, vocab_size=200, sample=1000, cache_dir=tmp_path / "joint")
    tokenizer_module.build_tokenizer(source, vocab_size=200, sample=1000, joint=False, cache_dir=tmp_path / "apart")
    assert [sample for _, sample in seen] == [0, 0, 0]
    assert seen[0][0] == source.sample_lines(("src", "tgt"), 1000) and len(seen[0][0]) == 1000
    assert set(seen[1][0]) <= set(src) and set(seen[2][0]) <= set(tgt)
    tokenizer_module.build_tokenizer(source, vocab_size=200, sample=10000, cache_dir=tmp_path / "all")
    assert seen[3][1] == 10000 and len(seen[3][0]) == 6000  # a sample beyond the corpus: every line, streamed
