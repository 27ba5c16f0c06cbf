"""Label-smoothed cross-entropy, fused with the output projection.

For N target tokens and a vocabulary of V, the naive path (logits = h Wᵀ, log_softmax, gather, mean)
writes and re-reads several (N, V) float tensors in the forward and the backward pass. Here the
forward pass computes the logits chunk by chunk, turns each chunk in place into its gradient
softmax(z) - (1 - ε) onehot(y) - ε / V, and keeps only that one (N, V) tensor for the backward pass,
which is two matmuls. The loss per token is logsumexp(z) - (1 - ε) z[y] - ε mean(z).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_ROWS = 1024


class _FusedOutputCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, smoothing: float, compute_dtype: torch.dtype):
        # hidden (N, D), weight (V, D), target (N,) -> summed loss, summed NLL (float32 scalars)
        n_tokens, vocab = hidden.size(0), weight.size(0)
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(compute_dtype)
            w = weight.to(compute_dtype)
            grad_logits = torch.empty(n_tokens, vocab, dtype=compute_dtype, device=hidden.device)
            loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
            nll_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, n_tokens, CHUNK_ROWS):
                rows = slice(start, start + CHUNK_ROWS)
                tgt = target[rows]
                z = (h[rows] @ w.t()).float()                                  # (n, V) logits
                target_logit = z.gather(1, tgt[:, None]).squeeze(1)            # (n,)
                mean_logit = z.mean(dim=1)
                z_max = z.amax(dim=1, keepdim=True)
                z.sub_(z_max).exp_()                                            # exp(z - max)
                total = z.sum(dim=1, keepdim=True)
                lse = (z_max + total.log()).squeeze(1)                          # logsumexp(z)
                nll_sum += (lse - target_logit).sum()
                loss_sum += (lse - (1.0 - smoothing) * target_logit - smoothing * mean_logit).sum()
                z.div_(total)                                                   # softmax(z)
                if smoothing:
                    z.sub_(smoothing / vocab)
                z[torch.arange(z.size(0), device=z.device), tgt] -= 1.0 - smoothing
                grad_logits[rows] = z
        ctx.save_for_backward(grad_logits, h, w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss_sum, nll_sum

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        grad_logits, h, w = ctx.saved_tensors
        grad_logits = grad_logits * grad_loss.to(grad_logits.dtype)
        grad_hidden = grad_logits @ w                                           # (N, D)
        grad_weight = grad_logits.t() @ h                                       # (V, D)
        hidden_dtype, weight_dtype = ctx.dtypes
        return grad_hidden.to(hidden_dtype), grad_weight.to(weight_dtype), None, None, None


def output_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (N, D), output weight (V, D), target (N,) -> (summed smoothed loss, summed NLL).

    Matmuls run in the autocast dtype when autocast is on; the softmax is always float32.
    The NLL is for logging and carries no gradient.
    """
    device_type = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    loss, nll = _FusedOutputCrossEntropy.apply(hidden, weight, target, smoothing, compute_dtype)
    return loss, nll.detach()


def output_cross_entropy_reference(hidden, weight, target, smoothing):
    """The same loss written with plain autograd ops: the slow truth the fused one is tested against."""
    logprobs = F.log_softmax((hidden @ weight.t()).float(), dim=-1)
    nll = -logprobs.gather(1, target[:, None]).squeeze(1)
    loss = (1.0 - smoothing) * nll - smoothing * logprobs.mean(dim=-1)
    return loss.sum(), nll.detach().sum()
