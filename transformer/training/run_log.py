"""What a run writes besides its checkpoints and trackers: train.log, the level of the package's loggers
(trainer.log_level, or the level Hydra's job_logging gives), and the lines a run ends with, printed once.

Hydra's job_logging decides where log records go (its console handler on stdout, train.log) and at what
level each handler passes them; nothing here changes its handlers or the root logger's level. What is
set is the level of the `transformer` loggers, and a train.log of our own where Hydra's config writes
none (hydra/job_logging=disabled, none or stdout, or `train()` called as a library)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

PACKAGE = "transformer"
FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's default, so train.log reads the same

_log_handler: logging.Handler | None = None


def attach_log_file(run_dir: Path, is_main: bool, level: str | None = None) -> None:
    """train.log in the run directory on rank 0 (Hydra's own handler when its job_logging writes it) and
    the package's loggers at `level` (trainer.log_level; None: `configured_level`). Other ranks write no
    file and log warnings and errors only, so that one file is written by one process."""
    global _log_handler
    root = logging.getLogger()
    if _log_handler is not None:  # a previous train() call in this process
        root.removeHandler(_log_handler)
        _log_handler.close()
        _log_handler = None
    # hydra/job_logging=disabled disables every logger that exists when it is applied (ours are made at
    # import): its console stays silent, since it has no handler, but train.log is the run's record.
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if (name == PACKAGE or name.startswith(PACKAGE + ".")) and isinstance(logger, logging.Logger):
            logger.disabled = False
    package = logging.getLogger(PACKAGE)
    chosen = getattr(logging, level.upper()) if level else configured_level()  # config.LOG_LEVELS
    if not is_main:
        for handler in list(root.handlers):
            if isinstance(handler, logging.FileHandler):
                root.removeHandler(handler)
        package.setLevel(max(chosen, logging.WARNING))
        return
    log_file = (run_dir / "train.log").resolve()
    if not any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == log_file for h in root.handlers):
        run_dir.mkdir(parents=True, exist_ok=True)
        _log_handler = logging.FileHandler(log_file)
        _log_handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(_log_handler)
    package.setLevel(chosen)


def configured_level() -> int:
    """The root logger's level that Hydra's job_logging sets (INFO by default; hydra.job_logging.root.level
    changes it) where that config logs anywhere; INFO outside Hydra and where it logs nowhere
    (hydra/job_logging=disabled, none), so that train.log holds the run's log."""
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return logging.INFO
    if not HydraConfig.initialized():
        return logging.INFO
    root = (HydraConfig.get().job_logging or {}).get("root") or {}
    if not root.get("handlers"):
        return logging.INFO
    level = root.get("level", logging.WARNING)
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
    return level if isinstance(level, int) else logging.INFO


def log_to_file_only(message: str, level: int = logging.ERROR) -> None:
    """`message` into train.log (and any other log file) but not on the console: for what the console
    gets another way (a refusal's line on stderr, a result printed on stdout), so that it shows once."""
    record = logging.getLogger(PACKAGE + ".train").makeRecord(
        PACKAGE + ".train", level, __file__, 0, message, None, None
    )
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and record.levelno >= handler.level:
            handler.handle(record)


def announce(message: str) -> None:
    """A line a run ends with (its test score, a limit that cut it short): on stdout once, whatever the
    log level and the console handlers, and in train.log."""
    log_to_file_only(message, logging.INFO)
    print(message, file=sys.stdout, flush=True)
