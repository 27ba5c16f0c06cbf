"""What the commands share when something goes wrong, in a leaf module: DataError (what only raises it,
batching, the caches, the tokenizer, imports it from here, so that translating does not load the corpus
readers of `transformer.data`, which re-exports it), and stdout's reader going away."""

import os
import sys


class DataError(ValueError):
    """Input data cannot be used; the message names the file (and line) or the config key."""


def discard_stdout() -> None:
    """Point stdout at /dev/null after its reader went away (`... | head`), so that what it still holds
    does not fail again, with a traceback, when Python flushes it at exit."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):               # no descriptor (a test's captured stdout)
        pass
