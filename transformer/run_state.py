"""What surrounds a training run: the checkpoint to resume from, the RNG state saved with it, the
run's log file and the signals that stop it cleanly. `Trainer` (train.py) uses these."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import random
import shutil
import signal
import socket
import time
from pathlib import Path

import torch

from transformer import distributed as D
from transformer.checkpoint import CheckpointError, load_checkpoint
from transformer.config import TrainerConfig

log = logging.getLogger("transformer.train")


class TrainingError(RuntimeError):
    pass


def starting_point(cfg, ckpt_dir: Path, dist: D.DistInfo) -> tuple[dict | None, dict | None]:
    """What a run starts from: (a checkpoint to resume, None), (None, a checkpoint whose weights and
    tokenizer to fine-tune: trainer.init_from), or (None, None) for a new model."""
    tc = cfg.trainer
    resume_state = find_resume_state(tc, ckpt_dir, dist)
    if resume_state or not tc.init_from:
        return resume_state, None
    init_state = load_checkpoint(tc.init_from, mmap=True)
    saved = init_state["config"]["data"]
    if (saved["vocab_size"], saved["joint_vocab"]) != (cfg.data.vocab_size, cfg.data.joint_vocab):
        log.warning("trainer.init_from: the model's tokenizer (data.vocab_size=%s, joint_vocab=%s) is kept; "
                    "data.vocab_size=%s, joint_vocab=%s are ignored", saved["vocab_size"], saved["joint_vocab"],
                    cfg.data.vocab_size, cfg.data.joint_vocab)
    return None, init_state


def find_resume_state(tc: TrainerConfig, ckpt_dir: Path, dist: D.DistInfo) -> dict | None:
    """The state to resume from: `trainer.resume` as a path, or the newest checkpoint in `ckpt_dir` with
    `trainer.resume=true`. A directory holding checkpoints of another run is refused unless
    `trainer.overwrite=true`, which clears it."""
    if isinstance(tc.resume, str) and tc.resume not in ("", "true", "false"):
        return _resumable(load_checkpoint(tc.resume), tc.resume)
    existing = sorted(ckpt_dir.glob("*.pt")) if ckpt_dir.exists() else []
    # best.pt may hold averaged weights (trainer.ema_decay, average_last), never newer than last.pt.
    resumable = [p for p in existing if p.name != "best.pt"]
    if dist.is_main and ckpt_dir.exists():
        for stale in ckpt_dir.glob(".*.pt.tmp*"):     # left by a process killed mid-write
            stale.unlink(missing_ok=True)
    if tc.resume in (True, "true"):
        newest, newest_step = None, -1
        for path in resumable:
            try:   # memory-mapped: reading the step does not read the tensors of every file
                state = _resumable(load_checkpoint(path, mmap=True), path)
            except (CheckpointError, TrainingError) as error:
                log.warning("skipping %s", error)
                continue
            step = state["step"]
            if step > newest_step:
                newest, newest_step = path, step
        if newest is None:
            log.warning("trainer.resume=true but %s holds no checkpoint: starting a new run", ckpt_dir)
            return None
        log.info("resuming from %s (step %d)", newest, newest_step)
        return load_checkpoint(newest)
    if existing:
        if not tc.overwrite:
            raise foreign_run_error(ckpt_dir)
        D.barrier(dist)
        if dist.is_main:
            shutil.rmtree(ckpt_dir)
    return None


def foreign_run_error(ckpt_dir: Path) -> TrainingError:
    return TrainingError(f"{ckpt_dir} already holds checkpoints of another run; pass trainer.resume=true to "
                         "continue it, trainer.overwrite=true to replace it, or choose another hydra.run.dir")


def check_run_directory(run_dir: Path, overrides: list[str]) -> None:
    """Before Hydra writes `.hydra/` and `train.log` into an explicitly named run directory: take its
    lock and refuse one that holds another run's checkpoints, unless the overrides resume or replace it."""
    RunDirectoryLock.acquire(run_dir)
    keeps = [o for o in overrides if o.split("=", 1)[0].lstrip("+") in ("trainer.resume", "trainer.overwrite")
             and o.split("=", 1)[1].lower() not in ("false", "", "null")]
    if not keeps and any((run_dir / "checkpoints").glob("*.pt")):
        raise foreign_run_error(run_dir / "checkpoints")


def _resumable(state: dict, path) -> dict:
    if state.get("weights", "raw") != "raw":
        raise TrainingError(
            f"{path}: holds the {state['weights']} weights (best.pt of a run with trainer.ema_decay or "
            f"average_last), not the training state; resume from last.pt, or start a new run from these weights "
            f"with trainer.init_from={path}")
    missing = [key for key in ("optimizer", "scheduler", "scaler", "rng", "data_state") if key not in state]
    if missing:
        raise TrainingError(
            f"{path}: holds weights only (an averaged or exported checkpoint, without {', '.join(missing)}), so "
            f"it cannot resume a run; translate or evaluate with it, or start a new run from its weights with "
            f"trainer.init_from={path}")
    return state


class RunDirectoryLock:
    """An exclusive lock on `<run_dir>/.lock` for the life of a run: a second run into the same
    directory is refused with the holder's pid and host. The kernel releases it when the process
    ends however it ends, so a killed run never leaves a stale lock.

    A POSIX record lock (`lockf`), not `flock`: it belongs to the process, so DataLoader workers forked
    from it do not inherit it and cannot keep a killed run's directory locked after it died.
    """

    _held: dict[Path, RunDirectoryLock] = {}

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir).resolve() / ".lock"
        self.handle = None

    @classmethod
    def acquire(cls, run_dir: Path) -> RunDirectoryLock:
        run_dir = Path(run_dir)
        if run_dir.exists() and not run_dir.is_dir():
            raise TrainingError(f"hydra.run.dir={run_dir}: is a file, not a directory; choose another run directory")
        lock = cls(run_dir)
        if lock.path in cls._held:
            return cls._held[lock.path]
        try:
            lock.path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(lock.path, "a+")
        except OSError as error:
            raise TrainingError(f"hydra.run.dir={run_dir}: cannot be created or written ({error.strerror})") from None
        try:
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise TrainingError(f"{run_dir} is in use by another training run ({holder}); wait for it to end or "
                                "choose another hydra.run.dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        handle.flush()
        lock.handle = handle
        cls._held[lock.path] = lock
        return lock

    def release(self) -> None:
        if self.handle is not None:
            self._held.pop(self.path, None)
            self.handle.close()          # closing the descriptor releases the lock
            self.handle = None


def rng_state(device: torch.device) -> dict:
    """This process's random number generator states (torch, Python, CUDA)."""
    return {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def restore_rng_state(rng: dict, device: torch.device) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate((3, tuple(rng["python"]), None))
    if rng.get("cuda") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)


def install_signal_handlers(trainer) -> dict:
    """SIGINT/SIGTERM finish the current step, write last.pt and return cleanly."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, frame):
        if trainer.stop_signal:      # a second Ctrl-C means "now"
            raise KeyboardInterrupt
        trainer.stop_signal = signal.Signals(signum).name
        log.warning("%s received: finishing this step and saving last.pt", trainer.stop_signal)

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


_log_handler: logging.Handler | None = None


def attach_log_file(run_dir: Path, is_main: bool) -> None:
    """train.log in the run directory on rank 0 (Hydra's own handler when run through Hydra); other
    ranks log warnings only, so that one file is written by one process."""
    global _log_handler
    root = logging.getLogger()
    if _log_handler is not None:          # a previous train() call in this process
        root.removeHandler(_log_handler)
        _log_handler.close()
        _log_handler = None
    if not is_main:
        for handler in list(root.handlers):
            if isinstance(handler, logging.FileHandler):
                root.removeHandler(handler)
        root.setLevel(logging.WARNING)
        return
    log_file = (run_dir / "train.log").resolve()
    if not any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == log_file for h in root.handlers):
        run_dir.mkdir(parents=True, exist_ok=True)
        _log_handler = logging.FileHandler(log_file)
        _log_handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(_log_handler)
    root.setLevel(logging.INFO)
