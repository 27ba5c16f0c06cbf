"""data.subword_sampling: training pairs segmented afresh each epoch from their text, with SentencePiece's
sampling (`SubwordSampling`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from transformer.data.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch comes with it: imported where batches are made, not to prepare
    from transformer.data.batching import Batch


class StoredText(Protocol):
    """What sampling reads of a prepared split (corpus.EncodedCorpus): its kept pairs and their text."""

    pair_index: np.ndarray

    def text(self, side: str, pairs: np.ndarray) -> list[str]: ...


@dataclass
class SubwordSampling:
    """data.subword_sampling: training pairs re-segmented from their text with SentencePiece's sampling
    (BPE-dropout for a BPE model, n-best sampling for a unigram one), each pair seeded by (trainer.seed,
    epoch, pair): a pair has the same pieces in any DataLoader worker and after a resume, other pieces
    in the next epoch. The sampler packs each epoch by that epoch's sampled lengths (`lengths`), which
    collating the batch (`batch`) reproduces exactly. Sides are cut to data.max_len tokens."""

    tokenizer_state: dict
    alpha: float
    nbest: int
    seed: int
    max_len: int | None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_tokenizer"}

    def _seeds(self, pairs: np.ndarray, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Two 32-bit seeds per pair (source, target): splitmix64 of (seed, epoch, pair)."""
        x = (
            pairs.astype(np.uint64)
            + np.uint64(epoch) * np.uint64(0x9E3779B97F4A7C15)
            + np.uint64(self.seed) * np.uint64(0xD1B54A32D192ED03)
        )
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
        return (x >> np.uint64(32)).astype(np.uint32), (x & np.uint64(0xFFFFFFFF)).astype(np.uint32)

    def segment(self, corpus: StoredText, pairs: np.ndarray, epoch: int) -> tuple[list, list]:
        """(source ids, target ids) of stored pairs `pairs` in `epoch`'s sampled segmentation."""
        import sentencepiece as spm

        if getattr(self, "_tokenizer", None) is None:
            self._tokenizer = Tokenizer.from_state_dict(self.tokenizer_state)
        sides = []
        for seeds, side, processor in zip(
            self._seeds(pairs, epoch), ("src", "tgt"), (self._tokenizer.src, self._tokenizer.tgt)
        ):
            ids = []
            # The generator is process-wide: seeded right before each sentence, so that its pieces
            # depend on (seed, epoch, pair) alone.
            for line, seed in zip(corpus.text(side, pairs), seeds.tolist()):
                spm.set_random_generator_seed(seed)
                text = self._tokenizer.as_model_text(line, side)  # inline casing, when the model has it
                ids.append(processor.encode(text, enable_sampling=True, alpha=self.alpha, nbest_size=self.nbest))
            sides.append([seq[: self.max_len] for seq in ids] if self.max_len is not None else ids)
        return sides[0], sides[1]

    def lengths(self, corpus: StoredText, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Source and target lengths of every kept pair in `epoch`'s sampled segmentation."""
        src, tgt = [], []
        for start in range(0, len(corpus.pair_index), 100_000):
            s, t = self.segment(corpus, corpus.pair_index[start : start + 100_000], epoch)
            src.append(np.fromiter(map(len, s), dtype=np.int64, count=len(s)))
            tgt.append(np.fromiter(map(len, t), dtype=np.int64, count=len(t)))
        empty = np.zeros(0, dtype=np.int64)
        return (np.concatenate(src) if src else empty), (np.concatenate(tgt) if tgt else empty)

    def batch(self, corpus: StoredText, pairs: np.ndarray, epoch: int) -> Batch:
        from transformer.data.batching import flat_ids, make_batch

        src, tgt = self.segment(corpus, pairs, epoch)
        return make_batch(*flat_ids(src), *flat_ids(tgt))
