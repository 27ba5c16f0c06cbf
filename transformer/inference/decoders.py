"""What search decodes through: `StepDecoder` (`step(tokens) -> log-probabilities of the next token`,
`select(rows, sentences)` to follow the surviving hypotheses), `ModelDecoder` for any `EncoderDecoder` (over
the key/value cache, or recomputing the prefix for comparison), `EnsembleDecoder` for several models at
once (the weighted mean of their log-probabilities), and the `Hypothesis` search returns. Shapes as in
attention.py's legend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from transformer.attention import padding_mask
from transformer.config import normalised_weights
from transformer.special import PAD_ID


@dataclass
class Hypothesis:
    tokens: list[int]  # without BOS and EOS
    score: float  # log-probability / length penalty (what the beam ranks by)
    logprob: float  # total log-probability, EOS included
    hit_max_len: bool = False
    text: str = ""  # detokenized (filled in by `Translator`)


class EncoderDecoder(Protocol):
    """What decoding needs of a model (`transformer.model.Transformer` is one)."""

    cfg: object  # .max_positions
    training: bool

    def encode(self, src: torch.Tensor) -> torch.Tensor: ...  # (B, S) -> (B, S, D)

    def decode(self, tgt_in: torch.Tensor, memory, src_pad_mask, cache=None) -> torch.Tensor: ...  # (B, T, V)

    def decode_step(self, tokens: torch.Tensor, cache) -> torch.Tensor: ...  # (B, t) -> (B, V)

    def new_cache(self, memory: torch.Tensor, src_pad_mask: torch.Tensor): ...

    def train(self, mode: bool = True): ...


@runtime_checkable
class StepDecoder(Protocol):
    """One decoding step at a time over a batch of hypothesis rows."""

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (rows, t) -> float32 log-probabilities (rows, V) of token t+1."""

    def select(self, rows: torch.Tensor, sentences: torch.Tensor | None = None) -> None:
        """Continue with hypothesis rows `rows`; if given, keep only sentence rows `sentences`."""


@runtime_checkable
class LogitsDecoder(StepDecoder, Protocol):
    """A StepDecoder that also hands out raw logits, so that search takes log-probabilities in blocks."""

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (rows, t) -> logits (rows, V) of token t+1."""


class ModelDecoder:
    """Runs the Transformer decoder one step at a time for `search`. `start`: the id the decoder reads
    first in place of BOS (a target-language tag), or a (B,) tensor of one per sentence (with the key/value
    cache, which reads it once); `never`: ids [first, end) given no probability."""

    def __init__(
        self,
        model: EncoderDecoder,
        src: torch.Tensor,
        use_cache: bool = True,
        start: int | torch.Tensor | None = None,
        never: tuple[int, int] | None = None,
    ):
        if isinstance(start, torch.Tensor) and not use_cache:
            raise ValueError("a start id per sentence needs the key/value cache (use_cache=True)")
        self.model, self.start, self.never = model, start, never
        memory = model.encode(src)  # (B, S, D)
        src_pad_mask = padding_mask(src, PAD_ID)  # (B, S)
        self.cache = model.new_cache(memory, src_pad_mask) if use_cache else None
        self.memory, self.src_pad_mask = memory, src_pad_mask

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (rows, t) -> logits (rows, V) of token t+1, in the model's compute dtype."""
        if self.start is not None and (self.cache is None or tokens.size(1) == 1):  # BOS is read: the tag instead
            tokens = tokens.clone()
            tokens[:, 0] = self.start
        if self.cache is not None:
            logits = self.model.decode_step(tokens, self.cache)
        else:  # recompute the whole prefix: the slow reference for tests and benchmarks
            logits = self.model.decode(tokens, self.memory, self.src_pad_mask)[:, -1]
        if self.never is not None:
            logits[:, self.never[0] : self.never[1]] = float("-inf")  # a fill on the device
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (rows, t) -> log-probabilities (rows, V) of token t+1, in float32."""
        return torch.log_softmax(self.logits(tokens), dim=-1, dtype=torch.float32)

    def select(self, rows: torch.Tensor, sentences: torch.Tensor | None = None) -> None:
        """Continue with hypothesis rows `rows`; if given, keep only sentence rows `sentences`."""
        if self.cache is not None:
            self.cache.reorder_hypotheses(rows)
            if sentences is not None:
                self.cache.keep_sentences(sentences)
        elif sentences is not None:
            self.memory = self.memory.index_select(0, sentences)
            self.src_pad_mask = self.src_pad_mask.index_select(0, sentences)


class EnsembleDecoder:
    """Several decoders over the same vocabulary, stepping together: the next-token log-probabilities are
    the weighted mean of theirs (`weights` normalised to sum to 1), each model with its own encoder
    output and cache, all following the same hypotheses."""

    def __init__(self, decoders: list[StepDecoder], weights: list[float] | None = None):
        weights = [1.0] * len(decoders) if weights is None else list(weights)
        if not decoders or len(weights) != len(decoders):
            raise ValueError(f"an ensemble needs one weight per model ({len(decoders)} models, {len(weights)} weights)")
        self.decoders, self.weights = decoders, normalised_weights(weights)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (rows, t) -> the weighted mean of the models' float32 log-probabilities (rows, V)."""
        mean = None
        for weight, decoder in zip(self.weights, self.decoders):
            logprobs = decoder.step(tokens)  # (rows, V) float32
            mean = logprobs.mul_(weight) if mean is None else mean.add_(logprobs, alpha=weight)
        return mean

    def select(self, rows: torch.Tensor, sentences: torch.Tensor | None = None) -> None:
        for decoder in self.decoders:
            decoder.select(rows, sentences)
