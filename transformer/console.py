"""Whether the package draws progress bars (tqdm) on the terminal: on a TTY, unless the process was made
quiet (trainer.log_level=warning or error, transformer-train --quiet). A leaf module: every layer's bars
ask it."""

from __future__ import annotations

_quiet = False


def set_quiet(quiet: bool) -> None:
    """From now on, in this process, draw no bar (True) or let each bar decide (False)."""
    global _quiet
    _quiet = quiet


def bars_disabled(show: bool = True) -> bool | None:
    """tqdm's `disable` for a bar: True when quiet or not `show`; else None (tqdm's own choice: no bar
    when stderr is not a terminal)."""
    return True if _quiet or not show else None
