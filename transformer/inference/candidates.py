"""The top candidates of a search step: the k best (score, token) pairs of each row, found in blocks on a
CPU (a full top-k over the vocabulary is slow there), tokens the model never generates left out, and a
forced prefix's token scored. Shapes as in attention.py's legend; n rows, V vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from transformer.inference.decoders import (  # noqa: F401  (Hypothesis and the decoders: imported from here too)
    EncoderDecoder,
    EnsembleDecoder,
    Hypothesis,
    LogitsDecoder,
    ModelDecoder,
    StepDecoder,
)
from transformer.special import BOS_ID, EOS_ID, PAD_ID


def row_topk(scores: torch.Tensor, k: int, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """`scores.topk(k, dim=1)`, found by first ranking blocks of `chunk` columns by their maxima.

    The k best entries of a row lie in the k blocks with the highest maxima: those k maxima are k
    entries at least as large as anything in the other blocks. On the CPU this reads a (rows, V)
    log-probability matrix about twice as fast as `topk` over all of it. Ties may resolve differently.
    """
    rows, width = scores.shape
    if width < 4 * k * chunk:
        return scores.topk(k, dim=1)
    if width % chunk:
        scores = F.pad(scores, (0, chunk - width % chunk), value=float("-inf"))
    block_max = scores.view(rows, -1, chunk).amax(dim=2)  # (rows, blocks)
    top_blocks = block_max.topk(k, dim=1).indices  # (rows, k)
    offsets = torch.arange(chunk, device=scores.device)
    columns = (top_blocks[:, :, None] * chunk + offsets).view(rows, k * chunk)  # (rows, k * chunk)
    values, picks = scores.gather(1, columns).topk(k, dim=1)  # (rows, k)
    return values, columns.gather(1, picks).clamp_(max=width - 1)


# Rows of logits turned into float32 log-probabilities at a time on the CPU. A whole batch's would be
# up to ~40 MB of fresh memory every step, which glibc maps and the kernel page-faults in anew each
# time (about a tenth of decoding's CPU time); blocks this size are reused from the heap instead.
CPU_LOGPROB_BLOCK_ROWS = 128


def top_candidates(
    decoder: StepDecoder, tokens: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens (rows, t) -> the k most probable next tokens per row (log-probabilities (rows, k) and
    ids (rows, k), best first; PAD and BOS excluded) and each row's EOS log-probability (rows,)."""
    if not isinstance(decoder, LogitsDecoder):  # one that only offers log-probabilities
        return step_candidates(decoder.step(tokens), k)
    logits = decoder.logits(tokens)  # (rows, V)
    block = CPU_LOGPROB_BLOCK_ROWS if logits.device.type == "cpu" else max(1, logits.size(0))
    parts = [step_candidates(torch.log_softmax(rows, dim=-1, dtype=torch.float32), k) for rows in logits.split(block)]
    return tuple(torch.cat(tensors) for tensors in zip(*parts))


def never_generated(logprobs: torch.Tensor) -> torch.Tensor:
    """PAD and BOS masked out of (rows, V) log-probabilities, in place."""
    logprobs[:, PAD_ID] = float("-inf")  # integer indices: a fill on the device, no index tensor
    logprobs[:, BOS_ID] = float("-inf")  # copied from the host
    return logprobs


def step_candidates(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    never_generated(logprobs)
    values, ids = row_topk(logprobs, min(k, logprobs.size(1)))  # (rows, k)
    return values, ids, logprobs[:, EOS_ID]


def prefix_logprob(logprobs: torch.Tensor, wanted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows are still inside their target prefix (`wanted` (rows,): the prefix token of this step,
    PAD once a row's prefix has ended) and the log-probability (rows,) of that token."""
    return wanted != PAD_ID, logprobs.gather(1, wanted[:, None]).squeeze(1)
