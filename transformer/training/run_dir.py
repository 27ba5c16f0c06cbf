"""The run directory: its lock (one run at a time, released however the process ends), the signals that
stop a run cleanly, and the command that continues a run in the form it was started with (its log file:
run_log.py)."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

from transformer.compose import CONFIG_SOURCE_FLAGS, override_text
from transformer.errors import (
    SYMLINK_LOOP,
    Stopped,
    TrainingError,  # noqa: F401  (its home is errors.py; imported from here too)
    symlink_loop,
)

log = logging.getLogger("transformer.train")


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
        if symlink_loop(run_dir):
            raise TrainingError(
                f"hydra.run.dir={run_dir}: is {SYMLINK_LOOP}; remove the link or choose another run directory"
            )
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
            raise TrainingError(
                f"{run_dir} is in use by another training run ({holder}); wait for it to end or "
                "choose another hydra.run.dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        handle.flush()
        lock.handle = handle
        cls._held[lock.path] = lock
        return lock

    @classmethod
    def held_here(cls, run_dir: Path) -> bool:
        """Whether this process holds the lock of `run_dir` (`acquire` would hand it back)."""
        return cls(run_dir).path in cls._held

    def release(self) -> None:
        if self.handle is not None:
            self._held.pop(self.path, None)
            self.handle.close()  # closing the descriptor releases the lock
            self.handle = None


def chooses_run_directory(argv: list[str]) -> bool:
    """Whether a command line chooses its run directory (hydra.run.dir in any spelling, interpolations
    included, or a config of its own that may set it) rather than taking the default timestamped one."""
    return any(override_key(arg) == "hydra.run.dir" or arg.split("=", 1)[0] in CONFIG_SOURCE_FLAGS for arg in argv)


def discard_unused_run_directory(run_dir: Path, created_since: float = 0.0) -> bool:
    """Remove a run directory that a refused start left holding only what Hydra and the refusal wrote
    (`.hydra/`, `train.log`, `.lock`), all of it written since `created_since` (this process's start:
    not another start's of the same second), and the parents that leaves empty below the current
    directory, so that a mistyped override does not leave a timestamped directory behind for each try.
    A directory holding anything else, or older, or in use by a run, stays. True when it was removed."""
    run_dir = Path(run_dir)
    try:
        if not run_dir.is_dir():
            return False
        entries = list(run_dir.iterdir())
        if not {entry.name for entry in entries} <= {".hydra", "train.log", ".lock"} or any(
            entry.lstat().st_mtime < created_since for entry in [run_dir, *entries]
        ):
            return False
        if RunDirectoryLock.held_here(run_dir):  # a run of this process uses it
            return False
        lock = RunDirectoryLock.acquire(run_dir)
    except (OSError, TrainingError):
        return False
    root = logging.getLogger()
    for handler in list(root.handlers):  # Hydra's handler of train.log: closed before its file goes
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == run_dir.resolve():
            root.removeHandler(handler)
            handler.close()
    try:
        shutil.rmtree(run_dir)
    except OSError:
        return False
    finally:
        lock.release()
    here = Path.cwd().resolve()
    for parent in run_dir.resolve().parents:
        if here not in parent.parents:
            break
        try:
            parent.rmdir()  # only an empty one
        except OSError:
            break
    return True


# Overrides a resume command replaces with its own.
RESUME_REPLACES = ("trainer.resume", "trainer.overwrite", "hydra.run.dir", "run_dir")


def override_key(override: str) -> str:
    """The key (or group) a Hydra override sets: `+trainer.rdrop=2` -> `trainer.rdrop`, `~model` -> `model`."""
    return override.lstrip("+~").split("=", 1)[0]


def hydra_value(value) -> str:
    """`value` as the right-hand side of a Hydra override: a string that Hydra would read as another
    type or that its unquoted grammar refuses (spaces, commas, `~`, non-ASCII) in double quotes."""
    if not isinstance(value, str) or (
        re.fullmatch(r"[A-Za-z_/.][A-Za-z0-9_./:-]*", value)
        and value.lower() not in ("true", "false", "null", "nan", "inf")
    ):
        return override_text(value)
    escaped = re.sub(r'(\\*)("|$)', lambda m: m.group(1) * 2 + ("\\" + m.group(2) if m.group(2) else ""), value)
    return f'"{escaped}"'


def named_run_directory(argv: list[str], key: str = "hydra.run.dir") -> Path | None:
    """The directory `hydra.run.dir=...` (or another `key`: hydra.sweep.dir) names in `argv`, as Hydra
    reads it (quotes and escapes removed: `'runs/a b'`, `runs/a\\ b`), or None: none named, an
    interpolation only Hydra resolves (`${now:...}`), a list of them, or an override Hydra will refuse itself."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    named = [arg for arg in argv if arg.split("=", 1)[0] == key]
    if not named:
        return None
    try:
        value = OverridesParser.create().parse_override(named[-1]).value()
    except Exception:
        return None
    return Path(value) if isinstance(value, str) and value and "${" not in value else None


def check_sweep_directory(sweep_dir: Path, argv: list[str]) -> None:
    """TrainingError for a sweep into the directory of an earlier one: Hydra rewrites a job's `.hydra/`
    record before the job can refuse its checkpoints, and summary.tsv would mix both sweeps' rows. A
    sweep resumed with trainer.resume=true continues its jobs."""
    if not sweep_dir.is_dir() or any(arg.lstrip("+") == "trainer.resume=true" for arg in argv):
        return
    earlier = [p for p in ("summary.tsv", "multirun.yaml") if (sweep_dir / p).exists()]
    earlier += sorted(p.parent.name for p in sweep_dir.glob("*/checkpoints"))[:1]
    if earlier:
        raise TrainingError(
            f"hydra.sweep.dir={sweep_dir} holds an earlier sweep ({', '.join(earlier)}); its jobs "
            "would be overwritten and its summary mixed with this one's: choose a new hydra.sweep.dir, "
            "or add trainer.resume=true to continue that sweep's jobs"
        )


# Set by transformer-train-ddp (`transformer.cli.launch`) for its ranks: the launcher and its torchrun options.
LAUNCH_ENV = "TRANSFORMER_TRAIN_DDP"


@dataclasses.dataclass
class Launch:
    """How the run was started, so that the command continuing it takes the same form: `program`
    (["make", "train"], ["transformer-train"], [python, "-m", "transformer.train"], torchrun ...), the
    Hydra overrides of this job and Hydra's own flags (--config-dir DIR: `ARGS="..."` under make)."""

    program: list[str]
    overrides: list[str]
    flags: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def detect(cls, argv: list[str], environ, overrides: list[str]) -> Launch:
        """From this process: make exports MAKELEVEL to the commands of its recipes (the Makefile runs
        `python -m transformer.cli.train`, or `transformer.cli.launch` for train-ddp, from the directory holding
        it), torchrun sets LOCAL_WORLD_SIZE, transformer-train-ddp LAUNCH_ENV (itself with its torchrun
        options), the console script is argv[0]. A Makefile target cannot be told apart from the same
        command typed under some other make: both read as `make train`."""
        flags, args = [], iter(argv[1:])
        for arg in args:
            if arg.split("=", 1)[0] in CONFIG_SOURCE_FLAGS:
                flags += [arg] if "=" in arg else [arg, next(args, "")]
        nproc = environ.get("LOCAL_WORLD_SIZE")
        if "MAKELEVEL" in environ and Path(argv[0]).name == "train.py" and Path("Makefile").is_file():
            program = ["make", "train-ddp", f"NPROC={nproc}"] if nproc else ["make", "train"]
        elif nproc and environ.get(LAUNCH_ENV):  # transformer-train-ddp, with its torchrun options
            program = shlex.split(environ[LAUNCH_ENV])
        elif nproc:
            program = ["torchrun", "--standalone", f"--nproc_per_node={nproc}", "-m", "transformer.train"]
        elif Path(argv[0]).name == "transformer-train":
            program = ["transformer-train"]
        else:
            program = [python_command(), "-m", "transformer.train"]
        return cls(program, list(overrides), flags)

    def resume_command(self, run_dir: Path) -> str:
        """The command continuing the run in `run_dir`: the same overrides, trainer.resume=true and the
        directory (other values of trainer.resume, trainer.overwrite and the run directory dropped)."""
        kept = [o for o in self.overrides if override_key(o) not in RESUME_REPLACES]
        args = kept + ["trainer.resume=true", f"hydra.run.dir={hydra_value(str(run_dir))}"]
        if self.program[0] == "make":
            flags = [f"ARGS={shlex.join(self.flags)}"] if self.flags else []
            return shlex.join(self.program + args + flags)
        return shlex.join(self.program + self.flags + args)


def python_command() -> str:
    """This interpreter as a user would type it: `python` when that is the one on PATH, else its path
    (relative to the working directory when inside it, e.g. .venv/bin/python)."""
    if shutil.which("python") and Path(shutil.which("python")).resolve() == Path(sys.executable).resolve():
        return "python"
    try:
        return str(Path(sys.executable).relative_to(Path.cwd()))
    except ValueError:
        return sys.executable


def resume_hint(run_dir: Path, launch: Launch | None, reason: str | None = None) -> str:
    """The log line saying how to continue the run in `run_dir` after it stopped for `reason`: a limit
    of the run is named, as continuing with the same value stops again at once."""
    raise_limit = next(
        (
            f" (raise {key}: it ended this run)"
            for key in ("trainer.max_steps", "trainer.max_epochs", "trainer.patience")
            if reason and key in reason
        ),
        "",
    )
    last = run_dir / "checkpoints" / "last.pt"
    if launch is None:
        return f"continue from {last}{raise_limit}: trainer.resume=true with the run directory {run_dir}"
    return f"continue from {last}{raise_limit} with: {launch.resume_command(run_dir)}"


class StopSignals:
    """SIGINT and SIGTERM during a run, from `install` (before its data is prepared) to `restore`.

    Before the training loop starts (`defer`) waiting saves nothing, so a signal ends the run at once:
    `Stopped` is raised wherever the main thread is (preparing the data, building the model, reading the
    test split). From `defer` on it sets `name`: the loop finishes its step, saves last.pt and returns.
    A second signal raises KeyboardInterrupt ("now"). Outside the main thread (a library caller's), nothing
    is installed and `name` stays None."""

    def __init__(self):
        self.name: str | None = None  # the signal received
        self.at_once = True
        self._previous: dict = {}

    def install(self) -> None:
        import threading

        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def defer(self) -> None:
        """From now on a signal waits for the step in progress (the training loop has started)."""
        self.at_once = False

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        import threading

        if self.name:  # a second Ctrl-C means "now"
            raise KeyboardInterrupt
        self.name = signal.Signals(signum).name
        if self.at_once:
            raise Stopped(self.name)
        # Said from another thread, which waits for the log's lock: the handler runs between two bytecodes
        # of the main thread, maybe in the middle of writing a log line, and a second write from here would
        # be a reentrant call on the same file (a RuntimeError, printed with a traceback).
        message = ("%s received: finishing this step and saving last.pt", self.name)
        threading.Thread(target=log.warning, args=message, name="signal-message").start()
