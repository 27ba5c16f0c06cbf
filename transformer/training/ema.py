"""Weight averaging: an exponential moving average kept during training (`trainer.ema_decay`), and
swapping another set of weights into the model for a while (validating the EMA or an average of
checkpoints with the model that trains)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class ExponentialMovingAverage:
    """After update t: ema <- ema + (1 - d_t) * (weights - ema), with d_t = min(decay, (1 + t) / (warmup + t)).

    The warm-up of d_t keeps the first updates from being dominated by the initial weights (a decay of
    0.999 would otherwise remember them for thousands of steps): until d_t reaches `decay`, at step
    (warmup * decay - 1) / (1 - decay), the average covers about the last t / (warmup - 1) updates.
    The average is float32 on the model's device and is updated there without reading anything back
    to the host. Tied parameters are averaged once.
    """

    def __init__(self, model: nn.Module, decay: float, warmup: float = 10.0):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay {decay} must be in (0, 1)")
        if not warmup > 1.0:
            raise ValueError(f"EMA warm-up {warmup} must be above 1")
        self.decay, self.warmup = decay, warmup
        named = list(model.named_parameters())  # a tied parameter appears once
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.average = [p.detach().float().clone() for p in self.params]
        # Every state_dict key that is a parameter (tied ones under each of their names) -> its index.
        index = {id(p): i for i, p in enumerate(self.params)}
        self._state_keys = {key: index[id(p)] for key, p in model.named_parameters(remove_duplicate=False)}

    def decay_at(self, step: int) -> float:
        return min(self.decay, (1.0 + step) / (self.warmup + step))

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold in the weights after optimizer update number `step` (1 for the first)."""
        # Under no_grad the parameters go in as they are: a detach of each was one operator per parameter every
        # step (198 for model=base: host time on a GPU, docs/benchmarks.md "Host cost").
        current = [p if p.dtype == torch.float32 else p.float() for p in self.params]
        torch._foreach_lerp_(self.average, current, 1.0 - self.decay_at(step))

    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """`model.state_dict()` with the averaged weights in place of the parameters."""
        return {
            key: (self.average[self._state_keys[key]].to(value.dtype) if key in self._state_keys else value)
            for key, value in model.state_dict().items()
        }

    def state_dict(self) -> dict:
        return {"decay": self.decay, "weights": dict(zip(self.names, self.average))}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        weights = state["weights"]
        if set(weights) != set(self.names):
            raise ValueError("the checkpoint's EMA weights do not fit this model")
        for name, average in zip(self.names, self.average):
            average.copy_(weights[name])


@contextlib.contextmanager
def weights_swapped(model: nn.Module, state: dict[str, torch.Tensor]):
    """Inside, `model` holds the weights of `state`; afterwards its own again, bit for bit."""
    own = {key: value.clone() for key, value in model.state_dict().items()}
    model.load_state_dict(state)
    try:
        yield model
    finally:
        model.load_state_dict(own)
