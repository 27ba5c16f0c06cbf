"""What the commands share when something goes wrong, in a leaf module: DataError (what only raises it,
batching, the caches, the tokenizer, imports it from here, so that translating does not load the corpus
readers of `transformer.data`, which re-exports it), CheckpointError (so that a command line can name it
before it loads torch with `transformer.checkpoint`, which re-exports it), and stdout's reader going away."""

import os
import sys


class DataError(ValueError):
    """Input data cannot be used; the message names the file (and line) or the config key."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, unsafe or does not fit; the message names the file."""


def discard_stdout() -> None:
    """Point stdout at /dev/null after its reader went away (`... | head`), so that what it still holds
    does not fail again, with a traceback, when Python flushes it at exit."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):               # no descriptor (a test's captured stdout)
        pass


def os_error_in(error: BaseException) -> OSError | None:
    """The first OSError with an errno in `error`'s chain: torch and CTranslate2 wrap a full disk or a
    denied write in errors of their own."""
    while error is not None:
        if isinstance(error, OSError) and error.errno:
            return error
        error = error.__cause__ or error.__context__
    return None
