"""The streaming per-pair columns of a preparation and the bucketed duplicate search, against numpy's own."""

import numpy as np
import pytest

from transformer.data import arrays
from transformer.data.arrays import ColumnWriter, repeated_keys


@pytest.mark.parametrize("chunks", [[], [[]], [[3, 0, 5]], [[1] * 7, [], [2, 9], list(range(100))]])
def test_a_column_written_a_chunk_at_a_time_is_the_array_np_save_writes(tmp_path, chunks):
    lengths = np.array([x for chunk in chunks for x in chunk], dtype=np.int64)
    offsets, flags = ColumnWriter(tmp_path / "o.npy", offsets=True), ColumnWriter(tmp_path / "f.npy", np.uint8)
    for chunk in chunks:
        offsets.append(np.array(chunk, dtype=np.int64))
        flags.append(np.array(chunk, dtype=np.int64) % 256)
    offsets.close()
    flags.close()
    expected = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    loaded = np.load(tmp_path / "o.npy")
    assert loaded.dtype == np.int64 and np.array_equal(loaded, expected) and offsets.total == expected[-1]
    assert np.array_equal(np.load(tmp_path / "f.npy"), (lengths % 256).astype(np.uint8))
    np.save(tmp_path / "reference.npy", expected)
    assert (tmp_path / "o.npy").read_bytes() == (tmp_path / "reference.npy").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.npy", "o.npy", "reference.npy"]  # no raw file left


@pytest.mark.parametrize("bucket", [1 << 22, 64, 1])
def test_repeated_keys_marks_all_but_the_first_of_each_key(monkeypatch, bucket):
    """Over 1, 2**k and many buckets (keys split by their top bits, negative ones included) and chunk edges."""
    monkeypatch.setattr(arrays, "BUCKET_KEYS", bucket)
    monkeypatch.setattr(arrays, "CHUNK_PAIRS", 97)
    rng = np.random.default_rng(3)
    keys = rng.integers(-(2**63), 2**63 - 1, size=3000, dtype=np.int64)
    keys[rng.integers(0, 3000, 900)] = keys[rng.integers(0, 3000, 900)]  # many repeats, some several times
    _, first = np.unique(keys, return_index=True)
    expected = np.ones(len(keys), dtype=bool)
    expected[first] = False
    assert 300 < expected.sum() < 900
    assert np.array_equal(repeated_keys(keys), expected)
    assert not repeated_keys(np.zeros(0, dtype=np.int64)).any()
