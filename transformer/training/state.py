"""A run's state between processes: what a training checkpoint holds and how a run saves it and resumes
from it (`TrainingState`). What a run starts from is resume.py's; the run directory's lock, log file and
signals are in run_dir.py, the RNG state in progress.py."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from transformer import distributed as D
from transformer.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_model_weights,
    non_finite_tensors,
    without_training_state,
)
from transformer.config import Config
from transformer.training.checkpoint_dir import CheckpointDirectory
from transformer.training.ema import ExponentialMovingAverage
from transformer.training.progress import Progress, restore_rng_state, rng_state
from transformer.training.run_dir import TrainingError

if TYPE_CHECKING:
    from transformer.data.tokenizer import Tokenizer


log = logging.getLogger("transformer.train")


class TrainingState:
    """What a training checkpoint holds and what resuming restores: the weights with the config and
    tokenizer that rebuild them, optimizer, learning-rate schedule and fp16 loss scaler, the moving
    average of the weights, where the run stands (`progress`), every rank's random streams and what the
    batch order depends on. `Trainer` builds the parts and hands them over; `progress` and `ema` are
    replaced when a checkpoint is loaded. `bad_in_a_row` reads how many steps in a row the loss has not
    been finite (for the message when the weights themselves are not)."""

    def __init__(
        self,
        cfg: Config,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        optimizer,
        scheduler,
        scaler: torch.amp.GradScaler,
        checkpoints: CheckpointDirectory,
        corpus_identity: str,
        dist: D.DistInfo,
        device: torch.device,
        bad_in_a_row: Callable[[], int] = lambda: 0,
    ):
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.checkpoints, self.corpus_identity = checkpoints, corpus_identity
        self.dist, self.device, self.bad_in_a_row = dist, device, bad_in_a_row
        self.ema = self._fresh_ema()
        self.progress = Progress()
        self.last_written: tuple[int, str] | None = None  # (step, metrics) of the newest last.pt written here

    def _fresh_ema(self) -> ExponentialMovingAverage | None:
        """An EMA of the model's weights as they are now, with the config's decay (None without one)."""
        tc = self.cfg.trainer
        return ExponentialMovingAverage(self.model, tc.ema_decay, tc.ema_warmup) if tc.ema_decay else None

    def batching(self) -> dict:
        """What the batch order depends on besides (seed, epoch): an exact resume needs all of it equal."""
        tc = self.cfg.trainer
        return {
            "corpus": self.corpus_identity,
            "max_len": self.cfg.data.max_len,
            "seed": tc.seed,
            "max_tokens": tc.max_tokens,
            "update_freq": tc.update_freq,
            "order": "width,src,tgt,random",
        }

    def state_dict(self) -> dict:
        """The checkpoint's entries. Every rank calls it: the random streams are gathered from all."""
        return {
            "model": self.model.state_dict(),
            "config": self.cfg.to_dict(),
            "tokenizer": self.tokenizer.state_dict(),
            "step": self.progress.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": D.gather_objects(rng_state(self.device), self.dist),  # one entry per rank
            "data_state": self.progress.data_state(self.dist.world_size, self.batching()),
            "metrics": self.progress.metrics(),
            **({"ema": self.ema.state_dict()} if self.ema else {}),
        }

    def load(self, state: dict) -> None:
        """Resume from a checkpoint's `state`: everything `state_dict` wrote, this rank's random streams
        included; a warning where the batches from here on cannot be the interrupted run's."""
        load_model_weights(self.model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        load_scaler_state(self.scaler, state["scaler"])
        data_state = state["data_state"]
        if data_state.get("world_size", 1) != self.dist.world_size:
            raise TrainingError(
                f"checkpoint was written with {data_state.get('world_size')} processes; "
                f"resume with the same number (now {self.dist.world_size})"
            )
        self.progress = Progress.from_checkpoint(state)
        if self.ema and "ema" in state:
            self.ema.load_state_dict(state["ema"])
        elif self.ema:
            log.warning("the checkpoint holds no EMA of the weights: the average starts from its weights")
            self.ema = self._fresh_ema()
        # The settings the batch order depends on are compared with the checkpoint's config on resume
        # (adopt_resumed_config); what the config cannot show: the training text itself changed.
        saved, now = data_state.get("batching"), self.batching()
        if saved is None or saved.get("order") != now["order"]:
            log.warning(
                "the checkpoint predates this release's batch order: the batches from here on differ from "
                "those the interrupted run would have seen (not an exact resume)"
            )
        elif _corpus_key(saved["corpus"]) != _corpus_key(now["corpus"]):
            log.warning(
                "the training corpus differs from the one the checkpoint was trained on (%s, now %s): the "
                "batches from here on differ (not an exact resume)",
                saved["corpus"],
                now["corpus"],
            )
        restore_rng_state(state["rng"][self.dist.rank], self.device)

    def save(self, name: str, periodic: bool = False, weights: str = "raw") -> None:
        """Write checkpoint `name` (with `periodic`, also step_N.pt, pruned to trainer.keep_last). With
        `weights="ema"`, its `model` entry holds the moving average (best.pt, when the EMA validates best).
        last.pt holds the whole training state; best.pt and step_N.pt the weights only, unless
        trainer.full_checkpoints=true (the optimizer's moments and the EMA made them four times larger, and
        resuming reads last.pt). Every rank calls it; the main rank writes."""
        state = self.state_dict()  # every rank joins the RNG gather
        if weights == "ema":
            state["model"] = self.ema.model_state(self.model)
        state["weights"] = weights
        self._refuse_non_finite_weights(state)
        if name != "last.pt" and not self.cfg.trainer.full_checkpoints:
            state = without_training_state(state)
        self.write(state, name, weights, periodic)

    def write(self, state: dict, name: str, weights: str, periodic: bool = False) -> None:
        """Write `state` as checkpoint `name` (with `periodic`: step_N.pt and last.pt, the old step
        files pruned) and log it once written (on the checkpoint writer's thread: `flush` waits)."""
        step = self.progress.step
        names = [f"step_{step}.pt", "last.pt"] if periodic else [name]
        if "last.pt" in names:
            self.last_written = (step, repr(state["metrics"]))
        paths = " and ".join(str(self.checkpoints.directory / n) for n in names)

        def written(seconds: float) -> None:
            log.info(
                "saved checkpoint %s (step %d%s, %.1f s)",
                paths,
                step,
                "" if weights == "raw" else f", {weights} weights",
                seconds,
            )

        try:
            if periodic:
                self.checkpoints.save_periodic(state, step, written, weights_only=not self.cfg.trainer.full_checkpoints)
            else:
                self.checkpoints.save(state, name, written)
        except CheckpointError as error:
            raise TrainingError(str(error)) from None

    def last_is_current(self) -> bool:
        """True when the newest last.pt written by this process holds this step and these metrics: written
        again, it would hold the same run (nothing but a validation changes the state between steps)."""
        return self.last_written == (self.progress.step, repr(self.progress.metrics()))

    def flush(self) -> None:
        """Wait until every checkpoint saved so far is on disk; a failed write raises here."""
        try:
            self.checkpoints.flush()
        except CheckpointError as error:
            raise TrainingError(str(error)) from None

    def _refuse_non_finite_weights(self, state: dict) -> None:
        """Stop before writing a checkpoint whose weights (or their moving average) are not all finite:
        the update that overflowed them had finite gradients, so nothing skipped it."""
        tensors = {**state["model"], **{f"ema.{k}": v for k, v in state.get("ema", {}).get("weights", {}).items()}}
        bad = non_finite_tensors(tensors)
        if not bad:
            return
        step, tc = self.progress.step, self.cfg.trainer
        in_a_row = self.bad_in_a_row()
        self.flush()  # last.pt below is read back
        since = f"; the loss has not been finite since step {step - in_a_row + 1}" if in_a_row else ""
        last = self.checkpoints.directory / "last.pt"
        try:
            good = f"the last good checkpoint is {last} (step {load_checkpoint(last, mmap=True)['step']})"
            retry = f"e.g. from its weights with trainer.init_from={last} in a new hydra.run.dir"
        except CheckpointError:
            good, retry = "no checkpoint was written before", "from the start"
        raise TrainingError(
            f"step {step}: the weights are not finite ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}), so "
            f"nothing was saved{since}; {good}: train again with a lower trainer.lr (now {tc.lr}), {retry}"
        )


def load_scaler_state(scaler: torch.amp.GradScaler, state: dict) -> None:
    """Restore the fp16 loss scaler, or start it afresh when the checkpoint was written in bf16/fp32
    (whose disabled scaler saved nothing: GradScaler refuses an empty state)."""
    if state:
        scaler.load_state_dict(state)  # a disabled (bf16/fp32) scaler ignores it
    elif scaler.is_enabled():
        log.info(
            "the checkpoint has no fp16 loss-scaler state (it was trained in bf16 or fp32); the scaler starts at %g",
            scaler.get_scale(),
        )


def _corpus_key(directory_name: str) -> str:
    """The content hash ending a prepared corpus's directory name (`{data.name}.{split}.{hash}`)."""
    return directory_name.rsplit(".", 1)[-1]
