"""Label-smoothed cross-entropy, fused with the output projection.

For N target tokens and a vocabulary of V, the naive path (logits = h Wᵀ, log_softmax, gather, mean)
writes and re-reads several (N, V) float tensors in the forward and the backward pass. Here the
forward pass computes the logits chunk by chunk, turns each chunk into its gradient
softmax(z) - (1 - ε) onehot(y) - ε / V with as few passes over it as it can (one fused log-softmax,
one mean, one exp written straight into the stored gradient, one shift), and keeps only that one
(N, V) tensor for the backward pass, which is two matmuls whose small (N, D) and (V, D) results,
not the (N, V) tensor, take the incoming gradient's scale. The loss per token is
-(1 - ε) log p[y] - ε mean(log p).

The stored gradient has the compute dtype, except under fp16, whose range would flush the small
probabilities of a large vocabulary to zero before the loss scale exists (it is only known in the
backward pass): then it is kept in float32 and scaled before the cast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows of logits per chunk: the float32 chunk is CHUNK_ROWS x V (1024 x 32k = 128 MB). A GPU keeps its
# cores busier with larger chunks; a CPU's caches prefer smaller ones.
CHUNK_ROWS = {"cpu": 1024, "cuda": 4096}


class _FusedOutputCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, smoothing: float, compute_dtype: torch.dtype):
        # hidden (N, D), weight (V, D), target (N,) -> summed loss, summed NLL (float32 scalars)
        n_tokens, vocab = hidden.size(0), weight.size(0)
        stored_dtype = torch.float32 if compute_dtype == torch.float16 else compute_dtype
        chunk = CHUNK_ROWS.get(hidden.device.type, 1024)
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(compute_dtype)
            w = weight.to(compute_dtype)
            grad_logits = torch.empty(n_tokens, vocab, dtype=stored_dtype, device=hidden.device)
            loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
            nll_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, n_tokens, chunk):
                rows = slice(start, start + chunk)
                tgt = target[rows]
                logp = F.log_softmax((h[rows] @ w.t()).float(), dim=1)         # (n, V) log-probabilities
                nll = -logp.gather(1, tgt[:, None]).squeeze(1)                 # (n,)
                nll_sum += nll.sum()
                loss_sum += (1.0 - smoothing) * nll.sum() - smoothing * logp.mean(dim=1).sum()
                grad = grad_logits[rows]
                torch.exp(logp, out=grad)                                       # softmax, in the stored dtype
                if smoothing:
                    grad.sub_(smoothing / vocab)
                grad[torch.arange(grad.size(0), device=grad.device), tgt] -= 1.0 - smoothing
        ctx.save_for_backward(grad_logits, h, w)
        ctx.dtypes = (hidden.dtype, weight.dtype, compute_dtype)
        return loss_sum, nll_sum

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        grad_logits, h, w = ctx.saved_tensors
        hidden_dtype, weight_dtype, compute_dtype = ctx.dtypes
        scale = grad_loss.float()
        if grad_logits.dtype != compute_dtype:        # fp16: scale in float32, then into fp16's range
            grad_logits = (grad_logits * scale).to(compute_dtype)
            scale = None
        grad_hidden = grad_logits @ w                                           # (N, D)
        grad_weight = grad_logits.t() @ h                                       # (V, D)
        if scale is not None:
            grad_hidden, grad_weight = grad_hidden.float() * scale, grad_weight.float() * scale
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
