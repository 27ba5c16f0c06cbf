"""Per-pair arrays in the types that hold them: a corpus of 45 million pairs keeps a few bytes a pair for
the run (lengths in uint16, positions in uint32), not numpy's int64 defaults."""

from __future__ import annotations

import numpy as np

CHUNK_PAIRS = 1 << 20  # pairs computed at a time where a whole-corpus int64 temporary would be hundreds of MB


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
