"""Per-pair arrays in the types that hold them: a corpus of 45 million pairs keeps a few bytes a pair for
the run (lengths in uint16, positions in uint32), not numpy's int64 defaults."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

CHUNK_PAIRS = 1 << 20  # pairs computed at a time where a whole-corpus int64 temporary would be hundreds of MB
BUCKET_KEYS = 1 << 22  # keys sorted at a time by `repeated_keys` (about 100 MB with its temporaries)


def compact(values: np.ndarray) -> np.ndarray:
    """Non-negative integers (lengths) in the smallest unsigned type that holds their maximum + 1 (a
    special token added), uint16 for every sentence of data.max_len <= 65,534: 2 bytes a pair instead of
    8. `values` itself when it already has that type."""
    values = np.asarray(values)
    top = int(values.max(initial=0)) + 1
    dtype = next(t for t in (np.uint16, np.uint32, np.uint64) if top <= np.iinfo(t).max)
    return values if values.dtype == dtype else values.astype(dtype)


def index_dtype(count: int):
    """The type of positions into `count` items: uint32 below 2**32 (4 bytes a pair), else int64."""
    return np.uint32 if count < 2**32 else np.int64


class ColumnWriter:
    """A 1-D .npy file of values appended a chunk at a time (its length known only at the end), holding
    one chunk in memory: the values go to a raw file beside it, and `close` writes the .npy header and
    copies them behind it. With `offsets`, the values appended are lengths and the file holds their
    offsets, int64, one more than the lengths: 0, l0, l0 + l1, ..."""

    def __init__(self, path: Path, dtype=np.int64, offsets: bool = False):
        self.path, self.dtype, self.offsets = Path(path), np.dtype(dtype), offsets
        self._raw_path = self.path.with_name(self.path.name + ".raw")
        self._raw = open(self._raw_path, "wb")
        self.count = 0  # values written (offsets: lengths appended)
        self.total = 0  # offsets: the sum of the lengths so far
        if offsets:
            self._raw.write(np.zeros(1, dtype=self.dtype).tobytes())

    def append(self, values: np.ndarray) -> None:
        values = np.asarray(values)
        if self.offsets:
            ends = self.total + np.cumsum(values, dtype=np.int64)
            self.total = int(ends[-1]) if len(ends) else self.total
            values = ends
        self._raw.write(values.astype(self.dtype, copy=False).tobytes())
        self.count += len(values)

    def close(self) -> None:
        self._raw.close()
        length = self.count + int(self.offsets)
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (length,)}
        with open(self.path, "wb") as out, open(self._raw_path, "rb") as raw:
            np.lib.format.write_array_header_1_0(out, header)
            shutil.copyfileobj(raw, out, 1 << 24)
        self._raw_path.unlink()


def repeated_keys(keys: np.ndarray) -> np.ndarray:
    """(P,) bool: True where `keys[i]` (int64 or uint64, e.g. a memory-mapped file of them) equals an
    earlier key. Equal to marking all but np.unique(keys, return_index=True)'s indices, but the keys are
    split by their top bits into buckets of about BUCKET_KEYS, each found in one pass over them and sorted alone:
    it holds a bucket's keys and positions, never a sort of all of them."""
    count = len(keys)
    bits = max(0, int(np.ceil(np.log2(max(count, 1) / BUCKET_KEYS))))  # 2**bits buckets
    repeated = np.zeros(count, dtype=bool)
    for bucket in range(1 << bits):
        positions, members = [], []
        for start in range(0, count, CHUNK_PAIRS):
            chunk = np.asarray(keys[start : start + CHUNK_PAIRS]).view(np.uint64)
            inside = np.flatnonzero(chunk >> np.uint64(64 - bits) == bucket) if bits else np.arange(len(chunk))
            positions.append(start + inside)
            members.append(chunk[inside])
        if not positions:
            continue
        positions, members = np.concatenate(positions), np.concatenate(members)
        _, first = np.unique(members, return_index=True)
        again = np.ones(len(members), dtype=bool)
        again[first] = False
        repeated[positions[again]] = True
    return repeated
