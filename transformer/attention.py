"""Multi-head attention, its masks and its key/value cache: the only place masks are built.

Shape legend (the model's, search's and the loss's too): B batch (sentences, or sentences x beams),
S source length, T target length, H heads, D model dim, Dh = D / H head dim, K beam size, V vocabulary.
Boolean "allowed" masks are True where a query may attend to a key (the convention of
`F.scaled_dot_product_attention`); padding masks are True where a token is padding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from transformer.config import ATTENTION_BACKENDS

# ---------------------------------------------------------------------------------------------------
# Masks


def padding_mask(ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, L) ids -> (B, L) bool, True at padding."""
    return ids.eq(pad_id)


def key_padding_allowed(key_pad_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) padding mask -> (B, 1, 1, S) allowed mask, broadcast over heads and queries."""
    return (~key_pad_mask)[:, None, None, :]


def causal_allowed(query_len: int, key_len: int, device: torch.device) -> torch.Tensor:
    """(Tq, Tk) bool: query i sits at absolute position key_len - query_len + i and may see keys up to it.

    SDPA's own `is_causal=True` aligns the triangle to the top-left corner, which is only right when
    Tq == Tk; with a cache of past keys (Tk > Tq) the triangle must be aligned to the bottom-right.
    """
    offset = key_len - query_len
    query_pos = torch.arange(query_len, device=device)[:, None] + offset
    return torch.arange(key_len, device=device)[None, :] <= query_pos


def with_causal(allowed: torch.Tensor | None, query_len: int, key_len: int, device: torch.device) -> torch.Tensor:
    """`allowed` (or nothing) combined with the bottom-right-aligned causal mask of `causal_allowed`."""
    causal_mask = causal_allowed(query_len, key_len, device)
    return causal_mask if allowed is None else allowed & causal_mask


# ---------------------------------------------------------------------------------------------------
# The formula


def attention_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None = None, dropout_p: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q Kᵀ / √Dh) V, written out; the reference the fast kernel is tested against.

    q (B, H, Tq, Dh), k/v (B, H, Tk, Dh), allowed broadcastable to (B, H, Tq, Tk).
    Returns the output (B, H, Tq, Dh) and the attention weights (B, H, Tq, Tk).
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, Tq, Tk)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = scores.softmax(dim=-1)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v, weights


# `model.attention`: which implementation computes attention.
#   auto    on a CPU, SDPA in float32 without attention dropout (its fused flash kernel), else two batched
#           matmuls; on a GPU, SDPA limited to its flash, memory-efficient and math kernels (cuDNN's
#           kernel builds a graph per new shape, and NMT batches change shape every step)
#   sdpa    F.scaled_dot_product_attention with whichever kernel PyTorch picks
#   matmul  two batched matmuls in the input dtype, the softmax in float32 (`matmul_attention`)
#   math    `attention_math`, the reference formula (slow; for checks)
BACKENDS = ATTENTION_BACKENDS


def gpu_sdpa_kernels() -> list:
    """The SDPA kernels `auto` allows on a GPU: all but cuDNN's."""
    from torch.nn.attention import SDPBackend

    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention by `backend` (see BACKENDS): (output (B, H, Tq, Dh), weights or None).

    `need_weights` always takes the reference formula, whose weights it returns. `causal=True` is only
    passed when Tq == Tk, where SDPA's top-left alignment is correct and lets it pick a flash kernel
    without materialising a mask; the other backends get the mask instead.
    """
    if need_weights:
        backend = "math"
    elif backend == "auto":
        backend = "sdpa_gpu" if q.device.type != "cpu" else cpu_backend(q.dtype, dropout_p, q.size(-2), k.size(-2))
    if causal and backend in ("math", "matmul"):  # only SDPA takes `is_causal`
        allowed, causal = with_causal(allowed, q.size(-2), k.size(-2), q.device), False
    if backend == "math":
        out, weights = attention_math(q, k, v, allowed, dropout_p)
        return out, (weights if need_weights else None)
    if backend == "matmul":
        return matmul_attention(q, k, v, allowed, dropout_p), None
    if backend == "sdpa_gpu":
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(gpu_sdpa_kernels()):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, dropout_p=dropout_p, is_causal=causal
            ), None
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p, is_causal=causal), None
    raise ValueError(f"unknown attention backend {backend!r}; one of {', '.join(BACKENDS)}")


# Keys from which one query (a decoding step) is attended faster by the matmuls than by SDPA's float32
# CPU kernel: one thread, 500 rows x 4 heads x 64: 0.63x SDPA's time at 16 keys, 0.67x at 24, 0.84-0.95x
# at 8-12; at 2-6 keys SDPA is 1.4-2.3x faster.
CPU_ONE_QUERY_MATMUL_KEYS = 8


def cpu_backend(dtype: torch.dtype, dropout_p: float, queries: int, keys: int) -> str:
    """What `auto` runs on a CPU. In float32 SDPA's flash kernel is the faster for training (model=small
    trains about 4% more tokens/s) and for one query over a few keys; one query over
    `CPU_ONE_QUERY_MATMUL_KEYS` or more (decoding with a cache) takes the matmuls. In bfloat16 SDPA is
    far slower than the matmuls (0.65x the training tokens/s), and with attention dropout it falls back
    to its unfused math on a CPU."""
    if dtype != torch.float32 or dropout_p > 0.0:
        return "matmul"
    return "matmul" if queries == 1 and keys >= CPU_ONE_QUERY_MATMUL_KEYS else "sdpa"


def matmul_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None = None, dropout_p: float = 0.0
) -> torch.Tensor:
    """Attention as two batched matmuls in the input dtype, the softmax in float32 (`auto` on CPUs
    in bf16/fp16 or with attention dropout).

    At NMT shapes (a few dozen keys) PyTorch's CPU flash kernel is slower in bf16: bf16 training gets
    about 1.5x the tokens/s of SDPA from this path, and in decoding, one query per row, the bf16 kernel
    is 1.5-4x slower than these matmuls. In float32 the kernel is the faster (`cpu_backend`).
    """
    scores = (q * (1.0 / math.sqrt(q.size(-1)))) @ k.transpose(-2, -1)  # (B, H, Tq, Tk)
    if allowed is not None:  # in place: the matmul's backward needs q and k, not its output
        scores.masked_fill_(~allowed, float("-inf"))
    weights = scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v  # (B, H, Tq, Dh)


# ---------------------------------------------------------------------------------------------------
# The module


class MultiHeadAttention(nn.Module):
    """One module for the three uses: encoder self-attention, causal decoder self-attention (with a
    growing key/value cache) and encoder-decoder attention (keys/values of the memory computed once).

    Self-attention projects Q, K, V with one (D, 3D) matmul; cross-attention projects K, V of the
    memory with one (D, 2D) matmul.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, cross: bool = False, backend: str = "auto"):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"attention backend {backend!r}: one of {', '.join(BACKENDS)}")
        self.backend = backend
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.dropout = dropout
        self.cross = cross
        if cross:
            self.q_proj = nn.Linear(d_model, d_model)
            self.kv_proj = nn.Linear(d_model, 2 * d_model)
        else:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.need_weights = False  # set by tools that draw attention maps
        self.last_weights: torch.Tensor | None = None

    def _heads(self, x: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
        """(B, L, parts * D) -> parts x (B, H, L, Dh), views. Split with `chunk`, whose backward writes
        the parts' gradients into the (B, L, parts * D) layout in one copy (`unbind` would stack them first)."""
        batch, length, _ = x.shape
        return tuple(
            part.view(batch, length, self.n_heads, self.head_dim).transpose(1, 2) for part in x.chunk(parts, dim=-1)
        )

    def project_memory(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder output (B, S, D) -> keys, values (B, H, S, Dh), computed once per source."""
        return self._heads(self.kv_proj(memory), 2)

    def forward(
        self,
        x: torch.Tensor,
        *,
        memory: torch.Tensor | None = None,
        memory_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_pad_mask: torch.Tensor | None = None,
        key_allowed: torch.Tensor | None = None,
        causal: bool = False,
        cache: SelfAttentionCache | None = None,
    ) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D).

        Self-attention: keys are x (plus the past positions in `cache`, which this call extends).
        Cross-attention: keys are `memory` or its precomputed `memory_kv`. If x has K times the rows of
        the memory (K beams per sentence), the beams are folded into the query axis, so one copy of the
        memory keys serves every beam. `key_allowed`, instead of `key_pad_mask`: its
        `key_padding_allowed`, made once by the caller for every layer (and, decoding, every step).
        """
        batch, length, d_model = x.shape
        dropout_p = self.dropout if self.training else 0.0
        allowed = key_allowed
        if allowed is None and key_pad_mask is not None:
            allowed = key_padding_allowed(key_pad_mask)
        if self.cross:
            (q,) = self._heads(self.q_proj(x), 1)  # (B, H, T, Dh)
            k, v = memory_kv if memory_kv is not None else self.project_memory(memory)
            beams = batch // k.size(0)
            if beams > 1:  # (n*K, H, T, Dh) -> (n, H, K*T, Dh)
                q = q.view(k.size(0), beams, self.n_heads, length, self.head_dim)
                q = q.permute(0, 2, 1, 3, 4).reshape(k.size(0), self.n_heads, beams * length, self.head_dim)
            out, weights = attend(
                q, k, v, allowed, dropout_p=dropout_p, need_weights=self.need_weights, backend=self.backend
            )
            if beams > 1:  # (n, H, K*T, Dh) -> (n*K, H, T, Dh)
                out = out.view(k.size(0), self.n_heads, beams, length, self.head_dim)
                out = out.permute(0, 2, 1, 3, 4).reshape(batch, self.n_heads, length, self.head_dim)
        else:
            q, k, v = self._heads(self.qkv_proj(x), 3)  # 3 x (B, H, T, Dh)
            if cache is not None:
                k, v = cache.append(k, v)  # (B, H, past + T, Dh)
            past = k.size(2) - length
            if causal and past > 0:
                # A single new query may see every cached key: no mask at all. Several new queries
                # after a past need the bottom-right-aligned triangle.
                if length > 1:
                    allowed = with_causal(allowed, length, k.size(2), x.device)
                causal = False
            elif causal and allowed is not None:
                allowed, causal = with_causal(allowed, length, k.size(2), x.device), False
            out, weights = attend(
                q,
                k,
                v,
                allowed,
                causal=causal,
                dropout_p=dropout_p,
                need_weights=self.need_weights,
                backend=self.backend,
            )
        self.last_weights = weights
        out = out.transpose(1, 2).reshape(batch, length, d_model)  # (B, T, D)
        return self.out_proj(out)


class SelfAttentionCache:
    """One decoder layer's self-attention keys and values of the positions decoded so far.

    Reordering hypotheses is lazy: `reorder` only records which rows survive, and the next `append`
    gathers them while it copies the past into a tensor with room for the new positions. So a beam
    search step copies the cache once, not twice (concatenate, then reorder), and attention always
    reads contiguous keys and values (PyTorch's bf16 batched matmul copies strided ones first).
    """

    def __init__(self):
        self.keys: torch.Tensor | None = None  # (B, H, length, Dh)
        self.values: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None  # pending reorder of the B axis

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.size(2)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add k, v (B, H, T, Dh) of T new positions; returns every position's keys, values (B, H, past + T, Dh)."""
        if self.keys is None:
            self.keys, self.values = k.contiguous(), v.contiguous()
            return self.keys, self.values
        past = self.length
        self.keys, self.values = (self._extend(old, new, past) for old, new in ((self.keys, k), (self.values, v)))
        self.rows = None
        return self.keys, self.values

    def _extend(self, old: torch.Tensor, new: torch.Tensor, past: int) -> torch.Tensor:
        if self.rows is None:  # the same rows: one operator (greedy's every step)
            return torch.cat((old, new), dim=2)
        rows, heads, length, head_dim = new.shape
        out = torch.empty(rows, heads, past + length, head_dim, dtype=old.dtype, device=old.device)
        if old.device.type == "cpu":  # gathers straight into place
            torch.index_select(old, 0, self.rows, out=out[:, :, :past])
        else:  # the plainly supported form: a temporary, then a copy
            out[:, :, :past] = old.index_select(0, self.rows)
        out[:, :, past:] = new
        return out

    def reorder(self, rows: torch.Tensor) -> None:
        """Keep hypothesis rows `rows` (a LongTensor over the row axis), in that order."""
        if self.keys is not None:
            self.rows = rows if self.rows is None else self.rows.index_select(0, rows)


class DecoderCache:
    """Per-layer decoder state for incremental decoding.

    `self_kv[i]` holds layer i's self-attention keys/values of the positions decoded so far, one row
    per hypothesis (B*K rows); `memory_kv[i]` holds its encoder-decoder keys/values, one row per
    sentence (B rows), shared by all beams of that sentence. `memory_allowed` (B, 1, 1, S) is which
    memory positions every layer's cross-attention may see at every step (made once from the padding).
    """

    def __init__(self, memory_kv: list[tuple[torch.Tensor, torch.Tensor]], src_pad_mask: torch.Tensor):
        # Contiguous: the projection's head split leaves strides that would make every step copy them.
        self.memory_kv = [(k.contiguous(), v.contiguous()) for k, v in memory_kv]
        self.memory_allowed = key_padding_allowed(src_pad_mask)
        self.self_kv = [SelfAttentionCache() for _ in memory_kv]

    @property
    def length(self) -> int:
        return self.self_kv[0].length if self.self_kv else 0

    def reorder_hypotheses(self, rows: torch.Tensor) -> None:
        """Keep hypothesis rows `rows` (a LongTensor over the B*K axis), in that order."""
        for layer in self.self_kv:
            layer.reorder(rows)

    def keep_sentences(self, sentences: torch.Tensor) -> None:
        """Drop finished sentences from the shared memory keys/values (B axis)."""
        self.memory_kv = [(k.index_select(0, sentences), v.index_select(0, sentences)) for k, v in self.memory_kv]
        self.memory_allowed = self.memory_allowed.index_select(0, sentences)
