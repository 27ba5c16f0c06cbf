"""Where a run stands, the part of its state that is neither weights nor optimizer nor random streams:
how far it got (step, epoch, position in the epoch), the best validation score and the patience
count behind early stopping, and the validation history. It resumes with the run (a checkpoint's
`data_state` and `metrics` entries) and is what `train()` returns.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch


@dataclass
class Progress:
    step: int = 0  # optimizer updates done
    epoch: int = 0
    position: int = 0  # micro-batches of this epoch already consumed (this rank's share)
    best_bleu: float = -1.0  # best validation BLEU so far (-1: no validation yet)
    best_step: int | None = None
    best_weights: str | None = None  # which weights scored best_bleu: raw, ema, or an average of checkpoints
    bad_validations: int = 0  # validations since the last improvement (trainer.patience)
    val_history: list[dict] = field(default_factory=list)
    train_tokens_per_s: float | None = None  # of the last log window
    stop_reason: str | None = None

    def record_validation(self, result: dict) -> bool:
        """Add a validation result (loss, bleu, ...); True if its BLEU is the best so far."""
        self.val_history.append({"step": self.step, **result})
        if result["bleu"] > self.best_bleu:
            self.best_bleu, self.best_step, self.bad_validations = result["bleu"], self.step, 0
            self.best_weights = result.get("weights", "raw")
            return True
        self.bad_validations += 1
        return False

    # -- checkpoints ---------------------------------------------------------------------------------

    def data_state(self, world_size: int, batching: dict) -> dict:
        return {"epoch": self.epoch, "position": self.position, "world_size": world_size, "batching": batching}

    def metrics(self) -> dict:
        """The checkpoint's `metrics` entry; also what training returns (with the test scores added)."""
        last = {f"val_{k}": v for k, v in self.val_history[-1].items() if k != "step"} if self.val_history else {}
        values = {
            **last,
            "val_history": self.val_history,
            "best_bleu": self.best_bleu,
            "best_step": self.best_step,
            "best_weights": self.best_weights,
            "bad_validations": self.bad_validations,
            "train_tokens_per_s": self.train_tokens_per_s,
            "stop_reason": self.stop_reason,
        }
        return {k: v for k, v in values.items() if v is not None}

    @classmethod
    def from_checkpoint(cls, state: dict) -> Progress:
        metrics, data_state = state.get("metrics", {}), state["data_state"]
        return cls(
            step=state["step"],
            epoch=data_state["epoch"],
            position=data_state["position"],
            best_bleu=metrics.get("best_bleu", -1.0),
            best_step=metrics.get("best_step"),
            best_weights=metrics.get("best_weights"),
            bad_validations=metrics.get("bad_validations", 0),
            val_history=list(metrics.get("val_history", [])),
            train_tokens_per_s=metrics.get("train_tokens_per_s"),
        )


def rng_state(device: torch.device) -> dict:
    """This process's random number generator states (torch, Python, CUDA)."""
    return {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def restore_rng_state(rng: dict, device: torch.device) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate((3, tuple(rng["python"]), None))
    if rng.get("cuda") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)
