"""An epoch's order of the training pairs: sorted by (padded width, source length, target length, a random
tie-break), the order the token-budget packing cuts into batches (batching.py). Built for corpora of tens of
millions of pairs: the tie-breaks are kept as 4-byte prefixes and the sort is counting-based, a chunk at a
time, so an epoch's order costs about 8 bytes a pair (the prefixes and the order itself)."""

from __future__ import annotations

import numpy as np

from transformer.data.arrays import CHUNK_PAIRS, index_dtype

# The sort goes through a table of every (source, target) length pair's rank while it holds at most this
# many entries (data.max_len 2,047 and below; uint32, 16 MiB); longer corpora sort with np.lexsort.
GROUP_TABLE_ENTRIES = 2**22

TIE_BITS = 32  # the bits of each tie-break kept for the sort (uint32); the rest is drawn again where needed


class TieBreaks:
    """Each pair's random tie-break in [0, 1), the values `rng.random(count)` would return, kept as their
    top TIE_BITS bits (floor(value * 2**TIE_BITS), uint32: 4 bytes a pair, not float64's 8). Where two pairs
    of a group share those bits, their exact values are drawn again from a copy of the generator's state
    (`exact`). The generator is left where `rng.random(count)` leaves it."""

    def __init__(self, rng: np.random.Generator | None, count: int, values: np.ndarray | None = None):
        self.count, self._values = count, values
        self._state = None if rng is None else rng.bit_generator.state  # a fresh dict: a copy
        self._bit_generator = None if rng is None else type(rng.bit_generator)
        self.coarse = np.empty(count, dtype=np.uint32)  # (count,)
        for start, chunk in self._chunks(rng):
            self.coarse[start : start + len(chunk)] = np.floor(chunk * 2.0**TIE_BITS).astype(np.uint32)

    @classmethod
    def of(cls, values: np.ndarray) -> TieBreaks:
        """The tie-breaks `values` ((count,) floats in [0, 1)), given rather than drawn."""
        return cls(None, len(values), np.asarray(values, dtype=np.float64))

    def _chunks(self, rng):
        for start in range(0, self.count, CHUNK_PAIRS):
            size = min(CHUNK_PAIRS, self.count - start)
            yield start, (rng.random(size) if self._values is None else self._values[start : start + size])

    def exact(self, positions: np.ndarray) -> np.ndarray:
        """(P,) float64: the tie-breaks of `positions`, drawn again a chunk at a time when not given."""
        if self._values is not None:
            return self._values[positions]
        rng = np.random.Generator(self._bit_generator())
        rng.bit_generator.state = self._state
        by_position = np.argsort(positions, kind="stable")
        wanted = positions[by_position]  # (P,) ascending
        found = np.empty(len(positions), dtype=np.float64)
        for start, chunk in self._chunks(rng):
            low, high = np.searchsorted(wanted, [start, start + len(chunk)])
            found[by_position[low:high]] = chunk[wanted[low:high] - start]
        return found


def length_sorted_order(src: np.ndarray, tgt: np.ndarray, ties: TieBreaks) -> np.ndarray:
    """The positions of the pairs sorted by (padded width = max(source, target) length, source length,
    target length, tie-break), equal to `np.lexsort((tie_break, tgt, src, np.maximum(src, tgt)))` for the
    tie-breaks' exact values (positions with equal keys in their order), without its int64 arrays of every
    pair: a stable counting sort of the (source, target) length groups, then the groups sorted by their
    tie-breaks' prefixes, both a chunk at a time, then the few runs of equal prefixes by the exact values.
    Beyond the output (uint32) and the prefixes it holds what one chunk needs."""
    count = len(src)
    top = int(max(src.max(initial=0), tgt.max(initial=0))) + 1  # lengths 0..top-1
    cells = top * top
    if cells > GROUP_TABLE_ENTRIES:
        exact = ties.exact(np.arange(count))
        return np.lexsort((exact, tgt, src, np.maximum(src, tgt))).astype(index_dtype(count))
    grid_src, grid_tgt = np.divmod(np.arange(cells), top)  # every (source, target) length pair
    rank = np.empty(cells, dtype=np.uint16 if cells <= 2**16 else np.uint32)  # uint16: numpy's radix sort
    rank[np.lexsort((grid_tgt, grid_src, np.maximum(grid_src, grid_tgt)))] = np.arange(cells)

    def groups(start: int) -> np.ndarray:  # (C,) the group of each pair of a chunk
        return rank[src[start : start + CHUNK_PAIRS].astype(np.int64) * top + tgt[start : start + CHUNK_PAIRS]]

    sizes = np.zeros(cells, dtype=np.int64)
    for start in range(0, count, CHUNK_PAIRS):
        sizes += np.bincount(groups(start), minlength=cells)
    bounds = np.concatenate([[0], np.cumsum(sizes)])  # group g: order[bounds[g] : bounds[g + 1]]
    cursor = bounds[:-1].copy()  # the next free place of each group
    order = np.empty(count, dtype=index_dtype(count))
    for start in range(0, count, CHUNK_PAIRS):  # each chunk's pairs behind the earlier chunks' of their group
        group = groups(start)
        by_group = np.argsort(group, kind="stable")  # (C,)
        sorted_groups = group[by_group]
        firsts = np.flatnonzero(np.r_[True, sorted_groups[1:] != sorted_groups[:-1]])  # each group's run
        runs = np.diff(np.append(firsts, len(group)))
        within = np.arange(len(group)) - np.repeat(firsts, runs)  # place within its group's run
        order[cursor[sorted_groups] + within] = start + by_group
        cursor[sorted_groups[firsts]] += runs
    # Then each group by its tie-breaks' prefixes (stable: equal ones stay in index order), whole groups a
    # chunk at a time: a chunk's lexsort by (group, prefix) sorts each of its groups.
    filled = np.flatnonzero(sizes)
    ends = bounds[filled + 1]
    tied_slots, tied_runs, runs_so_far = [], [], 0  # the places in `order` of runs of equal prefixes
    first = 0
    while first < len(filled):
        begin = bounds[filled[first]]
        last = max(first, int(np.searchsorted(ends, begin + CHUNK_PAIRS, side="right")) - 1)  # whole groups
        members = order[begin : ends[last]]
        local = np.repeat(np.arange(last - first + 1), sizes[filled[first : last + 1]])  # (M,) sorted
        members[:] = members[np.lexsort((ties.coarse[members], local))]
        prefix = ties.coarse[members]
        same = (local[1:] == local[:-1]) & (prefix[1:] == prefix[:-1])  # (M - 1,) as the one before
        if same.any():
            tied = np.zeros(len(members), dtype=bool)
            tied[1:] |= same
            tied[:-1] |= same
            starts_run = tied & ~np.r_[False, same]  # (M,) the first of each run
            places = np.flatnonzero(tied)
            tied_slots.append(begin + places)
            tied_runs.append(runs_so_far + np.cumsum(starts_run)[places])
            runs_so_far += int(starts_run.sum())
        first = last + 1
    if tied_slots:  # each run of equal prefixes by the exact values, equal ones in index order
        slots, runs = np.concatenate(tied_slots), np.concatenate(tied_runs)  # ascending, runs contiguous
        positions = order[slots].astype(np.int64)
        order[slots] = positions[np.lexsort((positions, ties.exact(positions), runs))]
    return order
