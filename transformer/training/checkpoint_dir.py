"""A run's checkpoints/ folder: last.pt, best.pt and step_N.pt, the newest `keep_last` step files kept,
each written atomically (checkpoint.save_checkpoint) on rank 0, during a run on a writer thread from a
copy of the tensors taken at once, so that training goes on while the file is written."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from transformer.checkpoint import fsync_directory, save_checkpoint, step_checkpoints, without_training_state
from transformer.errors import CheckpointError  # their home; imported from here too

log = logging.getLogger("transformer.checkpoint")


class CheckpointDirectory:
    """A run's checkpoints/: `last.pt`, `best.pt` and the `step_N.pt` files, of which the newest
    `keep_last` are kept (0 keeps all). Only the main rank writes.

    With `background=True` a save copies the state's tensors to the CPU and returns; a writer thread
    serializes and writes the file while training goes on (on a GPU, waiting for each write stalled
    training for a third of its time: docs/benchmarks.md). At most one write is in flight: a save waits
    for the one before it. A write that failed raises its `CheckpointError` at the next `save` or `flush`;
    whatever reads the files in the same process (averaging, the test) calls `flush` first."""

    def __init__(self, directory: Path, keep_last: int, is_main: bool, background: bool = False):
        self.directory, self.keep_last, self.is_main = Path(directory), keep_last, is_main
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer") if background and is_main else None
        self._pending: Future | None = None

    def save(self, state: dict, name: str, done: Callable[[float], None] | None = None) -> None:
        """Write `name`; a failure says which checkpoint is the last good one. `done(seconds)` is called
        once the file is written."""
        self._submit(lambda snapshot: self._write(snapshot, name), state, done)

    def save_periodic(
        self, state: dict, step: int, done: Callable[[float], None] | None = None, weights_only: bool = False
    ) -> None:
        """step_N.pt and last.pt, then the step files beyond `keep_last` removed. With `weights_only`,
        step_N.pt holds `state` without its training state (`checkpoint.without_training_state`) and last.pt
        all of it: two files. Without, last.pt is a second name of step_N.pt (a copy where the file system
        has no hard links): one file written."""

        def write(snapshot: dict) -> None:
            if weights_only:  # last.pt first: a run killed between the two resumes from it
                self._write(snapshot, "last.pt")
                self._write(without_training_state(snapshot), f"step_{step}.pt")
            else:
                self._write(snapshot, f"step_{step}.pt")
                _link_or_copy(self.directory / f"step_{step}.pt", self.directory / "last.pt")
            if self.keep_last:
                for old in step_checkpoints(self.directory.parent)[: -self.keep_last]:
                    old.unlink()

        self._submit(write, state, done)

    def flush(self) -> None:
        """Wait for the write in flight, if any; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Let the write in flight finish (training stopped, perhaps by an error: a failed write is logged,
        not raised, so that it does not hide that error) and stop the writer thread."""
        try:
            self.flush()
        except CheckpointError as error:
            log.error("%s", error)
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def _submit(self, write: Callable[[dict], None], state: dict, done: Callable[[float], None] | None) -> None:
        if not self.is_main:
            return

        def run(state: dict) -> None:
            started = time.monotonic()
            write(state)
            if done:
                done(time.monotonic() - started)

        if self._writer is None:
            run(state)
            return
        self.flush()
        # A copy on the CPU: training goes on changing the tensors in place.
        self._pending = self._writer.submit(run, tensors_copied_to_cpu(state))

    def _write(self, state: dict, name: str) -> None:
        try:
            save_checkpoint(state, self.directory / name)
        except CheckpointError as error:
            # last.pt resumes the run (a file is replaced only once its successor is whole); else the newest
            last = self.directory / "last.pt"
            kept = [last] if last.is_file() else sorted(self.directory.glob("*.pt"), key=lambda p: p.stat().st_mtime)
            raise CheckpointError(
                f"{error}; the last good checkpoint is {kept[-1] if kept else 'none (nothing was saved yet)'}"
            ) from None


def tensors_copied_to_cpu(value):
    """`value` (dicts, lists and tuples of tensors and plain data) with every tensor copied to the CPU, so
    that nothing in it shares memory with the tensors training updates."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: tensors_copied_to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(tensors_copied_to_cpu(item) for item in value)
    return value


def _link_or_copy(source: Path, target: Path) -> None:
    """Make `target` the same file as `source` atomically: a hard link renamed over it, or where the file
    system refuses hard links, a copy written beside it and renamed."""
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, target)
    except OSError as error:
        raise CheckpointError(f"{target}: cannot write the checkpoint: {error.strerror}") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_directory(target.parent)
