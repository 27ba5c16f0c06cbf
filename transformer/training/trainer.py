"""A training run: `Trainer`, a loop over the run's components, and `train(cfg)`, which tests and
cli/train.py (`transformer-train`, `python -m transformer.train`, `torchrun -m transformer.train`) call."""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from transformer.checkpoint import check_config_matches_weights, load_model_weights, tensor_shapes
from transformer.config import Config, TrainerConfig
from transformer.console import set_quiet
from transformer.data.batching import TokenBatchSampler, UpdateSampler, update_loader
from transformer.data.corpus import PreparedData
from transformer.data.mixture import MixedCorpus, enable_augmentation
from transformer.data.prepare import prepare
from transformer.data.sources import DataError, load_split_text
from transformer.data.tokenizer import Tokenizer
from transformer.distributed import peer_gone
from transformer.errors import PeerGone
from transformer.flops import mfu_meter
from transformer.model import build_model
from transformer.runtime import FREED_MEMORY_EVERY, Runtime, hand_back_freed_memory
from transformer.training.backtranslation import OnlineBacktranslation
from transformer.training.banner import log_banner, warn_about_settings_the_run_cannot_honour
from transformer.training.batch_fit import choose_max_tokens
from transformer.training.checkpoint_dir import CheckpointDirectory
from transformer.training.monitor import Monitor
from transformer.training.optim import build_optimizer
from transformer.training.progress import Progress
from transformer.training.resume import StartingPoint, starting_point
from transformer.training.run_dir import Launch, RunDirectoryLock, StopSignals, resume_hint
from transformer.training.run_log import announce, attach_log_file
from transformer.training.selection import Selection
from transformer.training.state import TrainingState
from transformer.training.step import TrainingStep
from transformer.training.step_log import TrainingBar, TrainLog, log_lines_above_bars

log = logging.getLogger("transformer.train")


@dataclass
class Batches:
    """The training split's batches: the token-budget sampler (a pure function of seed and epoch), the
    updates it is cut into for this rank (`updates.start(epoch, position)`), and the DataLoader of them."""

    sampler: TokenBatchSampler
    updates: UpdateSampler | None
    loader: object | None


class Trainer:
    """One run: its components, each built by a `build_*` method in the order below (the random streams
    depend on it), then `fit`, the loop over updates. The components: the runtime (device, precision,
    process group), the prepared data, the model, the training state (optimizer, schedule, loss scaler,
    EMA, progress, checkpoints), the batches, the update step, the monitor and model selection."""

    def __init__(self, cfg: Config, run_dir: Path, launch: Launch | None = None, stop: StopSignals | None = None):
        self.cfg, self.launch, self.stop = cfg, launch, stop or StopSignals()  # `stop`: installed by the caller
        self.runtime = Runtime.for_training(cfg.trainer)  # device, process group, precision: resolved once
        try:
            self._build(cfg, run_dir)
        except BaseException:
            # A refused corpus or checkpoint ends the process with one line (exit 2): the process group
            # must go first, or gloo's threads are torn down at interpreter exit and the rank aborts
            # (SIGABRT, exit 134, "terminate called without an active exception"). No barrier: the
            # other ranks may have failed too, or be inside a collective.
            self.leave_process_group(clean=False)
            raise

    def _build(self, cfg: Config, run_dir: Path) -> None:
        """The components after the runtime, in the order the random streams depend on."""
        self.run_dir = Path(self.runtime.broadcast(str(run_dir)))
        start = starting_point(cfg, self.run_dir / "checkpoints", self.runtime.dist)
        torch.manual_seed(cfg.trainer.seed + self.runtime.dist.rank)
        random.seed(cfg.trainer.seed + self.runtime.dist.rank)
        self.data = self.build_data(start)
        self.model = self.build_model(start)
        self.state = self.build_state()
        if cfg.trainer.max_tokens_auto and start.resume is None:  # a resumed run keeps its checkpoint's
            self.fit_max_tokens()
        self.batches = self.build_batches()
        if start.resume:
            self.state.load(start.resume)
        self.monitor = Monitor(
            self.run_dir,
            enabled=self.runtime.is_main,
            loggers=cfg.trainer.loggers,
            resumed_step=start.resume["step"] if start.resume else None,
        )
        self.step = self.build_step()
        self.backtranslation = self.build_backtranslation()
        if self.runtime.is_main:
            log_banner(self.run_dir, start.describe(), self.runtime, self.model, cfg.model.name)
            self.monitor.start(cfg, self.runtime.precision, sum(p.numel() for p in self.model.parameters()))
        self.selection = self.build_selection()

    def build_data(self, start: StartingPoint) -> PreparedData:
        """The tokenizer (a resumed or fine-tuned run's own) and the encoded splits. Every rank calls
        this: one prepares under a file lock (no collective is waiting meanwhile), the others then
        memory-map the same files."""
        saved = start.resume or start.init
        data = prepare(self.cfg.data, Tokenizer.from_state_dict(saved["tokenizer"]) if saved else None)
        dc = self.cfg.data
        if dc.subword_sampling:
            data.train.enable_subword_sampling(
                data.tokenizer, dc.subword_sampling, dc.subword_nbest, self.cfg.trainer.seed
            )
        enable_augmentation(data.train, dc, data.tokenizer, self.cfg.trainer.seed)
        return data

    def build_model(self, start: StartingPoint) -> torch.nn.Module:
        tok = self.data.tokenizer
        if start.resume is not None:  # the model settings are the checkpoint's (`adopt_resumed_config`)
            shapes = tensor_shapes(start.resume["model"])
            check_config_matches_weights(self.cfg.model, shapes, tok, start.path)
        model = build_model(
            self.cfg.model, tok.src_vocab_size, tok.tgt_vocab_size, tok.joint, protected_ids=tok.protected_ids
        ).to(self.runtime.device)
        if start.init is not None:
            load_model_weights(model, start.init["model"], self.cfg.trainer.init_from)
        return model

    def build_state(self) -> TrainingState:
        tc, rt = self.cfg.trainer, self.runtime
        optimizer, scheduler = build_optimizer(self.model, tc, rt.device)
        scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.precision == "fp16")
        checkpoints = CheckpointDirectory(self.run_dir / "checkpoints", tc.keep_last, rt.is_main, background=True)
        return TrainingState(
            self.cfg,
            self.model,
            self.data.tokenizer,
            optimizer,
            scheduler,
            scaler,
            checkpoints,
            self.data.train.identity,
            rt.dist,
            rt.device,
            bad_in_a_row=lambda: self.step.log.read()["bad_in_a_row"],
        )

    def fit_max_tokens(self) -> None:
        """trainer.max_tokens_auto: the budget the GPU's memory allows (rank 0's on every rank), into the
        config the checkpoints hold."""
        tc, rt = self.cfg.trainer, self.runtime
        chosen = choose_max_tokens(tc, self.cfg.data, self.model, rt, self.data.tokenizer.tgt_vocab_size)
        tc.max_tokens = rt.broadcast(chosen)

    def build_batches(self) -> Batches:
        tc, rt, train = self.cfg.trainer, self.runtime, self.data.train
        sampler = TokenBatchSampler(
            train.src_lens,
            train.tgt_lens,
            tc.max_tokens,
            tc.seed,
            epoch_lengths=train.epoch_lengths if train.varies_by_epoch else None,
            epoch_pairs=functools.partial(train.epoch_positions, tc.seed) if isinstance(train, MixedCorpus) else None,
        )
        updates = UpdateSampler(sampler, tc.update_freq, rt.dist.rank, rt.dist.world_size)
        if rt.is_main:
            warn_about_settings_the_run_cannot_honour(self.cfg, sampler, rt.dist.world_size)
        cuda = rt.device.type == "cuda"
        workers = tc.num_workers if tc.num_workers is not None else (2 if cuda else 0)
        return Batches(
            sampler,
            updates,
            update_loader(train, updates, workers, pin_memory=cuda, language_tag=self.cfg.data.language_tag),
        )

    def build_backtranslation(self) -> OnlineBacktranslation | None:
        """trainer.online_backtranslation (a multilingual model), else None."""
        return OnlineBacktranslation.for_run(self.cfg, self.model, self.data.tokenizer, self.runtime)

    def build_step(self) -> TrainingStep:
        """The update (compiled, and wrapped in DDP under torchrun) and the log of its numbers (with MFU on
        a GPU whose peak is known)."""
        tc, device = self.cfg.trainer, self.runtime.device
        mfu = mfu_meter(device, self.cfg.model, self.data.tokenizer.tgt_vocab_size, passes=2 if tc.rdrop else 1)
        return TrainingStep(tc, self.state, self.runtime, TrainLog(device, self.monitor, tc.max_bad_steps, mfu))

    def build_selection(self) -> Selection:
        """The validators and what their results mean (best.pt, patience); a stop signal abandons a validation."""
        return Selection(self.cfg, self.data, self.state, self.runtime, self.monitor, lambda: self.stop_signal)

    @property
    def stop_signal(self) -> str | None:
        """The signal (SIGINT, SIGTERM) that asked the run to stop, or None."""
        return self.stop.name

    @property
    def progress(self) -> Progress:
        """Where the run stands (step, epoch, best score): part of the state a checkpoint holds."""
        return self.state.progress

    def leave_process_group(self, clean: bool) -> None:
        """Drop the DDP/compile wrappers and DataLoader workers, then leave the process group (after a
        barrier on a clean exit, so that no rank tears down while another is still communicating;
        without one after an error, when the other ranks may be inside a different collective).
        Whatever references the process group (DDP's reducer, in a reference cycle with the model, say)
        must go while the interpreter is whole: gloo work objects freed during interpreter finalisation
        abort the process ("terminate called without an active exception"). Idempotent; also for a
        Trainer whose building failed part of the way."""
        step, batches = self.__dict__.get("step"), self.__dict__.get("batches")
        if step is not None:
            if step.train_model is None:
                return  # left already
            step.train_model = None
        if batches is not None:
            batches.loader = batches.updates = None
        gc.collect()
        self.runtime.shutdown(barrier=clean)

    def _stop_reason(self, started: float, agree: bool = True) -> str | None:
        """Why training stops now, or None. Step, epoch and patience limits are the same on every rank;
        the clock and signals are not, so under DDP the ranks agree on those (a collective whose result
        is read on the host) only where `agree` is true: at log steps and epoch ends."""
        tc, progress = self.cfg.trainer, self.progress
        if tc.max_steps and progress.step >= tc.max_steps:
            return f"reached trainer.max_steps={tc.max_steps}"
        if tc.max_epochs and progress.epoch >= tc.max_epochs:
            return f"reached trainer.max_epochs={tc.max_epochs}"
        if tc.patience and progress.bad_validations >= tc.patience:
            return f"no BLEU improvement in trainer.patience={tc.patience} validations"
        reason = self._signal_reason()
        if reason is None and tc.max_minutes and (time.monotonic() - started) / 60 >= tc.max_minutes:
            reason = f"reached trainer.max_minutes={tc.max_minutes}"
        if not self.runtime.dist.enabled:
            return reason
        if agree and self.runtime.any_rank(reason is not None):
            # Ctrl-C reaches every rank, but this one's handler may run only once the collective returns.
            return reason or self._signal_reason() or "stopped on another rank"
        return None

    def _signal_reason(self) -> str | None:
        return f"stopped by {self.stop_signal}" if self.stop_signal else None

    def fit(self) -> dict:
        """The loop: updates until a stop reason, then a last validation and last.pt; returns the metrics."""
        tc, progress, rt = self.cfg.trainer, self.progress, self.runtime
        self.stop.defer()  # a signal from here on lets the step in progress finish, then saves last.pt
        started = time.monotonic()
        bar = TrainingBar(progress.step, tc.max_steps, tc.max_minutes, started, show=rt.is_main)
        reason = self._stop_reason(started)
        while reason is None:
            self.batches.updates.start(progress.epoch, progress.position)
            for micro, consumed in self.batches.loader:  # one optimizer update per item
                reason = self._update(micro, consumed, bar, started)
                if reason is not None:
                    break
            else:
                progress.epoch, progress.position = progress.epoch + 1, 0
                reason = self._stop_reason(started)
        bar.close(finished=self.stop_signal is None)
        self.step.log.check_finite(rt.precision == "fp16")
        log.info("%s at step %d (epoch %d)", reason, progress.step, progress.epoch)
        # A signal may have reached only some ranks: agree, or they would enter different collectives.
        by_signal = rt.any_rank(self.stop_signal is not None)
        if progress.step % tc.validate_every != 0 and not by_signal:
            self.selection.validate()
        if tc.average_last and not by_signal:
            self.selection.average_last()  # before last.pt, so that its metrics (best score, patience) count it
        # Not twice at one step: unless a validation since the periodic save changed the metrics.
        if rt.any_rank(not self.state.last_is_current()):
            self.state.save("last.pt")  # non-finite updates were skipped: the weights are finite
        self.state.flush()  # the test reads best.pt; the hint names last.pt
        if rt.is_main:
            log.info("%s", resume_hint(self.run_dir, self.launch, reason))
        progress.stop_reason = reason
        return progress.metrics()

    def _update(self, micro, consumed: int, bar, started: float) -> str | None:
        """One optimizer update with its logging, validation and checkpoints; the stop reason, if any."""
        tc, progress, fp16 = self.cfg.trainer, self.progress, self.runtime.precision == "fp16"
        if self.backtranslation is not None:
            micro = self.backtranslation(micro, progress.step)
        stats = self.step(micro)
        progress.position += consumed
        if stats.out_of_memory:
            self.monitor.skipped_out_of_memory(progress.step, self.step.oom_skips)
            return self._stop_reason(started)
        progress.step += 1
        if self.state.ema:
            self.state.ema.update(progress.step)
        bar.advance(progress.step)
        self.step.log.add(stats, micro)
        log_step = progress.step % tc.log_every == 0
        if log_step:
            scaler = self.state.scaler
            progress.train_tokens_per_s = self.step.log.write(
                progress.step,
                progress.epoch,
                self.state.scheduler.get_last_lr()[0],
                scaler.get_scale() if scaler.is_enabled() else 1.0,
                fp16,
                bar,
            )
        if progress.step % tc.validate_every == 0:
            self.selection.validate()
        if progress.step % (tc.checkpoint_every or tc.validate_every) == 0:
            self.step.log.check_finite(fp16)
            self.state.save("last.pt", periodic=True)
        if progress.step % FREED_MEMORY_EVERY == 0:
            hand_back_freed_memory()  # or a fragmented heap grows all run long (runtime.py says why)
        return self._stop_reason(started, agree=log_step)


def train(cfg, run_dir: str | Path | None = None) -> dict:
    """Train a model as configured; returns the final metrics. `cfg` is a Config, DictConfig or dict."""
    if not isinstance(cfg, Config):
        from omegaconf import OmegaConf

        raw = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else cfg
        cfg = Config.from_dict(raw)
    else:
        cfg.validate_for_training()
    run_dir = Path(run_dir or cfg.run_dir or "runs/default")
    cfg.run_dir = str(run_dir)
    rank = int(os.environ.get("RANK", "0"))
    lock = RunDirectoryLock.acquire(run_dir) if rank == 0 else None  # one run per directory
    try:
        attach_log_file(run_dir, is_main=rank == 0, level=cfg.trainer.log_level)
        set_quiet(cfg.trainer.log_level in ("warning", "error"))  # no progress bars either
        with log_lines_above_bars():
            return _train_in(cfg, run_dir, _launch_of_this_process())
    except RuntimeError as error:  # a collective of gloo or NCCL, when another rank has gone
        gone = peer_gone(error) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
        if gone is None:
            raise
        raise PeerGone(f"rank {rank}: another rank of the run stopped ({gone}); see its error above") from None
    finally:
        if lock:
            lock.release()


def _launch_of_this_process() -> Launch | None:
    """How this process was started, when Hydra started it (the command that continues the run takes
    the same form); None when `train` is called as a library function."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return Launch.detect(sys.argv, os.environ, list(HydraConfig.get().overrides.task))


def _train_in(cfg: Config, run_dir: Path, launch: Launch | None) -> dict:
    """`train` once the run directory is locked and logged to. SIGINT and SIGTERM stop it from here on:
    before the loop's first step at once, wherever it is (`StopSignals`)."""
    stop = StopSignals()
    stop.install()
    try:
        trainer = Trainer(cfg, run_dir, launch, stop)
        if cfg.trainer.test_at_end and cfg.data.path and trainer.runtime.is_main:
            _check_test_split(cfg)
        return _fit_and_test(trainer, launch)
    finally:
        stop.restore()


def _fit_and_test(trainer: Trainer, launch: Launch | None) -> dict:
    """The loop, then the test of the best checkpoint; the run's components closed however it ends."""
    cfg = trainer.cfg
    try:
        metrics = trainer.fit()
        trainer.leave_process_group(clean=True)  # the test below runs on rank 0 alone
        if trainer.stop_signal is None and cfg.trainer.test_at_end:
            test_scores = trainer.selection.test(trainer.run_dir)
            if test_scores:
                metrics.update(test_bleu=test_scores["bleu"], test_chrf=test_scores["chrf"])
        if trainer.runtime.is_main and (trainer.progress.stop_reason or "").startswith("reached trainer.max_minutes"):
            announce(time_limit_note(cfg.trainer, trainer.progress.step))
        trainer.monitor.finish(trainer.progress.step, metrics)
        if trainer.stop_signal is not None:
            metrics["stopped_by"] = trainer.stop_signal  # a sweep stops (and says which job it was)
        return metrics
    except BaseException:
        last = trainer.run_dir / "checkpoints" / "last.pt"
        if trainer.runtime.is_main and trainer.progress.stop_reason is None and last.is_file():
            log.info("%s", resume_hint(trainer.run_dir, launch))  # stopped by an error or a second Ctrl-C
        raise
    finally:
        trainer.state.checkpoints.close()  # lets a write in flight finish
        trainer.monitor.close()
        trainer.leave_process_group(clean=False)  # after an error: no barrier


def time_limit_note(tc, step: int) -> str:
    """The last line of a run that trainer.max_minutes stopped: whether it cut short the steps or epochs
    the run was set to make (a preset's or the command's; the schema's max_steps is only a backstop)."""
    limit = f"stopped by trainer.max_minutes={tc.max_minutes:g} at step {step}"
    planned = [
        f"trainer.{key}={getattr(tc, key)}"
        for key in ("max_steps", "max_epochs")
        if getattr(tc, key) and getattr(tc, key) != TRAINER_DEFAULTS[key]
    ]
    if not planned:
        return f"{limit}: the run's time limit"
    return (
        f"{limit} of {' / '.join(planned)}: the result is short of the planned run; add trainer.resume=true to "
        "continue it from last.pt, or set trainer.max_minutes=0 for no time limit"
    )


TRAINER_DEFAULTS = {field.name: field.default for field in dataclasses.fields(TrainerConfig)}


def _check_test_split(cfg: Config) -> None:
    """A test split the end of training could not read is said now, not after hours of training."""
    try:
        load_split_text(cfg.data, "test")
    except DataError as error:
        log.warning(
            "no test split to score at the end of this run (trainer.test_at_end): %s; it trains and "
            "validates all the same (trainer.test_at_end=false silences this)",
            error,
        )
