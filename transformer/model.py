"""The encoder-decoder Transformer of Vaswani et al. (2017), batch-first.

Shapes: src (B, S), tgt_in (B, T), hidden (B, L, D), logits (B, T, V).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from transformer.attention import (
    DecoderCache,
    MultiHeadAttention,
    SelfAttentionCache,
    key_padding_allowed,
    padding_mask,
)
from transformer.config import ModelConfig
from transformer.kernels import Dropout
from transformer.special import EOS_ID, PAD_ID


class SinusoidalPositions(nn.Module):
    """PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(...), precomputed up to max_positions."""

    def __init__(self, d_model: int, max_positions: int):
        super().__init__()
        position = torch.arange(max_positions, dtype=torch.float32)[:, None]
        frequency = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
        table = torch.zeros(max_positions, d_model)
        table[:, 0::2] = torch.sin(position * frequency)
        table[:, 1::2] = torch.cos(position * frequency)
        self.register_buffer("table", table, persistent=False)

    def forward(self, length: int, offset: int = 0) -> torch.Tensor:
        if offset + length > self.table.size(0):
            raise ValueError(
                f"sequence of {offset + length} positions exceeds model.max_positions={self.table.size(0)}"
            )
        return self.table[offset : offset + length]  # (L, D)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.up = nn.Linear(d_model, d_ff)
        self.down = nn.Linear(d_ff, d_model)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # dropout(relu(h)) == relu(dropout(h)) exactly (dropout multiplies by 0 or a positive scale), and
        # the in-place ReLU of dropout's output makes the tensor it saves for backward the one `down`
        # saves: one (B, L, d_ff) activation kept instead of two.
        return self.down(torch.relu_(self.dropout(self.up(x))))


class Sublayer(nn.Module):
    """Residual wrapper: x + dropout(f(norm(x))) for pre-norm, norm(x + dropout(f(x))) for post-norm."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool, residual: bool = True):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.pre_norm = pre_norm
        self.residual = residual  # false: dropout(f(norm(x))) or norm(dropout(f(x))), x not added

    def forward(self, x: torch.Tensor, fn) -> torch.Tensor:
        if not self.residual:
            return self.dropout(fn(self.norm(x))) if self.pre_norm else self.norm(self.dropout(fn(x)))
        if self.pre_norm:
            return self.dropout.add_to(x, fn(self.norm(x)))
        return self.norm(self.dropout.add_to(x, fn(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, attention_residual: bool = True):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, backend=cfg.attention)
        self.feed_forward = FeedForward(cfg.d_model, cfg.d_ff, cfg.dropout)
        self.sub_attn = Sublayer(cfg.d_model, cfg.dropout, cfg.pre_norm, residual=attention_residual)
        self.sub_ff = Sublayer(cfg.d_model, cfg.dropout, cfg.pre_norm)

    def forward(self, x: torch.Tensor, src_allowed: torch.Tensor) -> torch.Tensor:
        """x (B, S, D); src_allowed (B, 1, 1, S): the source positions that are not padding."""
        x = self.sub_attn(x, lambda h: self.self_attn(h, key_allowed=src_allowed))
        return self.sub_ff(x, self.feed_forward)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, backend=cfg.attention)
        self.cross_attn = MultiHeadAttention(
            cfg.d_model, cfg.n_heads, cfg.attention_dropout, cross=True, backend=cfg.attention
        )
        self.feed_forward = FeedForward(cfg.d_model, cfg.d_ff, cfg.dropout)
        self.sub_self = Sublayer(cfg.d_model, cfg.dropout, cfg.pre_norm)
        self.sub_cross = Sublayer(cfg.d_model, cfg.dropout, cfg.pre_norm)
        self.sub_ff = Sublayer(cfg.d_model, cfg.dropout, cfg.pre_norm)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor | None,
        memory_allowed: torch.Tensor,
        memory_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        self_cache: SelfAttentionCache | None = None,
    ) -> torch.Tensor:
        """x (B, T, D); memory_allowed (B, 1, 1, S): the memory positions that are not padding."""
        # Target padding sits after every real token, so the causal mask alone keeps real positions from
        # seeing it; padded positions are ignored by the loss.
        x = self.sub_self(x, lambda h: self.self_attn(h, causal=True, cache=self_cache))
        x = self.sub_cross(
            x, lambda h: self.cross_attn(h, memory=memory, memory_kv=memory_kv, key_allowed=memory_allowed)
        )
        return self.sub_ff(x, self.feed_forward)


class Transformer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        src_vocab_size: int,
        tgt_vocab_size: int,
        shared_vocab: bool,
        initialize: bool = True,
        protected_ids: int = EOS_ID + 1,
    ):
        super().__init__()
        self.cfg = cfg
        self.protected_ids = protected_ids  # word dropout never drops ids below (specials, language tags)
        self.tgt_embed = nn.Embedding(tgt_vocab_size, cfg.d_model, padding_idx=PAD_ID)
        share = shared_vocab and cfg.tie_embeddings
        self.src_embed = self.tgt_embed if share else nn.Embedding(src_vocab_size, cfg.d_model, padding_idx=PAD_ID)
        self.positions = SinusoidalPositions(cfg.d_model, cfg.max_positions)
        self.embed_dropout = Dropout(cfg.dropout)
        # model.residual_free_layer (1-based; 0 = none): that layer's self-attention adds no residual
        self.encoder_layers = nn.ModuleList(
            EncoderLayer(cfg, attention_residual=number != cfg.residual_free_layer)
            for number in range(1, cfg.encoder_layers + 1)
        )
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        # Pre-norm leaves the residual stream un-normalised; a final LayerNorm closes each stack.
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        self.output = nn.Linear(cfg.d_model, tgt_vocab_size, bias=False)
        if initialize:  # not for weights about to be loaded: half of building the model's time
            self._reset_parameters()
        if cfg.tie_embeddings:
            self.output.weight = self.tgt_embed.weight

    def _reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=self.cfg.d_model**-0.5)
                nn.init.zeros_(module.weight[PAD_ID])

    def _embed(
        self, embedding: nn.Embedding, ids: torch.Tensor, offset: int = 0, word_dropout: float = 0.0
    ) -> torch.Tensor:
        x = embedding(ids) * math.sqrt(self.cfg.d_model)  # (B, L, D)
        if word_dropout and self.training:
            x = x * self._word_keep(ids, word_dropout).to(x.dtype)
        return self.embed_dropout(x + self.positions(ids.size(1), offset))

    def _word_keep(self, ids: torch.Tensor, p: float) -> torch.Tensor:
        """Word dropout's factor per token, (B, L, 1): 0 for a dropped token, 1 / (1 - p) for a kept one
        (the expected embedding unchanged, as in inverted dropout), 1 for the ids it never drops."""
        kept = torch.rand(ids.shape, device=ids.device) >= p  # (B, L)
        factor = kept.float() / (1.0 - p)
        return torch.where(ids < self.protected_ids, 1.0, factor).unsqueeze(-1)

    def encode(self, src: torch.Tensor) -> torch.Tensor:
        """src (B, S) -> memory (B, S, D)."""
        src_allowed = key_padding_allowed(padding_mask(src, PAD_ID))  # (B, 1, 1, S), once for every layer
        x = self._embed(self.src_embed, src, word_dropout=self.cfg.src_word_dropout)
        for layer in self.encoder_layers:
            x = layer(x, src_allowed)
        return self.encoder_norm(x)

    def decode_hidden(
        self,
        tgt_in: torch.Tensor,
        memory: torch.Tensor | None,
        src_pad_mask: torch.Tensor,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        """tgt_in (B, T) -> decoder output (B, T, D). With a cache, tgt_in holds only the new positions."""
        offset = cache.length if cache is not None else 0
        x = self._embed(self.tgt_embed, tgt_in, offset, word_dropout=self.cfg.tgt_word_dropout)
        if cache is None:
            memory_allowed = key_padding_allowed(src_pad_mask)  # (B, 1, 1, S), once for every layer
        for i, layer in enumerate(self.decoder_layers):
            if cache is None:
                x = layer(x, memory, memory_allowed)
            else:  # .forward: eager even where trainer.compile compiled the layer (`compile_layers`)
                x = layer.forward(
                    x, None, cache.memory_allowed, memory_kv=cache.memory_kv[i], self_cache=cache.self_kv[i]
                )
        return self.decoder_norm(x)

    def decode(
        self,
        tgt_in: torch.Tensor,
        memory: torch.Tensor | None,
        src_pad_mask: torch.Tensor,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        """tgt_in (B, T) -> logits (B, T, V)."""
        return self.output(self.decode_hidden(tgt_in, memory, src_pad_mask, cache))

    def decode_step(self, tokens: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        """One incremental step: tokens (B, t) so far, the last one new -> logits (B, V) of token t+1, the
        cache holding the keys and values of the earlier ones (and the encoder's)."""
        return self.decode(tokens[:, -1:], None, None, cache)[:, -1]

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, return_hidden: bool = False) -> torch.Tensor:
        """src (B, S), tgt_in (B, T) -> logits (B, T, V), or the decoder output (B, T, D) if return_hidden."""
        memory = self.encode(src)
        hidden = self.decode_hidden(tgt_in, memory, padding_mask(src, PAD_ID))
        return hidden if return_hidden else self.output(hidden)

    def new_cache(self, memory: torch.Tensor, src_pad_mask: torch.Tensor) -> DecoderCache:
        """Project the memory once per decoder layer for incremental decoding."""
        memory_kv = [layer.cross_attn.project_memory(memory) for layer in self.decoder_layers]
        return DecoderCache(memory_kv, src_pad_mask)


def compile_layers(model: Transformer) -> None:
    """trainer.compile=true: torch.compile each encoder and decoder layer in place (regional compilation).

    The layers of a stack are one class, so they share one compiled graph (per mode and shape class),
    which compiles about four times faster than the whole model as one graph (99 s against 26 s for a
    6+6-layer model on a CPU; on an H100 the whole-model graph took 71 s before the first step). The
    embeddings and final norms stay eager, as does incremental decoding with a cache, which calls
    `DecoderLayer.forward` itself. Checkpoint keys are unchanged (no `_orig_mod.` wrapper).
    """
    for layer in (*model.encoder_layers, *model.decoder_layers):
        layer.compile(dynamic=True)


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Inside, `model` is in eval mode (no dropout); afterwards in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def build_model(
    cfg: ModelConfig,
    src_vocab_size: int,
    tgt_vocab_size: int,
    shared_vocab: bool,
    initialize: bool = True,
    protected_ids: int = EOS_ID + 1,
) -> Transformer:
    """The model; `initialize=False` leaves the weights as PyTorch's layers made them, for a caller that
    loads every one of them next (`load_model_weights` refuses a state dict that misses any).
    `protected_ids`: word dropout (model.src_word_dropout, tgt_word_dropout) keeps the ids below it
    (`Tokenizer.protected_ids`: the special tokens and language tags)."""
    return Transformer(cfg, src_vocab_size, tgt_vocab_size, shared_vocab, initialize, protected_ids)
