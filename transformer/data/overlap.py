"""Held-out pairs that are also training pairs: a validation split copied from (or into) the training
split scores memorisation, not translation, so its size is said when training starts.

Pairs are compared by their token ids as prepared: each pair gets a 64-bit key (`pair_keys`, numpy over
the memory-mapped ids, a few passes per token) and the held-out keys are looked up among the training
ones. Two different pairs share a key with a chance of about one in 2**64 per comparison. The count is
computed once per training data and held-out split and kept in data.cache_dir/overlap/: at 4.5M training
pairs the keys take seconds.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np

log = logging.getLogger("transformer.data.corpus")  # said as the preparation's own lines

CHUNK_PAIRS = 1 << 18  # pairs hashed at a time: about 50 MB of temporaries at 25 tokens a side
POSITIONS = 4096  # position weights, cycled beyond (a pair of more tokens is hashed all the same)
_WEIGHTS = np.random.default_rng(20261202).integers(1, 2**63, size=POSITIONS, dtype=np.uint64) | np.uint64(1)
_SIDE_MIX = np.uint64(0x9E3779B97F4A7C15)


def _side_keys(ids: np.ndarray, offsets: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """(len(pairs),) uint64: a key of each pair's ids on one side, sum of (id + 1) x weight(position)
    modulo 2**64 (equal ids at equal positions, equal keys); 0 for an empty side."""
    keys = np.zeros(len(pairs), dtype=np.uint64)
    begins, lengths = offsets[pairs], offsets[pairs + 1] - offsets[pairs]  # (P,) each
    filled = lengths > 0
    if not filled.any():
        return keys
    begins, lengths = begins[filled], lengths[filled]
    firsts = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # (F,): where each pair starts in `tokens`
    position = np.arange(int(lengths.sum())) - np.repeat(firsts, lengths)  # (T,)
    tokens = ids[np.repeat(begins, lengths) + position].astype(np.uint64) + np.uint64(1)  # (T,)
    with np.errstate(over="ignore"):  # arithmetic modulo 2**64
        weighted = tokens * _WEIGHTS[position % POSITIONS]
    keys[filled] = np.add.reduceat(weighted, firsts)
    return keys


def pair_keys(corpus, pairs: np.ndarray | None = None) -> np.ndarray:
    """(P,) uint64: a key of each of the stored pairs `pairs` (default: every kept pair) of an
    `EncodedCorpus`, from its source and target ids; at most CHUNK_PAIRS at a time is the caller's to keep
    (`training_overlap` goes through a corpus chunk by chunk)."""
    pairs = corpus.pair_index if pairs is None else pairs
    source, target = (_side_keys(*corpus.stored(side), pairs) for side in ("src", "tgt"))
    with np.errstate(over="ignore"):
        return source * _SIDE_MIX + target


def _cache_file(held_out, training_identity: str) -> Path:
    """data.cache_dir/overlap/HELD-OUT.TRAINING.json (the prepared splits' own directories stay as written)."""
    return held_out.directory.parent.parent / "overlap" / f"{held_out.identity}.{training_identity}.json"


def training_overlap(parts: list, training_identity: str, held_out) -> int:
    """How many kept pairs of `held_out` (an EncodedCorpus) are kept pairs of the training corpora
    `parts` too; read from beside `held_out` when counted before for this training data."""
    cache = _cache_file(held_out, training_identity)
    try:
        return int(json.loads(cache.read_text())["pairs"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    held_keys = pair_keys(held_out)  # a validation split: small
    found = np.zeros(len(held_keys), dtype=bool)
    for part in parts:  # chunk by chunk: the keys of 45M training pairs would take 360 MB at once
        for start in range(0, len(part.pair_index), CHUNK_PAIRS):
            found |= np.isin(held_keys, pair_keys(part, part.pair_index[start : start + CHUNK_PAIRS]))
    count = int(found.sum())
    tmp = cache.with_name(f".{cache.name}.tmp{os.getpid()}")
    try:  # a cache: a directory that cannot take it counts again next time
        cache.parent.mkdir(exist_ok=True)
        tmp.write_text(json.dumps({"pairs": count}) + "\n")
        os.replace(tmp, cache)
    except OSError:
        tmp.unlink(missing_ok=True)
    return count


def warn_of_overlap(parts: list, training_identity: str, held_out, what: str) -> int:
    """One warning when pairs of the held-out split `held_out` are training pairs too; returns the count."""
    count = training_overlap(parts, training_identity, held_out)
    if count:
        share = f"all {count}" if count == len(held_out) else f"{count} of {len(held_out)}"
        log.warning(
            "%s: %s %s pairs are also training pairs: validation loss and BLEU then measure memorisation, "
            "not translation; hold them out of the training data",
            held_out.name,
            share,
            what,
        )
    return count
