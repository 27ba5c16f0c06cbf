"""Label-smoothed cross-entropy, fused with the output projection.

For N target tokens and a vocabulary of V, the naive path (logits = h Wᵀ, log_softmax, gather, mean)
writes and re-reads several (N, V) float tensors in the forward and the backward pass. Here the
forward pass computes the logits chunk by chunk; of each chunk it makes one fused softmax (the NLL
comes from the softmax at the largest logit, which cannot underflow: no log-softmax, one exp per
logit) and from it the gradient at the logits, softmax(z) - (1 - ε) onehot(y), which goes at once
through the two matmuls of the backward pass (`_LogitGradient`): the backward pass only scales their
small (N, D) and (V, D) results by the incoming gradient.

Two terms that touch every logit are computed from (N, D) or (V, D) tensors instead:
- the smoothing's mean log-probability: Σ_v log p_v = Σ_v z_v - V lse, with Σ_v z_v = h · Σ_v w_v and
  lse = z_y - log p_y;
- the smoothing's uniform part of the gradient, -ε/V at every logit: its products with W and h are
  -ε/V Σ_v w_v (every row of the hidden gradient) and -ε/V Σ_n h_n (every row of the weight gradient).
The loss per token is -(1 - ε) log p[y] - ε mean(log p).

Under fp16, whose range would flush the small probabilities of a large vocabulary to zero before the
loss scale exists (it is only known in the backward pass), the gradient at the logits is kept in
float32 instead, and scaled before the cast.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

# Rows of logits per chunk: the float32 chunk is CHUNK_ROWS x V (4096 x 32k = 512 MB on a GPU). A GPU
# keeps its cores busier with larger chunks; a CPU's caches prefer smaller ones: on the 2-core Xeon, 4,096
# tokens x 10k pieces, the loss's forward and backward take 0.85x the time at 256 rows as at 1,024 (the
# same at 128 and 512).
CHUNK_ROWS = {"cpu": 256, "cuda": 4096}
# Rows of the gradient at the logits gathered before the output weight's product Gᵀ H (V, D) is taken:
# one product per chunk of CHUNK_ROWS would read and write the whole (V, D) float32 sum once per chunk, for
# a product whose inner dimension is only the chunk's rows. On the 2-core Xeon with AMX (bf16), 4,096 tokens
# x 8k pieces x 128 wide, the loss's forward and backward take 0.72-0.85x the time of a product per chunk
# (R-Drop, the tokens twice: 0.82-0.90x), and recipe=multi30k_long trains 4% more tokens/s. float32 keeps a
# product per chunk (addmm_ into the sum; gathering the rows costs what it saves).
WEIGHT_PRODUCT_ROWS = 1024


class _LogitGradient:
    """The gradient at the logits, G = ∂loss/∂z (N, V), as the forward pass makes it chunk by chunk, and
    the two products the backward pass needs of it: G W (N, D), the hidden states' gradient, and Gᵀ H
    (V, D), the output weight's.

    Outside fp16 (float32, bfloat16) both products are taken in the forward pass and the (N, V) tensor
    never exists (on the 2-core Xeon, 4,096 tokens x 10k pieces, the loss's forward and backward take 0.78x
    the time of storing G; and N x V fewer floats in memory): G W chunk by chunk, while the chunk is still
    in the cache; Gᵀ H chunk by chunk in float32, and in bfloat16 over WEIGHT_PRODUCT_ROWS rows of G
    gathered from the chunks (a CPU's chunks are smaller than that).
    fp16 stores G in float32 instead: its range would flush the small probabilities of a large
    vocabulary to zero, so the backward pass scales G by the loss scale (only known then) before the
    fp16 matmuls. Without autograd (validation) nothing is kept.
    """

    def __init__(self, h: torch.Tensor, w: torch.Tensor, wanted: bool):
        # h (N, D) and w (V, D) in the compute dtype
        self.h, self.w = h, w
        self.mode = "none" if not wanted else ("stored" if h.dtype == torch.float16 else "eager")
        (n_tokens, dim), vocab = h.shape, w.size(0)
        if self.mode == "stored":
            self.logits = torch.empty(n_tokens, vocab, dtype=torch.float32, device=h.device)  # (N, V)
        elif self.mode == "eager":
            self.hidden = torch.empty(n_tokens, dim, dtype=torch.float32, device=h.device)  # (N, D) G W
            self.weight = torch.zeros(vocab, dim, dtype=torch.float32, device=h.device)  # (V, D) Gᵀ H
            # bf16: rows of G and of H (scaled) wait in (P, V) and (P, D) buffers, made when a chunk is
            # smaller than P, for their share of Gᵀ H
            self.pending_capacity = min(WEIGHT_PRODUCT_ROWS, n_tokens)
            self.pending_grad = self.pending_h = None
            self.pending_rows = 0

    def add(self, rows: slice, grad: torch.Tensor, scale: float = 1.0) -> None:
        """Rows `rows` of G: `scale` x `grad` (n, V), float32 (the scale goes on the products, not on the
        (n, V) chunk)."""
        if self.mode == "stored":
            torch.mul(grad, scale, out=self.logits[rows])
        elif self.mode == "eager" and self.h.dtype == torch.float32:
            torch.mm(grad, self.w, out=self.hidden[rows])
            if scale != 1.0:
                self.hidden[rows] *= scale
            self.weight.addmm_(grad.t(), self.h[rows], alpha=scale)
        elif self.mode == "eager":  # bfloat16 (or float64) products, summed in float32
            n = grad.size(0)
            gathered = n < self.pending_capacity  # else: a chunk as large as the buffer
            if gathered:
                if self.pending_grad is None:
                    self.pending_grad = self.h.new_empty(self.pending_capacity, self.w.size(0))  # (P, V)
                    self.pending_h = self.h.new_empty(self.pending_capacity, self.h.size(1))  # (P, D)
                if self.pending_rows + n > self.pending_capacity:
                    self._flush()
                waiting = slice(self.pending_rows, self.pending_rows + n)
                grad = self.pending_grad[waiting].copy_(grad)  # (n, V) in the compute dtype
            else:
                grad = grad.to(self.h.dtype)
            self.hidden[rows] = (grad @ self.w).float() * scale
            if gathered:
                torch.mul(self.h[rows], scale, out=self.pending_h[waiting])
                self.pending_rows += n
            else:
                self.weight += (grad.t() @ self.h[rows]).float() * scale

    def _flush(self) -> None:
        """weight += Gᵀ H over the rows waiting (one product, summed in float32)."""
        if self.pending_rows:
            waiting = slice(0, self.pending_rows)
            self.weight += (self.pending_grad[waiting].t() @ self.pending_h[waiting]).float()
            self.pending_rows = 0

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What the backward pass needs, for `ctx.save_for_backward` (which frees it after that pass)."""
        if self.mode == "stored":
            return self.logits, self.h, self.w
        if self.mode == "eager":
            self._flush()
            del self.pending_grad, self.pending_h  # (P, V): not kept for backward
        return (self.hidden, self.weight) if self.mode == "eager" else ()

    @staticmethod
    def products(
        mode: str, tensors: tuple[torch.Tensor, ...], scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale G W, scale Gᵀ H) in float32, from the `tensors()` of a `mode` gradient."""
        if mode == "stored":
            logits, h, w = tensors
            scaled = (logits * scale).to(h.dtype)  # fp16: scaled into its range
            return (scaled @ w).float(), (scaled.t() @ h).float()
        hidden, weight = tensors
        return hidden * scale, weight * scale


def _softmax_chunk(h_rows: torch.Tensor, w: torch.Tensor, tgt: torch.Tensor):
    """One chunk of rows: h_rows (n, D), w (V, D), tgt (n, 1) -> logits (n, V) and their softmax (n, V) in
    float32, the largest logit, the target's logit and the log-sum-exp (n,) each.

    One exp per logit: lse = z_max - log p_max, since p_max >= 1/V cannot underflow as a tiny p_y would,
    so log p_y = z_y - lse is exact without a log-softmax (a second exp per logit)."""
    logits = (h_rows @ w.t()).float()  # (n, V)
    top_logit = logits.amax(dim=1)  # (n,)
    logit_of_target = logits.gather(1, tgt).squeeze(1)  # (n,)
    probs = torch.softmax(logits, dim=1)  # (n, V)
    return logits, probs, top_logit, logit_of_target, top_logit - probs.amax(dim=1).log()


class _FusedOutputCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        target,
        smoothing: float,
        rdrop: float,
        compute_dtype: torch.dtype,
        gradient_wanted: bool = True,
    ):
        # hidden (N, D), weight (V, D), target (N,) -> summed loss, summed NLL, correct predictions
        # (float32 scalars; a target counts as predicted when no token is more probable)
        n_tokens, vocab = hidden.size(0), weight.size(0)
        if rdrop:
            return _FusedOutputCrossEntropy._forward_rdrop(
                ctx, hidden, weight, target, smoothing, rdrop, compute_dtype, gradient_wanted
            )
        chunk = CHUNK_ROWS.get(hidden.device.type, 1024)
        with autocast_off(hidden.device.type):
            h = hidden.to(compute_dtype)
            w = weight.to(compute_dtype)
            gradient = _LogitGradient(h, w, gradient_wanted)
            nll = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
            logit_of_target = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
            correct = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, n_tokens, chunk):
                rows = slice(start, start + chunk)
                tgt = target[rows][:, None]
                _, probs, top_logit, logit_of_target[rows], lse = _softmax_chunk(h[rows], w, tgt)
                nll[rows] = lse - logit_of_target[rows]
                correct += (logit_of_target[rows] >= top_logit).sum()
                probs[torch.arange(probs.size(0), device=probs.device), tgt[:, 0]] -= 1.0 - smoothing
                gradient.add(rows, probs)  # G = softmax - (1 - ε) onehot
            nll_sum = nll.sum()
            loss_sum = (1.0 - smoothing) * nll_sum
            weight_sum = w.float().sum(0) if smoothing else None  # (D,) Σ_v w_v, also for backward
            if smoothing:
                log_partition = logit_of_target + nll  # (N,) lse = z_y - log p_y
                mean_logp = (h.float() @ weight_sum) / vocab - log_partition  # (N,) mean_v log p_v
                loss_sum = loss_sum - smoothing * mean_logp.sum()
        return _FusedOutputCrossEntropy._keep_for_backward(
            ctx, gradient, weight_sum, hidden, weight, smoothing, loss_sum, nll_sum, correct
        )

    @staticmethod
    def _keep_for_backward(ctx, gradient, weight_sum, hidden, weight, smoothing, loss_sum, nll_sum, correct):
        # Saved, not kept on ctx: autograd frees saved tensors after the backward pass.
        ctx.mode = gradient.mode
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.uniform = smoothing / weight.size(0) if gradient.mode != "none" else 0.0
        sums = (weight_sum, gradient.h.float().sum(0)) if ctx.uniform else ()  # the -ε/V at every logit:
        ctx.save_for_backward(*gradient.tensors(), *sums)  # Σ_v w_v and Σ_n h_n (D,)
        ctx.mark_non_differentiable(correct)
        return loss_sum, nll_sum, correct

    @staticmethod
    def _forward_rdrop(ctx, hidden, weight, target, smoothing, rdrop, compute_dtype, gradient_wanted):
        """The loss of R-Drop (Liang et al. 2021): rows [0, N/2) and [N/2, N) of `hidden` are two passes of
        the same tokens under different dropout (row i and row N/2 + i share a target). To the
        label-smoothed loss of every row it adds, per pair of rows with distributions p and q,
        rdrop / 2 x (KL(p || q) + KL(q || p)): the paper's CE₁ + CE₂ + α/2 (KL(p||q) + KL(q||p)) halved, so
        that divided by the N target tokens it is per token what the plain loss is.

        Per pair the symmetric KL is Σ_v p_v r_v - Σ_v q_v r_v with r = log p - log q; with a = rdrop / 2
        its gradient at the first pass's logits is a (p ⊙ (r - KL(p || q)) + p - q), at the second's the
        mirror image, and with the cross-entropy's p - (1 - ε) onehot the first pass's whole gradient is
        a (p ⊙ (r + (1 + a) / a - KL(p || q)) - q) - (1 - ε) onehot: three passes over the (n, V) chunk,
        the factor a applied to the two products (`_LogitGradient.add`). The logs come from the softmax
        as in the plain loss (lse = z_max - log p_max), and the smoothing's mean log-probability from
        h · Σ_v w_v: no log-softmax. The chunk works in float32.
        """
        n_tokens, vocab = hidden.size(0), weight.size(0)
        if n_tokens % 2:
            raise ValueError(f"R-Drop needs the two passes' rows: an even number of tokens, not {n_tokens}")
        pairs = n_tokens // 2
        chunk = CHUNK_ROWS.get(hidden.device.type, 1024) // 2
        half = rdrop / 2  # a, the KL sum's weight
        with autocast_off(hidden.device.type):
            h = hidden.to(compute_dtype)
            w = weight.to(compute_dtype)
            weight_sum = w.float().sum(0)  # (D,) Σ_v w_v
            gradient = _LogitGradient(h, w, gradient_wanted)
            nll_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
            mean_logp_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
            kl_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
            correct = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, pairs, chunk):
                passes = []
                for rows in (
                    slice(start, min(start + chunk, pairs)),
                    slice(pairs + start, pairs + min(start + chunk, pairs)),
                ):
                    tgt = target[rows][:, None]
                    logits, probs, top_logit, logit_of_target, lse = _softmax_chunk(h[rows], w, tgt)
                    nll_sum += (lse - logit_of_target).sum()
                    mean_logp_sum += ((h[rows].float() @ weight_sum) / vocab - lse).sum()
                    correct += (logit_of_target >= top_logit).sum()
                    passes.append((rows, tgt, logits, probs, lse))
                (rows_p, tgt_p, log_ratio, p, lse_p), (rows_q, tgt_q, buffer, q, lse_q) = passes
                log_ratio.sub_(buffer).sub_((lse_p - lse_q)[:, None])  # (n, V) r = log p - log q
                kl_pq = torch.linalg.vecdot(p, log_ratio)  # (n,) KL(p || q)
                kl_qp = -torch.linalg.vecdot(q, log_ratio)  # (n,) KL(q || p)
                kl_sum += (kl_pq + kl_qp).sum()
                if gradient.mode == "none":  # no autograd: the loss only
                    continue
                rows_of = torch.arange(p.size(0), device=p.device)
                # first pass: a (p ⊙ (r + c_p) - q) with c_p = (1 + a) / a - KL(p || q), in the buffer
                grad = torch.add(log_ratio, ((1 + half) / half - kl_pq)[:, None], out=buffer).mul_(p).sub_(q)
                grad[rows_of, tgt_p[:, 0]] -= (1.0 - smoothing) / half
                gradient.add(rows_p, grad, half)
                # second pass: a (q ⊙ (-r + c_q) - p) = -a (q ⊙ (r - c_q) + p), c_q = (1 + a) / a - KL(q || p)
                grad = torch.sub(log_ratio, ((1 + half) / half - kl_qp)[:, None], out=buffer).mul_(q).add_(p)
                grad[rows_of, tgt_q[:, 0]] += (1.0 - smoothing) / half
                gradient.add(rows_q, grad, -half)
            loss_sum = (1.0 - smoothing) * nll_sum - smoothing * mean_logp_sum + half * kl_sum
            weight_sum = weight_sum if smoothing else None  # for backward
        return _FusedOutputCrossEntropy._keep_for_backward(
            ctx, gradient, weight_sum, hidden, weight, smoothing, loss_sum, nll_sum, correct
        )

    @staticmethod
    def backward(ctx, grad_loss, grad_nll, grad_correct):
        if ctx.mode == "none":
            raise RuntimeError("the output loss was computed with gradient_wanted=False: no backward pass")
        hidden_dtype, weight_dtype = ctx.dtypes
        scale = grad_loss.float()
        saved = ctx.saved_tensors
        if ctx.uniform:  # the -ε/V at every logit, through each matmul
            *saved, weight_sum, hidden_sum = saved
        grad_hidden, grad_weight = _LogitGradient.products(ctx.mode, tuple(saved), scale)  # (N, D), (V, D)
        if ctx.uniform:
            grad_hidden -= (scale * ctx.uniform) * weight_sum
            grad_weight -= (scale * ctx.uniform) * hidden_sum
        return grad_hidden.to(hidden_dtype), grad_weight.to(weight_dtype), None, None, None, None, None


def output_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, smoothing: float, rdrop: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (N, D), output weight (V, D), target (N,) -> (summed smoothed loss, summed NLL, the number
    of targets predicted: those no other token is more probable than).

    rdrop > 0: the rows are two dropout passes over the same N/2 tokens, and the loss adds R-Drop's
    consistency term (`_FusedOutputCrossEntropy._forward_rdrop`).

    Matmuls run in the autocast dtype when autocast is on; the softmax is always float32.
    The NLL and the count are for logging and carry no gradient.

    Not for torch.compile to trace: its loop over chunks of rows specialises a graph on the batch's
    token count, one compilation per batch size until dynamo gives up (seen on an H100: minutes of
    compiling, then recompile_limit). trainer.compile compiles the layers only (`model.compile_layers`);
    code that compiles a caller wraps this in `torch.compiler.disable` (not done here: it would load
    torch._dynamo, a second of start-up, in every command).
    """
    compute_dtype = autocast_dtype(hidden.device.type) or hidden.dtype
    gradient_wanted = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss, nll, correct = _FusedOutputCrossEntropy.apply(
        hidden, weight, target, smoothing, rdrop, compute_dtype, gradient_wanted
    )
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


def rdrop_cross_entropy_reference(hidden, weight, target, smoothing, rdrop):
    """R-Drop's loss with plain autograd ops: the label-smoothed loss of every row plus rdrop / 2 x the
    symmetric KL divergence between the distributions of row i and row N/2 + i."""
    loss, nll, correct = output_cross_entropy_reference(hidden, weight, target, smoothing)
    logp, logq = F.log_softmax((hidden @ weight.t()).float(), dim=-1).chunk(2)  # (N/2, V) each
    symmetric_kl = (
        F.kl_div(logq, logp, log_target=True, reduction="sum")  # KL(p || q)
        + F.kl_div(logp, logq, log_target=True, reduction="sum")
    )  # KL(q || p)
    return loss + rdrop / 2 * symmetric_kl, nll, correct


# ----- the loss of a batch, as training and validation compute it ----------------------------------


def batch_loss(model, batch, smoothing: float, rdrop: float = 0.0):
    """(summed label-smoothed loss, summed NLL, correct predictions) of one batch; logits only at real
    target positions. rdrop > 0: `batch` is `Batch.twice()` of one, and the loss is R-Drop's.

    `model` may be wrapped (DDP, torch.compile): its forward runs, so wrappers see the whole graph.
    """
    hidden, target = target_hidden(model, batch)
    return output_cross_entropy(hidden, unwrap(model).output.weight, target, smoothing, rdrop)


def target_hidden(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states (N, D), target ids (N,)) at the batch's N real target positions."""
    hidden = model(batch.src, batch.tgt_in, return_hidden=True)  # (B, T, D)
    positions = batch.target_positions()  # (N,) into B * T
    hidden = hidden.flatten(0, 1).index_select(0, positions)  # (N, D)
    target = batch.tgt_out.flatten().index_select(0, positions)  # (N,)
    return hidden, target


def unwrap(model):
    """The Transformer inside a torch.compile and/or DistributedDataParallel wrapper."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)
