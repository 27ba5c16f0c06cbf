"""Random sampling instead of search (`Sampling`): top-k, nucleus (top-p) and temperature, from a
generator of its own seed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from transformer.inference.decoders import (  # noqa: F401  (Hypothesis and the decoders: imported from here too)
    EncoderDecoder,
    EnsembleDecoder,
    Hypothesis,
    LogitsDecoder,
    ModelDecoder,
    StepDecoder,
)


@dataclass
class Sampling:
    """Random sampling instead of search (back-translation, Edunov et al. 2018): each token is drawn from
    the `top_k` most probable ones (0: all), or from the smallest set whose probability reaches `top_p`
    (nucleus sampling; 1.0: all), after dividing the log-probabilities by `temperature`. The object
    keeps a generator seeded with `seed`: a new Sampling of the same seed gives the same input the same
    samples, and one object used again continues its random stream (the chunks of a long input are not
    sampled alike; for a repeatable call, pass a new Sampling). Hypothesis scores stay the model's own
    log-probabilities of the drawn tokens (untempered)."""

    top_k: int = 0
    top_p: float = 1.0
    temperature: float = 1.0
    seed: int = 1

    def __post_init__(self):
        if self.top_k < 0 or not 0.0 < self.top_p <= 1.0 or not 0.0 < self.temperature < math.inf:
            raise ValueError(f"sampling needs top_k >= 0, 0 < top_p <= 1 and a finite temperature > 0 (got {self})")
        self._generators: dict = {}

    def __call__(self, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logprobs (n, V) float32 -> drawn tokens (n,) and their log-probabilities (n,)."""
        scores = logprobs / self.temperature
        if self.top_k and self.top_k < scores.size(1):
            kth = scores.topk(self.top_k, dim=1).values[:, -1:]  # (n, 1)
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            ordered, order = scores.sort(dim=1, descending=True)  # (n, V)
            probs = ordered.softmax(dim=1)
            outside = probs.cumsum(dim=1) - probs >= self.top_p  # the first token always stays
            scores = scores.scatter(1, order, ordered.masked_fill(outside, float("-inf")))
        generator = self._generators.get(scores.device)
        if generator is None:
            generator = self._generators[scores.device] = torch.Generator(scores.device).manual_seed(self.seed)
        tokens = torch.multinomial(scores.softmax(dim=1), 1, generator=generator).squeeze(1)
        return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)
