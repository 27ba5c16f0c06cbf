"""trainer.max_tokens_auto: the largest token budget whose worst batch fits in the GPU's memory (as
Marian's --mini-batch-fit does), found once at a run's start and kept in its checkpoints.

The worst batch of a budget is the longest bucket's: sentences of data.max_len tokens on both sides
(`worst_batch`), as many as the budget allows. A budget fits (`cuda_probe`) when a forward and backward of
that batch run without running out of memory and its peak, plus the optimizer's moments (not allocated
before the first update), leaves HEADROOM of the device's memory free: the allocator's fragmentation
and the DataLoader's pinned copies need some. The search (`largest_fitting_budget`) is a pure function of
such a probe, so a CPU test drives it with a fake one.

On a CPU there is no device memory to fit: the key falls back to trainer.max_tokens with a warning
(refusing would make a GPU preset that sets it unusable on the development machine).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable

import torch

from transformer.config import MAX_BATCH_TOKENS
from transformer.data.batching import Batch
from transformer.errors import TrainingError
from transformer.loss import batch_loss
from transformer.special import BOS_ID, EOS_ID

log = logging.getLogger("transformer.train")

HEADROOM = 0.10  # of the device's total memory, left free at the worst batch's peak
RUNG = 1024  # budgets tried are multiples of this (multiples of 8 too: tensor-core friendly widths)


def largest_fitting_budget(
    fits: Callable[[int], bool], first: int = 8 * RUNG, ceiling: int = MAX_BATCH_TOKENS, rung: int = RUNG
) -> tuple[int | None, int]:
    """(the largest multiple of `rung` up to `ceiling` for which `fits` holds, the probes made), assuming
    that a budget which fits means every smaller one fits. Doubles from `first` (halves if it does not
    fit) to bracket the answer, then bisects the rungs between: about 2 log2(ceiling / rung) probes at
    most. None if not even `rung` fits."""
    tries = 0

    def probe(budget: int) -> bool:
        nonlocal tries
        tries += 1
        return fits(budget)

    budget = max(rung, min(ceiling, first) // rung * rung)
    if probe(budget):
        good, bad = budget, None
        while bad is None and good * 2 <= ceiling:
            if probe(good * 2):
                good *= 2
            else:
                bad = good * 2
        if bad is None:  # every doubling fitted: the last step is up to the ceiling's rung
            bad = ceiling // rung * rung + rung
    else:
        good, bad = None, budget
        while good is None and bad > rung:
            candidate = max(rung, bad // 2 // rung * rung)
            if probe(candidate):
                good = candidate
            else:
                bad = candidate
        if good is None:
            return None, tries
    while bad - good > rung:  # good fits, bad does not (or lies past the ceiling); both multiples of rung
        middle = (good + bad) // 2 // rung * rung
        if probe(middle):
            good = middle
        else:
            bad = middle
    return good, tries


def worst_batch(budget: int, max_len: int, vocab: int, device) -> Batch:
    """The budget's batch of the longest sentences: data.max_len tokens + EOS on the source side, BOS +
    max_len tokens on the target side, budget // (max_len + 1) of them (B, max_len + 1), random pieces."""
    width = max_len + 1
    rows = max(1, budget // width)
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(EOS_ID + 1, vocab, (rows, width), generator=generator)
    tgt_out = torch.randint(EOS_ID + 1, vocab, (rows, width), generator=generator)
    src[:, -1], tgt_out[:, -1] = EOS_ID, EOS_ID
    tgt_in = torch.cat([torch.full((rows, 1), BOS_ID), tgt_out[:, :-1]], dim=1)
    return Batch(src, tgt_in, tgt_out, rows * width, 0.0, torch.arange(rows * width)).to(device)


def cuda_probe(model, runtime, max_len: int, vocab: int, rdrop: bool) -> Callable[[int], bool]:
    """`fits(budget)` on `runtime`'s CUDA device: a forward and backward of the budget's worst batch
    (twice as many rows under trainer.rdrop) at the run's precision, within the memory left by HEADROOM."""
    device = runtime.device
    total = torch.cuda.get_device_properties(device).total_memory
    moments = 2 * sum(p.numel() * 4 for p in model.parameters())  # AdamW's float32 exp_avg, exp_avg_sq

    def fits(budget: int) -> bool:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        try:
            batch = worst_batch(budget, max_len, vocab, device)
            if rdrop:
                batch = batch.twice()
            with runtime.autocast():
                loss = batch_loss(model, batch, 0.1, 0.0)[0]
            loss.backward()
            del loss, batch
            peak = torch.cuda.max_memory_allocated(device)
            ok = peak + moments <= (1.0 - HEADROOM) * total
        except torch.cuda.OutOfMemoryError:
            ok = False
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        return ok

    return fits


def choose_max_tokens(tc, data_cfg, model, runtime, vocab: int, probe=None) -> int:
    """trainer.max_tokens for a new run with trainer.max_tokens_auto=true: the search's answer on CUDA
    (logged), trainer.max_tokens on any other device (a warning). `probe`: `fits` instead of `cuda_probe`."""
    if runtime.device.type != "cuda" and probe is None:
        log.warning(
            "trainer.max_tokens_auto=true sizes batches to a GPU's memory; on %s it is ignored and "
            "trainer.max_tokens=%d is used (set trainer.max_tokens to choose another budget)",
            runtime.device.type,
            tc.max_tokens,
        )
        return tc.max_tokens
    fits = probe or cuda_probe(model, runtime, data_cfg.max_len, vocab, bool(tc.rdrop))
    # The probe's dropout draws from the device's generator: the run's random streams stay as without it.
    with torch.random.fork_rng(devices=[runtime.device] if runtime.device.type == "cuda" else []):
        budget, tries = largest_fitting_budget(fits, first=tc.max_tokens)
    if budget is None:
        raise TrainingError(
            f"trainer.max_tokens_auto=true: not even {RUNG} tokens of data.max_len={data_cfg.max_len} sentences fit "
            f"in this GPU's memory; lower data.max_len or set trainer.max_tokens (e.g. trainer.max_tokens={RUNG // 2})"
        )
    log.info(
        "trainer.max_tokens_auto: trainer.max_tokens=%d, the largest budget whose longest batch (data.max_len=%d) "
        "fits with %d%% of the memory free (%d tries); a resumed run keeps it",
        budget,
        data_cfg.max_len,
        round(100 * HEADROOM),
        tries,
    )
    return budget
