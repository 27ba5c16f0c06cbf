"""Every error a user can see, in a leaf module that imports nothing of the package: ConfigError (a key's
value), DataError (a corpus, a file and line), CheckpointError (a checkpoint or an export), TrainingError
(a run), UsageError (a command line), CacheDamage (a cache entry, prepared again), Interrupted and
DecodingProcessDied (decoding), Stopped (a run's signal before its first step), PeerGone (another rank
of a run); what translating, the caches and the commands raise comes from here, without loading the
corpus readers or torch. Also the helpers for stdout's reader going away, Ctrl-C at a command's start and
end, an output that would overwrite an input, and a path in a loop of symbolic links."""

import errno
import os
import signal
import stat
import sys
import tempfile
import threading
from pathlib import Path


class ConfigError(ValueError):
    """A configuration value is unusable; the message names the key (e.g. `model.d_model`)."""


class TrainingError(RuntimeError):
    """A run cannot start or go on as asked (its directory, a resume, a non-finite loss); the message says why."""


class UsageError(ValueError):
    """A command line that cannot run as given (a flag's value, a file it names); the message names the flag."""


class CacheDamage(Exception):
    """A cache file is missing, truncated, overwritten or unreadable; `str()` is "<file>: <what>". Caught
    where a cache is read: the entry is prepared again, with one warning naming the file."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = Path(path), problem


class DataError(ValueError):
    """Input data cannot be used; the message names the file (and line) or the config key."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, unsafe or does not fit; the message names the file."""


def discard_stdout() -> None:
    """Point stdout at /dev/null after its reader went away (`... | head`), so that what it still holds
    does not fail again, with a traceback, when Python flushes it at exit."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # no descriptor (a test's captured stdout)
        pass


def os_error_in(error: BaseException) -> OSError | None:
    """The first OSError with an errno in `error`'s chain: torch and CTranslate2 wrap a full disk or a
    denied write in errors of their own."""
    while error is not None:
        if isinstance(error, OSError) and error.errno:
            return error
        error = error.__cause__ or error.__context__
    return None


def import_torch_holding_interrupts() -> None:
    """`import torch` with Ctrl-C (SIGINT) held back until it is done, then delivered: one that arrives
    while torch's C library loads is otherwise lost, and the command runs on as if never interrupted.
    The commands call it before their first module that needs torch."""
    if (
        "torch" in sys.modules
        or threading.current_thread() is not threading.main_thread()
        or not hasattr(signal, "pthread_sigmask")
    ):  # Windows: no signal masks
        import torch  # noqa: F401

        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        import torch  # noqa: F401
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def signal_exit_status(signal_name: str) -> int:
    """The exit status of a command that stopped on `signal_name` ("SIGINT", "SIGTERM") after saving
    its work: 128 + the signal's number (130, 143), as a shell reports a process the signal ended, so that
    `make train && make evaluate` or a job script does not go on as if the command had finished."""
    return 128 + signal.Signals[signal_name].value


def next_interrupt_ends_at_once() -> None:
    """After a command has said it was interrupted: a further Ctrl-C ends the process at once and
    quietly (Python would print a traceback from wherever the exit waits: a worker being joined), and
    the exit status is the command's own (130)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    forget_unhandled_interrupt()


def forget_unhandled_interrupt() -> None:
    """Tell CPython that the KeyboardInterrupt was handled. One that passed through code run by
    `PyRun_String` (pybind11's `py::exec`, which torch calls) sets a flag that stays set until the next
    `PyRun_*` call, and at exit `python -m` kills itself with SIGINT: status -2 in place of the 130 the
    command chose, after its message. Running an empty string through the same function clears it."""
    try:
        import ctypes

        ctypes.pythonapi.PyRun_SimpleString(b"")
    except (ImportError, AttributeError, OSError):  # not CPython: no such flag
        pass


def same_file(a: str | Path | int, b: str | Path | int) -> bool:
    """Whether `a` and `b` (paths, or open file descriptors) are one regular file on disk, however they are
    spelled: symlinks, hard links, ./ and ../ included. Never for terminals, pipes and devices
    (/dev/stdin and /dev/stdout are often one terminal, and that destroys nothing)."""
    try:
        first, second = os.stat(a), os.stat(b)
    except (OSError, ValueError, TypeError):
        return False
    return stat.S_ISREG(first.st_mode) and os.path.samestat(first, second)


# What a stored config (a checkpoint's, an export's config.json) is called in refusals when its lists or
# mappings nest deeper than Python's recursion limit (json and OmegaConf read them recursively).
NESTED_TOO_DEEPLY = (
    "nested too deeply to be read (lists or mappings inside each other, hundreds of levels deep or more); the "
    "file is damaged or was edited"
)

# What a path in a loop of symbolic links is called in refusals (`symlink_loop`).
SYMLINK_LOOP = "a symbolic link loop (a link that leads back to itself, directly or through other links)"


def symlink_loop(path: str | Path) -> bool:
    """Whether `path` leads into a loop of symbolic links, in its last part or one above it: the system
    opens nothing there (ELOOP), Path.exists() and is_file() say False as for a missing file, and
    Path.resolve() raises RuntimeError (Python 3.12 and older)."""
    try:
        os.stat(path)
    except OSError as error:
        return error.errno == errno.ELOOP
    except ValueError:  # a NUL in the name
        return False
    return False


def overwritten_input(output: str | Path | int, inputs: dict[str, str | Path | int | None]) -> str | None:
    """Which of `inputs` (a description -> a path or an open file descriptor; None: not in use) writing
    `output` would destroy: the same file, or a file inside an input directory (an exported model).
    None when it destroys none."""
    for name, source in inputs.items():
        if source is None:
            continue
        files = [source]
        if not isinstance(source, int) and Path(source).is_dir():
            files = list(Path(source).rglob("*"))
        if any(same_file(file, output) for file in files):
            return name
    return None


class Stopped(KeyboardInterrupt):
    """A training run's SIGINT or SIGTERM (`signal_name`) before its first step: nothing to save, so it
    ends at once (a KeyboardInterrupt, which no `except Exception` holds up)."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


class PeerGone(RuntimeError):
    """A rank of a distributed run lost another one (killed, crashed, stopped) in a collective: the run
    cannot go on, and the rank that went said why (or the launcher did); the message says so in one line."""


class Interrupted(Exception):
    """Decoding stopped between batches because `stop()` said so (a training run's SIGTERM)."""


class DecodingProcessDied(RuntimeError):
    """A decoding process ended without a result (killed, out of memory)."""


def write_problem(path: str | Path) -> str | None:
    """Why `path` could not be written, found before the work whose result goes there ('Read-only file
    system', 'Permission denied', ...: the system's words); None when it can be. An existing file is
    opened for appending (nothing changes); for a new one a temporary file is made beside it and removed:
    `os.access` says "permission denied" for a read-only file system and answers root yes on both."""
    path = Path(path)
    try:
        if path.exists():
            with open(path, "ab"):
                pass
        else:
            descriptor, probe = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            os.close(descriptor)
            os.unlink(probe)
    except OSError as error:
        return os.strerror(error.errno) if error.errno else str(error)
    return None
