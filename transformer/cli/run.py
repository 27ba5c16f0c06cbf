"""The one way a command ends. A refusal the project defines (errors.py: ConfigError, DataError,
CheckpointError, TrainingError, UsageError) is one line on stderr, `prog: error: ...`, and exit 2; Ctrl-C
is one line and exit 130 (a second Ctrl-C ends at once); a reader that went away (`... | head`) is exit
0 with nothing more written. Anything else is a bug and keeps its traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable

from transformer.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    TrainingError,
    UsageError,
    discard_stdout,
    next_interrupt_ends_at_once,
)

REFUSALS = (ConfigError, DataError, CheckpointError, TrainingError, UsageError)


def run_command(prog: str | None, body: Callable[[], int | None], interrupted: str = "interrupted") -> int:
    """`body()`'s exit status (None: 0), ended as the module says. `prog` heads the lines; None for the
    Hydra-composed commands (train, prepare), whose lines say `error: ...` as Hydra's own errors do.
    `interrupted`: what Ctrl-C says (what was kept, how to go on)."""
    try:
        return body() or 0
    except REFUSALS as error:
        line = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"{prog}: error: {line}" if prog else f"error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        next_interrupt_ends_at_once()
        print(f"{prog}: {interrupted}" if prog else interrupted, file=sys.stderr)
        return 130
    except BrokenPipeError:
        discard_stdout()
        return 0
