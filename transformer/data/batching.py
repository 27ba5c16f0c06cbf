"""Batches: padding, token-budget length-bucketed packing, and the DataLoader that feeds training.

Everything here is vectorised with numpy: a batch is padded with one gather from the flat id array of
a prepared corpus, and an epoch of millions of pairs is sorted and packed with a loop over distinct
widths, not over sentences.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

import numpy as np
import torch

from transformer.data.arrays import CHUNK_PAIRS, compact
from transformer.data.ordering import TieBreaks, length_sorted_order
from transformer.errors import DataError
from transformer.special import BOS_ID, EOS_ID, PAD_ID


@dataclass
class Batch:
    src: torch.Tensor  # (B, S) int64, EOS-terminated, PAD-padded
    tgt_in: torch.Tensor  # (B, T) BOS + target
    tgt_out: torch.Tensor  # (B, T) target + EOS
    num_tgt_tokens: int
    padding_share: float = 0.0  # padded positions / all positions of src and tgt_out
    # (N,) int64: where the N real target tokens sit in tgt_out.flatten(), N = num_tgt_tokens. Built in
    # collate, so that the loss gathers them with an index; a boolean mask would make the GPU report
    # N to the host (a sync) in every step. None: derived from the padding (`target_positions`).
    tgt_positions: torch.Tensor | None = None

    def _tensors(self) -> tuple:
        return self.src, self.tgt_in, self.tgt_out, self.target_positions()

    def target_positions(self) -> torch.Tensor:
        if self.tgt_positions is None:
            self.tgt_positions = (self.tgt_out.flatten() != PAD_ID).nonzero().squeeze(1)
        return self.tgt_positions

    def to(self, device, non_blocking: bool = False) -> Batch:
        src, tgt_in, tgt_out, positions = (t.to(device, non_blocking=non_blocking) for t in self._tensors())
        return Batch(src, tgt_in, tgt_out, self.num_tgt_tokens, self.padding_share, positions)

    def twice(self) -> Batch:
        """The batch followed by itself (2B rows): R-Drop's two dropout passes in one forward. The loss
        sees the first copy's N target tokens, then the second's, in the same order."""
        src, tgt_in, tgt_out, positions = self._tensors()
        second = positions + tgt_out.numel()  # (N,) the copy's positions
        return Batch(
            torch.cat([src, src]),
            torch.cat([tgt_in, tgt_in]),
            torch.cat([tgt_out, tgt_out]),
            2 * self.num_tgt_tokens,
            self.padding_share,
            torch.cat([positions, second]),
        )

    def pin_memory(self) -> Batch:
        """Page-locked copies, so that `.to(cuda, non_blocking=True)` really overlaps (DataLoader calls this)."""
        src, tgt_in, tgt_out, positions = (t.pin_memory() for t in self._tensors())
        return Batch(src, tgt_in, tgt_out, self.num_tgt_tokens, self.padding_share, positions)


def pad_flat(
    flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray, *, bos: bool = False, eos: bool = False
) -> np.ndarray:
    """(B, W) int64 rows `[BOS] ids [EOS] PAD...` of the B sequences `flat[starts[b] : starts[b] + lengths[b]]`,
    W = longest + specials, gathered in one indexing operation."""
    shift = int(bos)
    width = int(lengths.max(initial=0)) + shift + int(eos)
    position = np.arange(width)[None, :] - shift  # (1, W) index in the sequence
    inside = (position >= 0) & (position < lengths[:, None])  # (B, W)
    gather = np.where(inside, starts[:, None] + position, 0)  # (B, W)
    out = np.where(inside, flat[gather] if len(flat) else 0, PAD_ID).astype(np.int64)
    rows = np.arange(len(starts))
    if bos:
        out[:, 0] = BOS_ID
    if eos:
        out[rows, lengths + shift] = EOS_ID
    return out


def pad_sequences(seqs, prefix: list[int] = (), suffix: list[int] = ()) -> torch.Tensor:
    """Lists of ids as a (B, W) PAD-padded int64 tensor with optional [BOS] prefix / [EOS] suffix."""
    assert list(prefix) in ([], [BOS_ID]) and list(suffix) in ([], [EOS_ID])
    flat, starts, lengths = flat_ids(seqs)
    return torch.from_numpy(pad_flat(flat, starts, lengths, bos=bool(prefix), eos=bool(suffix)))


def flat_ids(seqs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lists of ids as (all ids in one int64 array, where each list starts in it, each list's length)."""
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    flat = np.fromiter((i for s in seqs for i in s), dtype=np.int64, count=int(lengths.sum()))
    return flat, np.cumsum(lengths) - lengths, lengths


def make_batch(src_flat, src_starts, src_lens, tgt_flat, tgt_starts, tgt_lens) -> Batch:
    """A training batch from flat id arrays: src + EOS, BOS + tgt, tgt + EOS (lengths exclude specials)."""
    src = pad_flat(src_flat, src_starts, src_lens, eos=True)
    tgt = pad_flat(tgt_flat, tgt_starts, tgt_lens, bos=True, eos=True)  # (B, T + 1): BOS t... EOS
    tgt_in = tgt[:, :-1].copy()
    tgt_in[tgt_in == EOS_ID] = PAD_ID
    tgt_out = np.ascontiguousarray(tgt[:, 1:])
    real = int(src_lens.sum() + tgt_lens.sum()) + 2 * len(src_lens)
    padding = 1.0 - real / max(1, src.size + tgt_out.size)
    positions = np.flatnonzero(tgt_out != PAD_ID)  # (N,) into (B * T)
    return Batch(
        torch.from_numpy(src),
        torch.from_numpy(tgt_in),
        torch.from_numpy(tgt_out),
        num_tgt_tokens=int(tgt_lens.sum()) + len(tgt_lens),
        padding_share=padding,
        tgt_positions=torch.from_numpy(positions),
    )


# ---------------------------------------------------------------------------------------------------
# Packing


def pack_sorted(widths: np.ndarray, max_tokens: int) -> np.ndarray:
    """Start offsets of the batches that cut a width-sorted (non-decreasing) sequence greedily so that
    n_sentences * widest <= max_tokens; a sentence wider than the budget gets a batch of its own.

    Equal to adding sentences one at a time and closing the batch when the next one does not fit, but
    the loop runs over distinct widths (`pack_runs`).
    """
    firsts = np.flatnonzero(np.r_[len(widths) > 0, widths[1:] != widths[:-1]])  # where each run of a width starts
    return pack_runs(widths[firsts], np.diff(np.append(firsts, len(widths))), max_tokens)


def pack_runs(widths: np.ndarray, counts: np.ndarray, max_tokens: int) -> np.ndarray:
    """`pack_sorted` of the sequence that holds counts[r] sentences of width widths[r] for each run r
    (widths increasing): within a run of width w every batch holds max_tokens // w."""
    starts: list[np.ndarray] = []
    count = first = 0  # sentences in the open batch; where the run starts
    for width, n in zip(np.asarray(widths).tolist(), np.asarray(counts).tolist()):
        capacity = max(1, max_tokens // width)
        if count and count + 1 > capacity:
            count = 0
        fill = 0 if count == 0 else min(n, capacity - count)  # joins the open batch
        new = np.arange(first + fill, first + n, capacity)
        starts.append(new)
        count = count + n if len(new) == 0 else first + n - int(new[-1])
        first += n
    return np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)


def width_counts(src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    """(W,) int64: how many pairs have each padded width max(source, target) + 1 (the specials), counted a
    chunk at a time; the runs of an epoch's width-sorted order, without its widths."""
    top = int(max(src.max(initial=0), tgt.max(initial=0))) + 2 if len(src) else 0
    counts = np.zeros(top, dtype=np.int64)
    for start in range(0, len(src), CHUNK_PAIRS):
        widths = np.maximum(src[start : start + CHUNK_PAIRS], tgt[start : start + CHUNK_PAIRS]).astype(np.int64) + 1
        counts += np.bincount(widths, minlength=top)
    return counts


class EpochBatches:
    """One epoch's batches: views into a sorted order, in a shuffled batch order."""

    def __init__(self, order: np.ndarray, starts: np.ndarray, permutation: np.ndarray):
        self.order, self.bounds, self.permutation = order, np.append(starts, len(order)), permutation

    def __len__(self) -> int:
        return len(self.permutation)

    def __getitem__(self, k: int) -> np.ndarray:
        b = self.permutation[k]
        return self.order[self.bounds[b] : self.bounds[b + 1]]

    def __iter__(self):
        return (self[k] for k in range(len(self)))

    def tolist(self) -> list[list[int]]:
        return [batch.tolist() for batch in self]


class TokenBatchSampler:
    """Length-bucketed batches under a token budget, reshuffled per epoch from the seed.

    Pairs are sorted by (padded width = max(source + EOS, BOS + target), source length, target length,
    random tie-break) and packed greedily so that `n_sentences * widest <= max_tokens`; the batch
    order is then shuffled. An epoch's batches depend only on (seed, epoch), so a position in an
    epoch is all the state needed to resume exactly.

    With `epoch_lengths` (subword sampling: epoch -> the (source, target) lengths of that epoch's
    segmentation, a pure function of the epoch too), each epoch is packed by its own lengths, so that
    sampled batches keep to the budget with little padding; the fixed lengths check the budget once.

    With `epoch_pairs` (a mixture of corpora: epoch -> the positions that epoch trains on, repeats
    included, again a pure function of the epoch), each epoch packs those positions instead of all.
    """

    def __init__(self, src_lens, tgt_lens, max_tokens: int, seed: int, epoch_lengths=None, epoch_pairs=None):
        # lengths without the specials (+ EOS, + BOS/EOS when packed), held as given when compact already
        self.src_lens, self.tgt_lens = compact(src_lens), compact(tgt_lens)
        self.max_tokens, self.seed, self.epoch_lengths, self.epoch_pairs = max_tokens, seed, epoch_lengths, epoch_pairs
        self._epoch_lengths: tuple | None = None  # (epoch, its lengths): the last asked
        longest = int(max(self.src_lens.max(initial=0), self.tgt_lens.max(initial=0))) + 1 if len(self.src_lens) else 0
        if longest > max_tokens:
            raise DataError(
                f"trainer.max_tokens={max_tokens} is smaller than the longest sentence ({longest} tokens); "
                f"raise trainer.max_tokens or lower data.max_len"
            )

    def padded_tokens(self) -> int:
        """The sum of every pair's padded width, max(source + EOS, BOS + target + EOS - 1)."""
        counts = width_counts(self.src_lens, self.tgt_lens)
        return int(counts @ np.arange(len(counts)))

    def _lengths(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, target) lengths per pair, specials excluded, in `epoch`'s segmentation."""
        if self.epoch_lengths is None:
            return self.src_lens, self.tgt_lens
        if self._epoch_lengths is None or self._epoch_lengths[0] != epoch:
            self._epoch_lengths = (epoch, tuple(compact(x) for x in self.epoch_lengths(epoch)))
        return self._epoch_lengths[1]

    def batches(self, epoch: int) -> EpochBatches:
        src_lens, tgt_lens = self._lengths(epoch)
        chosen = None
        if self.epoch_pairs is not None:
            chosen = self.epoch_pairs(epoch)  # (M,) positions, repeats included
            src_lens, tgt_lens = src_lens[chosen], tgt_lens[chosen]
        rng = np.random.default_rng([self.seed, epoch])
        order = length_sorted_order(src_lens, tgt_lens, TieBreaks(rng, len(src_lens)))  # lengths + 1 sort alike
        counts = width_counts(src_lens, tgt_lens)  # the order's runs of equal width, narrowest first
        widths = np.flatnonzero(counts)
        starts = pack_runs(widths, counts[widths], self.max_tokens)
        if chosen is not None:
            order = chosen[order]
        return EpochBatches(order, starts, rng.permutation(len(starts)))


def batches_in_order(lengths, max_tokens: int) -> list[list[int]]:
    """Deterministic length-sorted batches for evaluation/decoding (no shuffling); +1 for EOS."""
    widths = np.asarray(lengths, dtype=np.int64) + 1
    order = np.argsort(widths, kind="stable")
    starts = pack_sorted(widths[order], max_tokens)
    return [part.tolist() for part in np.split(order, starts[1:])] if len(order) else []


# ---------------------------------------------------------------------------------------------------
# Feeding training through torch's DataLoader


class UpdateSampler(torch.utils.data.Sampler):
    """This rank's micro-batches for each optimizer update of one epoch, from a start position.

    Update k at epoch position p takes global batches p + u * world + rank (u < update_freq); a rank
    whose share runs past the end of the epoch repeats a batch with weight 0, so every rank runs the
    same number of backward passes (DDP's all-reduce needs all of them). Yields
    ([(indices, weight, (epoch, batch number)), ...], batches consumed by all ranks together); the
    (epoch, batch number) pair seeds a batch's subword sampling (`data.subword_sampling`).
    """

    def __init__(self, sampler: TokenBatchSampler, update_freq: int, rank: int = 0, world: int = 1):
        self.sampler, self.update_freq, self.rank, self.world = sampler, update_freq, rank, world
        self.epoch = self.position = 0

    def start(self, epoch: int, position: int) -> None:
        self.epoch, self.position = epoch, position

    def __iter__(self):
        batches = self.sampler.batches(self.epoch)
        position = self.position
        while position < len(batches):
            plan = []
            # u beyond the epoch's end adds nothing: a large update_freq costs no loop of its size
            for u in range(min(self.update_freq, -(-(len(batches) - position) // self.world))):
                index = position + u * self.world + self.rank
                if index < len(batches):
                    plan.append((batches[index], 1.0, (self.epoch, index)))
                elif self.world > 1 and position + u * self.world < len(batches):
                    plan.append((batches[0], 0.0, (self.epoch, 0)))
            consumed = min(self.update_freq * self.world, len(batches) - position)
            yield plan, consumed
            position += consumed


def place_language_tag(batch: Batch, side: str) -> Batch:
    """A multilingual batch (every source starting with its target-language tag) with the tag where
    data.language_tag puts it: `source` as stored; `both` also the decoder's first input, in place of BOS;
    `decoder` only there (the source's first column dropped). Nothing is predicted at the tag: `tgt_out`
    is unchanged, so the loss never sees a tag."""
    if side == "source":
        return batch
    tgt_in = batch.tgt_in.clone()
    tgt_in[:, 0] = batch.src[:, 0]  # (B,) the tags, in place of BOS
    src = batch.src[:, 1:].contiguous() if side == "decoder" else batch.src  # (B, S - 1) without the tags
    return Batch(src, tgt_in, batch.tgt_out, batch.num_tgt_tokens, batch.padding_share, batch.tgt_positions)


class UpdateBatches(torch.utils.data.Dataset):
    """Collates an update's plan from `UpdateSampler` into [(Batch, weight), ...] (in a worker when
    num_workers > 0), the language tags placed by data.language_tag (`place_language_tag`)."""

    def __init__(self, corpus, language_tag: str = "source"):
        self.corpus, self.language_tag = corpus, language_tag

    def __getitem__(self, item):
        plan, consumed = item
        return [
            (place_language_tag(self.corpus.collate(indices, key), self.language_tag), weight)
            for indices, weight, key in plan
        ], consumed


def _ignore_stop_signals(_worker_id: int) -> None:
    # Ctrl-C reaches the whole process group: only the main process stops the run (and saves).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def update_loader(corpus, sampler: UpdateSampler, num_workers: int, pin_memory: bool, language_tag: str = "source"):
    """A DataLoader of updates. It has its own generator: creating its iterators must not draw from
    the global torch RNG (dropout's stream), or a resumed run would not repeat an uninterrupted one."""
    return torch.utils.data.DataLoader(
        UpdateBatches(corpus, language_tag),
        sampler=sampler,
        batch_size=None,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        prefetch_factor=4 if num_workers > 0 else None,
        generator=torch.Generator(),
        worker_init_fn=_ignore_stop_signals if num_workers > 0 else None,
    )
