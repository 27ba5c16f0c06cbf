"""One optimizer update (`TrainingStep`): AMP, accumulation over micro-batches, R-Drop, DDP's gradient
all-reduce, clipping, a non-finite step skipped on the device, an out-of-memory batch skipped (a few in a
row stop the run). It reads no tensor back to the host: what it returns (`StepResult`) stays on the device
until the log (`TrainLog`) reads it at a log step."""

from __future__ import annotations

import contextlib
import gc
import logging

import torch
from torch.nn.parallel import DistributedDataParallel

from transformer.config import TrainerConfig
from transformer.errors import TrainingError
from transformer.loss import batch_loss
from transformer.model import compile_layers
from transformer.runtime import Runtime
from transformer.training.state import TrainingState
from transformer.training.step_log import StepResult, TrainLog

log = logging.getLogger("transformer.train")

# Consecutive out-of-memory batches after which training stops (trainer.max_tokens is too large).
OOM_SKIP_LIMIT = 5


class TrainingStep:
    """The update of `state`'s model with its optimizer, schedule and loss scaler, on `runtime`'s device,
    compiled (trainer.compile) and wrapped in DDP under torchrun; `log` sums each update's numbers."""

    def __init__(self, tc: TrainerConfig, state: TrainingState, runtime: Runtime, log_: TrainLog):
        self.tc, self.state, self.runtime, self.log = tc, state, runtime, log_
        self.oom_skips = self.oom_in_a_row = 0
        model = state.model
        if tc.compile:
            compile_layers(model)
        self.train_model = model
        if runtime.dist.enabled:
            # No buffer changes during training (the sinusoid table is a constant): nothing to broadcast.
            self.train_model = DistributedDataParallel(
                model,
                device_ids=[runtime.device.index] if runtime.device.type == "cuda" else None,
                broadcast_buffers=False,
            )

    def __call__(self, micro_batches) -> StepResult:
        """One optimizer update over `micro_batches` ((batch, weight) pairs).

        Reads no tensor value on the host, so a GPU never waits for Python. A non-finite step is skipped
        on the device: the fused AdamW takes a `found_inf` flag (the fp16 GradScaler sets the same flag)
        and leaves weights and moments alone.
        """
        tc, runtime, device = self.tc, self.runtime, self.runtime.device
        optimizer, scaler = self.state.optimizer, self.state.scaler
        passes = 2 if tc.rdrop else 1  # R-Drop: every batch twice
        tokens = passes * sum(b.num_tgt_tokens * w for b, w in micro_batches)  # host ints counted by collate
        # The normaliser: every rank's target tokens. Under DDP an all-reduce on the device, not read back.
        # torch.full fills on the device; torch.tensor(x, device="cuda") would copy from the host and sync.
        global_tokens = (
            runtime.all_reduce(torch.full((), float(tokens), device=device)) if runtime.dist.enabled else float(tokens)
        )
        loss_sum = nll_sum = correct_sum = torch.zeros((), device=device)
        for i, (batch, weight) in enumerate(micro_batches):
            batch = batch.to(device, non_blocking=True)
            if tc.rdrop:
                batch = batch.twice()
            last = i == len(micro_batches) - 1
            sync = self.train_model.no_sync() if runtime.dist.enabled and not last else contextlib.nullcontext()
            try:
                with sync:
                    with runtime.autocast():
                        loss, nll, correct = batch_loss(self.train_model, batch, tc.label_smoothing, tc.rdrop)
                    # DDP averages gradients over ranks; scale by world size so the update is
                    # sum(loss over all ranks' tokens) / global target tokens.
                    scaled = loss * (weight * runtime.dist.world_size / global_tokens)
                    scaler.scale(scaled).backward()
                out_of_memory = False
            except torch.cuda.OutOfMemoryError:
                # Under DDP the other ranks are already waiting in the all-reduce: skipping here
                # would hang them, so the error stops the job instead.
                if runtime.dist.enabled:
                    raise
                out_of_memory = True
            if out_of_memory:
                # Outside the `except` block: its traceback, which held the forward's activations, is gone.
                return self._skip_out_of_memory(batch)
            loss_sum = loss_sum + loss.detach() * weight
            nll_sum = nll_sum + nll * weight
            correct_sum = correct_sum + correct * weight
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.state.model.parameters(), tc.clip_norm or float("inf"))
        finite = torch.isfinite(grad_norm) & torch.isfinite(loss_sum)  # () bool
        if scaler.is_enabled():
            scaler.step(optimizer)  # passes its own found_inf to the fused AdamW
            scaler.update()
        else:
            optimizer.found_inf = (~finite).float()
            optimizer.step()
            del optimizer.found_inf
        self.state.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        sums = torch.stack([loss_sum, nll_sum, correct_sum])  # (3,)
        if runtime.dist.enabled:
            sums = runtime.all_reduce(sums)
        self.oom_in_a_row = 0
        return StepResult(sums, grad_norm.detach(), finite, global_tokens)

    def _skip_out_of_memory(self, batch) -> StepResult:
        """Drop the update whose batch ran out of GPU memory; after OOM_SKIP_LIMIT in a row, stop."""
        self.oom_skips += 1
        self.oom_in_a_row += 1
        shape = (
            f"{batch.src.size(0)} sentences, source {batch.src.size(1)} and target "
            f"{batch.tgt_in.size(1)} tokens wide" + (" (the batch twice, for trainer.rdrop)" if self.tc.rdrop else "")
        )
        del batch
        self.state.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.runtime.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.oom_in_a_row >= OOM_SKIP_LIMIT:
            raise TrainingError(
                f"out of memory on {self.oom_in_a_row} batches in a row (the last: {shape}): "
                f"trainer.max_tokens={self.tc.max_tokens} is too large for this device; lower it "
                f"(e.g. trainer.max_tokens={self.tc.max_tokens // 2}) and raise trainer.update_freq "
                "to keep the batch size"
            )
        log.warning(
            "out of memory on a batch of %s: skipped; lower trainer.max_tokens or data.max_len if this repeats", shape
        )
        return StepResult(out_of_memory=True)
