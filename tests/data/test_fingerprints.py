"""A warm start does not read the corpus to know it is unchanged: the content hash of a local file is
remembered under data.cache_dir/fingerprints/ by the file's identity, which any rewrite changes."""

import os
import time

import pytest

from transformer.config import DataConfig
from transformer.data import lines
from transformer.data.sources import open_split


def _corpus(tmp_path):
    (tmp_path / "train.de").write_text("ein Hund\neine Katze\n")
    (tmp_path / "train.en").write_text("a dog\na cat\n")
    return DataConfig(path=str(tmp_path), src_lang="de", tgt_lang="en", cache_dir=str(tmp_path / "cache"))


def test_an_unchanged_corpus_is_not_read_again_to_be_fingerprinted(tmp_path, monkeypatch):
    cfg = _corpus(tmp_path)
    first = open_split(cfg, "train").fingerprint()
    assert len(list((tmp_path / "cache" / "fingerprints").iterdir())) == 1
    assert first == lines.hash_files(tmp_path / "train.de", tmp_path / "train.en")  # the same value as before

    def no_reading(path):
        raise AssertionError(f"{path} read again")

    monkeypatch.setattr(lines, "open_for_reading", no_reading)
    assert open_split(cfg, "train").fingerprint() == first


@pytest.mark.parametrize("rewrite", ["same size, old times", "appended"])
def test_a_rewritten_file_is_hashed_again_even_with_its_old_size_and_times(tmp_path, rewrite):
    cfg = _corpus(tmp_path)
    first = open_split(cfg, "train").fingerprint()
    target = tmp_path / "train.en"
    before = target.stat()
    time.sleep(0.05)  # past the file system's clock granularity
    with open(target, "r+" if rewrite.startswith("same") else "a") as handle:
        handle.write("A dog\n" if rewrite.startswith("same") else "two dogs\n")
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))  # as cp -p, rsync -a or touch -r leave it
    if rewrite.startswith("same"):
        assert target.stat().st_size == before.st_size and target.stat().st_mtime_ns == before.st_mtime_ns
    again = open_split(cfg, "train").fingerprint()
    assert again != first and again == lines.hash_files(tmp_path / "train.de", target)


def test_an_unwritable_cache_still_fingerprints(tmp_path):
    cfg = _corpus(tmp_path)
    (tmp_path / "cache").write_text("a file where the cache directory would be")
    assert open_split(cfg, "train").fingerprint() == lines.hash_files(tmp_path / "train.de", tmp_path / "train.en")
