"""What surrounds a training run: the checkpoint to resume from, the RNG state saved with it, the
run's log file and the signals that stop it cleanly. `Trainer` (train.py) uses these."""

from __future__ import annotations

import logging
import random
import shutil
import signal
from pathlib import Path

import torch

from transformer import distributed as D
from transformer.checkpoint import CheckpointError, load_checkpoint
from transformer.config import TrainerConfig

log = logging.getLogger("transformer.train")


class TrainingError(RuntimeError):
    pass


def find_resume_state(tc: TrainerConfig, ckpt_dir: Path, dist: D.DistInfo) -> dict | None:
    """The state to resume from: `trainer.resume` as a path, or the newest checkpoint in `ckpt_dir` with
    `trainer.resume=true`. A directory holding checkpoints of another run is refused unless
    `trainer.overwrite=true`, which clears it."""
    if isinstance(tc.resume, str) and tc.resume not in ("", "true", "false"):
        return load_checkpoint(tc.resume)
    existing = sorted(ckpt_dir.glob("*.pt")) if ckpt_dir.exists() else []
    if dist.is_main and ckpt_dir.exists():
        for stale in ckpt_dir.glob(".*.pt.tmp*"):     # left by a process killed mid-write
            stale.unlink(missing_ok=True)
    if tc.resume in (True, "true"):
        newest, newest_step = None, -1
        for path in existing:
            try:   # memory-mapped: reading the step does not read the tensors of every file
                step = load_checkpoint(path, mmap=True)["step"]
            except CheckpointError as error:
                log.warning("skipping %s", error)
                continue
            if step > newest_step:
                newest, newest_step = path, step
        if newest is None:
            log.warning("trainer.resume=true but %s holds no checkpoint: starting a new run", ckpt_dir)
            return None
        log.info("resuming from %s (step %d)", newest, newest_step)
        return load_checkpoint(newest)
    if existing:
        if not tc.overwrite:
            raise TrainingError(
                f"{ckpt_dir} already holds checkpoints of another run; pass trainer.resume=true to "
                "continue it, trainer.overwrite=true to replace it, or choose another hydra.run.dir")
        D.barrier(dist)
        if dist.is_main:
            shutil.rmtree(ckpt_dir)
    return None


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
