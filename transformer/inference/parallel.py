"""Batches decoded by several CPU worker processes, one core each: forked from the decoding process, handed
batches ahead, ended with their parent (prctl), their errors brought back portable; a worker that dies is
named (`DecodingProcessDied`)."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import warnings

import torch

from transformer.errors import DecodingProcessDied, Interrupted

# The smallest batch (source tokens) that `workers` > 1 cuts a file into, so that each worker gets several.
PARALLEL_MIN_BATCH_TOKENS = 256


def _prctl():
    """libc's prctl (Linux), or None."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _end_with(parent: int, prctl) -> None:
    """Linux: this process is killed when `parent` dies, even by SIGKILL (a decoding process would
    otherwise wait on its task queue forever, holding the model's memory). Elsewhere the daemon flag
    covers a normal exit."""
    if prctl is None:
        return
    prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def in_processes(batches: list[list[int]], attempt, done, workers: int, stop=None) -> None:
    """`attempt(batch)` for every batch in `workers` forked processes, one core each (PyTorch's threads
    set to 1 in each, as DataLoader workers do), which share the parent's weights copy-on-write; `done(batch,
    results)` in the parent as each batch comes back. Processes rather than threads: a decoding step is
    many small operations, and threads take turns on the interpreter lock to launch them. At most two
    batches per process are handed out ahead, `stop()` asked before each and while waiting (True:
    `Interrupted`); the first
    error of a process is raised here, and any error or Ctrl-C ends every process at once."""
    context = multiprocessing.get_context("fork")
    tasks, answers = context.SimpleQueue(), context.Queue()

    parent, prctl = os.getpid(), _prctl()  # looked up here: no dlopen() in a forked child

    def serve() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
        _end_with(parent, prctl)
        torch.set_num_threads(1)
        # Layers that trainer.compile compiled run eager here: the compiler's worker pool does not survive
        # fork(), so a graph compiled in this process waited forever (validation of a compiled CPU run hung).
        # Only where the parent loaded the compiler: importing it costs ~2 s in each process.
        eager = torch.compiler.set_stance("force_eager") if "torch._dynamo" in sys.modules else contextlib.nullcontext()
        with torch.inference_mode(), eager:
            while (number := tasks.get()) is not None:
                try:
                    answers.put((number, attempt(batches[number]), None))
                except BaseException as error:  # noqa: BLE001 - handed to the parent
                    answers.put((number, None, _portable(error)))
                    return

    with warnings.catch_warnings():  # Python warns of fork() beside native threads
        warnings.simplefilter("ignore", DeprecationWarning)
        processes = [context.Process(target=serve, name=f"decode-{i}", daemon=True) for i in range(workers)]
        for process in processes:
            process.start()
    handed = received = 0
    try:
        while received < len(batches):
            while handed < len(batches) and handed - received < 2 * workers:
                if stop is not None and stop():
                    raise Interrupted
                tasks.put(handed)
                handed += 1
            try:
                number, batch_results, error = answers.get(timeout=0.2)  # a short wait keeps Ctrl-C deliverable
            except queue.Empty:
                if stop is not None and stop():  # every batch handed out: asked while waiting for them too
                    raise Interrupted from None
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead:
                    raise DecodingProcessDied(
                        f"a decoding process ended with exit code {dead[0].exitcode} "
                        "(out of memory?); try fewer workers or a smaller batch_tokens"
                    ) from None
                continue
            if error is not None:
                raise error
            done(batches[number], batch_results)
            received += 1
    finally:
        for process in processes:
            if received < len(batches):
                process.kill()  # an error or Ctrl-C: no batch is worth waiting for
            else:
                tasks.put(None)
        for process in processes:
            process.join()
        answers.close()


def _portable(error: BaseException) -> BaseException:
    """`error`, or a RuntimeError with its message where it cannot cross a process boundary."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(error).__name__}: {error}")
