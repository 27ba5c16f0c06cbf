"""Label-smoothed cross-entropy, fused with the output projection.

For N target tokens and a vocabulary of V, the naive path (logits = h Wᵀ, log_softmax, gather, mean)
writes and re-reads several (N, V) float tensors in the forward and the backward pass. Here the
forward pass computes the logits chunk by chunk and makes of each chunk one fused log-softmax and one
exp written straight into the stored gradient softmax(z) - (1 - ε) onehot(y); that one (N, V) tensor
is all the backward pass keeps, and it is two matmuls whose small (N, D) and (V, D) results, not the
(N, V) tensor, take the incoming gradient's scale.

Two terms that touch every logit are computed from (N, D) or (V, D) tensors instead:
- the smoothing's mean log-probability: Σ_v log p_v = Σ_v z_v - V lse, with Σ_v z_v = h · Σ_v w_v and
  lse = z_y - log p_y;
- the smoothing's uniform part of the gradient, -ε/V at every logit: its products with W and h are
  -ε/V Σ_v w_v (every row of the hidden gradient) and -ε/V Σ_n h_n (every row of the weight gradient).
The loss per token is -(1 - ε) log p[y] - ε mean(log p).

The stored gradient has the compute dtype, except under fp16, whose range would flush the small
probabilities of a large vocabulary to zero before the loss scale exists (it is only known in the
backward pass): then it is kept in float32 and scaled before the cast.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

# Rows of logits per chunk: the float32 chunk is CHUNK_ROWS x V (1024 x 32k = 128 MB). A GPU keeps its
# cores busier with larger chunks; a CPU's caches prefer smaller ones.
CHUNK_ROWS = {"cpu": 1024, "cuda": 4096}


class _FusedOutputCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, smoothing: float, compute_dtype: torch.dtype):
        # hidden (N, D), weight (V, D), target (N,) -> summed loss, summed NLL, correct predictions
        # (float32 scalars; a target counts as predicted when no token is more probable)
        n_tokens, vocab = hidden.size(0), weight.size(0)
        stored_dtype = torch.float32 if compute_dtype == torch.float16 else compute_dtype
        chunk = CHUNK_ROWS.get(hidden.device.type, 1024)
        with autocast_off(hidden.device.type):
            h = hidden.to(compute_dtype)
            w = weight.to(compute_dtype)
            grad_logits = torch.empty(n_tokens, vocab, dtype=stored_dtype, device=hidden.device)
            nll = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
            logit_of_target = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
            correct = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, n_tokens, chunk):
                rows = slice(start, start + chunk)
                tgt = target[rows][:, None]
                logits = (h[rows] @ w.t()).float()                             # (n, V)
                logp = F.log_softmax(logits, dim=1)                             # (n, V) log-probabilities
                logp_of_target = logp.gather(1, tgt).squeeze(1)                  # (n,)
                nll[rows] = -logp_of_target
                correct += (logp_of_target >= logp.amax(dim=1)).sum()          # amax: no indices, cheap
                if smoothing:
                    logit_of_target[rows] = logits.gather(1, tgt).squeeze(1)
                grad = grad_logits[rows]
                torch.exp(logp, out=grad)                                       # softmax, in the stored dtype
                grad[torch.arange(grad.size(0), device=grad.device), tgt[:, 0]] -= 1.0 - smoothing
            nll_sum = nll.sum()
            loss_sum = (1.0 - smoothing) * nll_sum
            ctx.weight_sum = w.float().sum(0) if smoothing else None           # (D,) Σ_v w_v, also for backward
            if smoothing:
                log_partition = logit_of_target + nll                           # (N,) lse = z_y - log p_y
                mean_logp = (h.float() @ ctx.weight_sum) / vocab - log_partition  # (N,) mean_v log p_v
                loss_sum = loss_sum - smoothing * mean_logp.sum()
        ctx.save_for_backward(grad_logits, h, w)
        ctx.dtypes = (hidden.dtype, weight.dtype, compute_dtype)
        ctx.uniform = smoothing / vocab
        ctx.mark_non_differentiable(correct)
        return loss_sum, nll_sum, correct

    @staticmethod
    def backward(ctx, grad_loss, grad_nll, grad_correct):
        grad_logits, h, w = ctx.saved_tensors
        hidden_dtype, weight_dtype, compute_dtype = ctx.dtypes
        scale = grad_loss.float()
        if grad_logits.dtype != compute_dtype:        # fp16: scale in float32, then into fp16's range
            scaled = (grad_logits * scale).to(compute_dtype)
            grad_hidden = (scaled @ w).float()                                                  # (N, D)
            grad_weight = (scaled.t() @ h).float()                                              # (V, D)
        else:
            grad_hidden = (grad_logits @ w).float() * scale                                     # (N, D)
            grad_weight = (grad_logits.t() @ h).float() * scale                                 # (V, D)
        if ctx.uniform:                               # the -ε/V at every logit, through each matmul
            grad_hidden -= (scale * ctx.uniform) * ctx.weight_sum
            grad_weight -= (scale * ctx.uniform) * h.float().sum(0)
        return grad_hidden.to(hidden_dtype), grad_weight.to(weight_dtype), None, None, None


def output_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         smoothing: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (N, D), output weight (V, D), target (N,) -> (summed smoothed loss, summed NLL, the number
    of targets predicted: those no other token is more probable than).

    Matmuls run in the autocast dtype when autocast is on; the softmax is always float32.
    The NLL and the count are for logging and carry no gradient.

    Not for torch.compile to trace: its loop over chunks of rows specialises a graph on the batch's
    token count, one compilation per batch size until dynamo gives up (seen on an H100: minutes of
    compiling, then recompile_limit). trainer.compile compiles the layers only (`model.compile_layers`);
    code that compiles a caller wraps this in `torch.compiler.disable` (not done here: it would load
    torch._dynamo, a second of start-up, in every command).
    """
    compute_dtype = autocast_dtype(hidden.device.type) or hidden.dtype
    loss, nll, correct = _FusedOutputCrossEntropy.apply(hidden, weight, target, smoothing, compute_dtype)
    return loss, nll.detach(), correct


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on `device_type`, or None when it is off there (or, as on the
    `meta` device, does not exist)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def autocast_off(device_type: str):
    """A context with autocast off on `device_type` (nothing to turn off where it does not exist)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def output_cross_entropy_reference(hidden, weight, target, smoothing):
    """The same loss written with plain autograd ops: the slow truth the fused one is tested against."""
    logprobs = F.log_softmax((hidden @ weight.t()).float(), dim=-1)
    nll = -logprobs.gather(1, target[:, None]).squeeze(1)
    loss = (1.0 - smoothing) * nll - smoothing * logprobs.mean(dim=-1)
    correct = (logprobs.argmax(dim=-1) == target).sum().float()
    return loss.sum(), nll.detach().sum(), correct


# ----- the loss of a batch, as training and validation compute it ----------------------------------

def batch_loss(model, batch, smoothing: float):
    """(summed label-smoothed loss, summed NLL, correct predictions) of one batch; logits only at real
    target positions.

    `model` may be wrapped (DDP, torch.compile): its forward runs, so wrappers see the whole graph.
    """
    hidden, target = target_hidden(model, batch)
    return output_cross_entropy(hidden, unwrap(model).output.weight, target, smoothing)


def target_hidden(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states (N, D), target ids (N,)) at the batch's N real target positions."""
    hidden = model(batch.src, batch.tgt_in, return_hidden=True)                # (B, T, D)
    positions = batch.target_positions()                                       # (N,) into B * T
    hidden = hidden.flatten(0, 1).index_select(0, positions)                   # (N, D)
    target = batch.tgt_out.flatten().index_select(0, positions)                # (N,)
    return hidden, target


def unwrap(model):
    """The Transformer inside a torch.compile and/or DistributedDataParallel wrapper."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)
