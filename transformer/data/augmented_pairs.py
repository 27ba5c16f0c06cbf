"""data.augment_*: training pairs noised on the fly (issue 73) by the modifiers of `augment`: upper and title
case (both sides), typos (the source), removed end punctuation (both sides), merged consecutive pairs.

Which modifiers a pair gets in an epoch is drawn per pair from a hash of (trainer.seed, corpus, epoch, pair),
vectorised over a whole epoch; what a chosen modifier does (which words are misspelt, how many pairs are
merged) from `augment.rng_for` of the same numbers. So a pair is noised the same way in any DataLoader
worker, on any rank and after a resume, and differently from one epoch to the next. Pairs no modifier
chose keep their stored ids; a chosen pair's ids are decoded to text, noised and encoded again (the cost
falls on the chosen share alone). A language tag stays an id in front of the source and is never decoded,
so it is never upper-cased or misspelt.

The batch sampler packs each epoch by that epoch's lengths (`lengths`), which collating the batch (`sides`)
reproduces exactly, as subword sampling does. A side longer than data.max_len after noising is cut there;
a merge never joins pairs whose stored lengths together exceed data.max_len (on either side), nor pairs
with different leading tags.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol

import numpy as np

from transformer.config import AUGMENT_SHARES
from transformer.data import augment
from transformer.data.tokenizer import Tokenizer
from transformer.special import EOS_ID

if TYPE_CHECKING:
    from transformer.data.batching import Batch

MERGE_LIMIT_WITHOUT_MAX_LEN = 256  # tokens a side of a merged pair may hold when data.max_len is null
EPOCH_KEPT_PAIRS = 1_000_000  # corpora up to this size keep the epoch's noised ids that `lengths` made


@dataclass(frozen=True)
class AugmentSettings:
    """The probabilities of data.augment_* (each the share of pairs a modifier changes per epoch)."""

    upper: float = 0.0
    title: float = 0.0
    typos: float = 0.0
    typo_rate: float = augment.EVALUATION_TYPO_RATE
    nopunct: float = 0.0
    merge: float = 0.0

    @classmethod
    def of(cls, cfg) -> AugmentSettings:
        """From a DataConfig's data.augment_* keys."""
        return cls(**{f.name: float(getattr(cfg, f"augment_{f.name}")) for f in fields(cls)})

    def __bool__(self) -> bool:
        return any(getattr(self, name) > 0 for name in AUGMENT_SHARES)

    def describe(self) -> str:
        chosen = [f"{name} {getattr(self, name):g}" for name in AUGMENT_SHARES]
        return ", ".join(c for c in chosen if not c.endswith(" 0")) + (
            f" (typo rate {self.typo_rate:g})" if self.typos else ""
        )

    def for_tokenizer(self) -> dict:
        """What of these changes the tokenizer's sample (part of its cache key): the case and typo modifiers;
        removed punctuation and merges add no new pieces."""
        return {"upper": self.upper, "title": self.title, "typos": self.typos, "typo_rate": self.typo_rate}


# Columns of `_uniforms`: one independent draw per decision.
_MERGE, _CASE, _TYPOS, _NOPUNCT = range(4)


def _uniforms(seed: int, stream: int, epoch: int, pairs: np.ndarray) -> np.ndarray:
    """(N, 4) float64 in [0, 1): splitmix64 of (seed, stream, epoch, pair, column), a pure function of them."""
    with np.errstate(over="ignore"):
        x = (
            pairs.astype(np.uint64)[:, None] * np.uint64(4)
            + np.arange(4, dtype=np.uint64)[None, :]
            + np.uint64(epoch) * np.uint64(0x9E3779B97F4A7C15)
            + np.uint64(seed) * np.uint64(0xD1B54A32D192ED03)
            + np.uint64(stream) * np.uint64(0x8CB92BA72F3D8DD7)
        )
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class StoredPairs(Protocol):
    """What augmentation reads of a prepared split (corpus.EncodedCorpus)."""

    pair_index: np.ndarray
    src_lens: np.ndarray
    tgt_lens: np.ndarray

    def stored(self, side: str) -> tuple[np.ndarray, np.ndarray]: ...

    def __len__(self) -> int: ...


@dataclass
class PairAugmentation:
    """The training stream's augmentation of one corpus (`stream`: its index in a mixture, 0 alone)."""

    settings: AugmentSettings
    tokenizer_state: dict
    seed: int
    max_len: int | None
    stream: int = 0

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_tokenizer", "_epoch_kept")}

    @property
    def tokenizer(self) -> Tokenizer:
        if getattr(self, "_tokenizer", None) is None:
            self._tokenizer = Tokenizer.from_state_dict(self.tokenizer_state)
        return self._tokenizer

    def chosen(self, corpus: StoredPairs, positions: np.ndarray, epoch: int) -> dict[str, np.ndarray]:
        """Which of `positions` (kept positions) each modifier changes in `epoch`: name -> (N,) bool. A merge
        is only chosen where the next kept pair exists, has the same leading tag and fits data.max_len."""
        s = self.settings
        u = _uniforms(self.seed, self.stream, epoch, corpus.pair_index[positions])
        picks = {
            "merge": (u[:, _MERGE] < s.merge) & self._can_merge(corpus, positions),
            "upper": u[:, _CASE] < s.upper,
            "title": (u[:, _CASE] >= s.upper) & (u[:, _CASE] < s.upper + s.title),
            "typos": u[:, _TYPOS] < s.typos,
            "nopunct": u[:, _NOPUNCT] < s.nopunct,
        }
        return picks

    def _limit(self) -> int:
        return self.max_len if self.max_len is not None else MERGE_LIMIT_WITHOUT_MAX_LEN

    def _can_merge(self, corpus: StoredPairs, positions: np.ndarray) -> np.ndarray:
        nxt = positions + 1
        ok = nxt < len(corpus)
        nxt = np.where(ok, nxt, positions)
        for lens in (corpus.src_lens, corpus.tgt_lens):
            ok &= lens[positions].astype(np.int64) + lens[nxt].astype(np.int64) <= self._limit()
        return ok

    def _merge_span(self, corpus: StoredPairs, position: int, rng: np.random.Generator) -> int:
        """How many consecutive kept pairs the merge at `position` joins: 2 or 3 (drawn), fewer where more
        would pass the end of the corpus or data.max_len."""
        wanted = int(augment.MERGE_SIZES[rng.integers(len(augment.MERGE_SIZES))])
        span = 1
        src_total, tgt_total = 0, 0
        for p in range(position, min(position + wanted, len(corpus))):
            src_total += int(corpus.src_lens[p])
            tgt_total += int(corpus.tgt_lens[p])
            if max(src_total, tgt_total) > self._limit():
                break
            span = p - position + 1
        return span

    def lengths(self, corpus: StoredPairs, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Source and target lengths of every kept pair in `epoch` (the stored ones where nothing changes).
        A corpus of up to EPOCH_KEPT_PAIRS pairs keeps the noised ids for `sides` in this epoch, so that
        each pair is noised once per epoch rather than twice (a DataLoader worker started before this ran
        noises them again, to the same ids)."""
        src = corpus.src_lens.astype(np.int64)
        tgt = corpus.tgt_lens.astype(np.int64)
        keep = len(corpus) <= EPOCH_KEPT_PAIRS
        kept_rows = np.full(len(corpus), -1, dtype=np.int64)
        kept_src, kept_tgt = [], []
        for start in range(0, len(corpus), 100_000):
            positions = np.arange(start, min(start + 100_000, len(corpus)), dtype=np.int64)
            changed, (src_ids, tgt_ids) = self._noised(corpus, positions, epoch)
            src[positions[changed]] = [len(ids) for ids in src_ids]
            tgt[positions[changed]] = [len(ids) for ids in tgt_ids]
            if keep:
                kept_rows[positions[changed]] = np.arange(len(kept_src), len(kept_src) + len(src_ids))
                kept_src += src_ids
                kept_tgt += tgt_ids
        self._epoch_kept = (epoch, kept_rows, kept_src, kept_tgt) if keep else None
        return src, tgt

    def sides(self, corpus: StoredPairs, positions: np.ndarray, epoch: int) -> tuple[list, list]:
        """(source ids, target ids) of kept positions `positions` in `epoch`."""
        positions = np.asarray(positions, dtype=np.int64)
        src, tgt = [_stored_ids(corpus, side, positions) for side in ("src", "tgt")]
        for row, s, t in self._changed(corpus, positions, epoch):
            src[row], tgt[row] = s, t
        return src, tgt

    def _changed(self, corpus: StoredPairs, positions: np.ndarray, epoch: int) -> list[tuple[int, list, list]]:
        """(row of `positions`, noised source ids, noised target ids) of the pairs a modifier changes in
        `epoch`: what `lengths` kept of this epoch, else noised now."""
        kept = getattr(self, "_epoch_kept", None)
        if kept is not None and kept[0] == epoch:
            _, kept_rows, kept_src, kept_tgt = kept
            at = kept_rows[positions]  # (N,) index into the kept ids, -1 where nothing changed
            rows = np.flatnonzero(at >= 0).tolist()
            return [(row, kept_src[k], kept_tgt[k]) for row, k in zip(rows, at[rows].tolist())]
        changed, (src_ids, tgt_ids) = self._noised(corpus, positions, epoch)
        return list(zip(np.flatnonzero(changed).tolist(), src_ids, tgt_ids))

    def batch(self, corpus: StoredPairs, positions: np.ndarray, epoch: int) -> Batch:
        from transformer.data.batching import flat_ids, make_batch

        src, tgt = self.sides(corpus, positions, epoch)
        return make_batch(*flat_ids(src), *flat_ids(tgt))

    def _noised(self, corpus: StoredPairs, positions: np.ndarray, epoch: int) -> tuple[np.ndarray, tuple[list, list]]:
        """(N,) bool: which of `positions` a modifier changes; and those pairs' noised (source, target) ids."""
        picks = self.chosen(corpus, positions, epoch)
        changed = np.logical_or.reduce(list(picks.values()))
        rows = np.flatnonzero(changed)
        if rows.size == 0:
            return changed, ([], [])
        tok, protected = self.tokenizer, self.tokenizer.protected_ids
        spans = []  # per changed pair: (its leading tag, the stored source and target ids it joins, its rng)
        for row in rows.tolist():
            position = int(positions[row])
            rng = augment.rng_for(self.seed, epoch, int(corpus.pair_index[position]), stream=self.stream)
            span = self._merge_span(corpus, position, rng) if picks["merge"][row] else 1
            joined = [_stored_ids(corpus, side, np.arange(position, position + span)) for side in ("src", "tgt")]
            tag = _leading(joined[0][0], protected)
            if any(_leading(ids, protected) != tag for ids in joined[0][1:]):
                joined = [side[:1] for side in joined]  # pairs into different languages are never merged
            spans.append((tag, joined, rng))
        # one SentencePiece call per side for the whole batch: a call costs more than decoding a sentence
        src_texts = iter(tok.decode_src([ids[len(tag) :] for tag, (src, _), _ in spans for ids in src]))
        tgt_texts = iter(tok.decode_tgt([ids for _, (_, tgt), _ in spans for ids in tgt]))
        tags, texts = [], []
        for (tag, (src, _), rng), row in zip(spans, rows.tolist()):
            texts_of_span = [(next(src_texts), next(tgt_texts)) for _ in src]
            pair = augment.merge(texts_of_span, limit=_any_length) if len(texts_of_span) > 1 else texts_of_span[0]
            tags.append(tag)
            texts.append(self._modified(pair, {name: bool(pick[row]) for name, pick in picks.items()}, rng))
        src_ids = tok.encode_src([src for src, _ in texts])
        tgt_ids = tok.encode_tgt([tgt for _, tgt in texts])
        src_ids = [self._cut(tag + ids) for tag, ids in zip(tags, src_ids)]
        tgt_ids = [self._cut(ids) for ids in tgt_ids]
        return changed, (src_ids, tgt_ids)

    def _modified(self, pair: augment.Pair, picked: dict[str, bool], rng: np.random.Generator) -> augment.Pair:
        src, tgt = pair
        if picked["upper"]:
            src, tgt = augment.upper(src), augment.upper(tgt)
        elif picked["title"]:
            src, tgt = augment.title(src), augment.title(tgt)
        if picked["typos"]:
            src = augment.typos(src, rng, rate=self.settings.typo_rate)
        if picked["nopunct"]:
            src, tgt = _NOPUNCT_PAIR((src, tgt), rng)
        return src, tgt

    def _cut(self, ids: list[int]) -> list[int]:
        return ids[: self.max_len] if self.max_len is not None else ids


_NOPUNCT_PAIR = augment.VARIANTS["nopunct"]  # the reference loses its marks where the source did


def _any_length(pair: augment.Pair) -> bool:
    return True  # the merge's length was checked on the stored ids (`_merge_span`)


def _leading(ids: Sequence[int], protected: int) -> list[int]:
    """The leading language-tag ids of a source (ids between the special ones and `protected`)."""
    n = 0
    while n < len(ids) and EOS_ID < ids[n] < protected:
        n += 1
    return list(ids[:n])


def _stored_ids(corpus: StoredPairs, side: str, positions: np.ndarray) -> list[list[int]]:
    flat, offsets = corpus.stored(side)
    pairs = corpus.pair_index[positions]
    return [flat[offsets[p] : offsets[p + 1]].tolist() for p in pairs.tolist()]
