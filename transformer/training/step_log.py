"""The numbers of the training steps between two log lines, the log line itself, and the bar.

Each step adds its summed loss and NLL, correctly predicted targets, token counts and whether it was finite to
a small tensor on
the device, so that no step waits for the GPU to report them; they are read back once per log line
(`write`), which also checks the run of non-finite steps (`trainer.max_bad_steps`). On a GPU whose peak
is known the line and TensorBoard (train/mfu) also give the model FLOPs utilisation (`transformer.flops`),
counted from the host's batches: it reads nothing back either.

On a terminal the training bar counts steps towards whichever limit ends the run first (`TrainingBar`),
and log lines are written above the bars, never onto one (`log_lines_above_bars`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from transformer.console import bars_disabled
from transformer.flops import MfuMeter
from transformer.training.run_dir import TrainingError

log = logging.getLogger("transformer.train")

# The slots of TrainLog.sums (float64, on the device).
LOSS, NLL, CORRECT, FINITE_TOKENS, BAD_IN_A_ROW, BAD_IN_WINDOW, ALL_TOKENS = range(7)


@dataclass
class StepResult:
    """One update's numbers, device tensors (nothing read back): `sums` (3,) the summed loss, NLL and
    correctly predicted targets over every rank, `grad_norm` () before clipping, `finite` () bool,
    `tokens` every rank's target tokens (a tensor under DDP, else a float). `out_of_memory`: the update was
    dropped (its batch did not fit); the other fields are then None."""

    sums: torch.Tensor | None = None
    grad_norm: torch.Tensor | None = None
    finite: torch.Tensor | None = None
    tokens: torch.Tensor | float | None = None
    out_of_memory: bool = False


class TrainLog:
    def __init__(self, device: torch.device, monitor, max_bad_steps: int, mfu: MfuMeter | None = None):
        """`monitor`: the run's `transformer.training.monitor.Monitor` (TensorBoard), or None. `mfu`: the
        FLOPs counter of a CUDA run (`transformer.flops.mfu_meter`), or None: no MFU (on a CPU)."""
        self.device, self.monitor, self.max_bad_steps, self.mfu = device, monitor, max_bad_steps, mfu
        self.sums = torch.zeros(7, dtype=torch.float64, device=device)
        self.grad_norm: torch.Tensor | None = None
        self.skipped_total = 0
        self._start_window()

    def _start_window(self) -> None:
        self.sums[[LOSS, NLL, FINITE_TOKENS, BAD_IN_WINDOW, ALL_TOKENS, CORRECT]] = 0.0  # bad steps in a row carry on
        self.padding, self.steps, self.started = 0.0, 0, time.monotonic()

    def add(self, stats: StepResult, micro) -> None:
        """One step's device tensors (`TrainingStep`) and its micro-batches; reads nothing back."""
        finite = stats.finite
        bad = (~finite).double()
        sums = self.sums
        sums[LOSS : CORRECT + 1] += torch.where(finite, stats.sums, 0.0)  # loss, NLL, correct: finite steps
        sums[FINITE_TOKENS] += (1.0 - bad) * stats.tokens  # their target tokens
        sums[BAD_IN_A_ROW] = (sums[BAD_IN_A_ROW] + 1.0) * bad  # non-finite steps in a row
        sums[BAD_IN_WINDOW] += bad
        sums[ALL_TOKENS] += stats.tokens  # every rank's target tokens
        self.grad_norm = stats.grad_norm
        self.padding += sum(b.padding_share for b, _ in micro) / max(1, len(micro))
        if self.mfu is not None:
            self.mfu.add(micro)
        self.steps += 1

    def read(self) -> dict:
        """The window's sums, read back to the host (waits for the device)."""
        loss, nll, correct, finite_tokens, in_a_row, skipped, all_tokens = self.sums.tolist()
        return {
            "loss_sum": loss,
            "nll_sum": nll,
            "finite_tokens": finite_tokens,
            "bad_in_a_row": int(in_a_row),
            "skipped": int(skipped),
            "tokens": all_tokens,
            "correct": correct,
        }

    def check_finite(self, fp16: bool) -> None:
        """Stop after trainer.max_bad_steps non-finite steps in a row (x10 under fp16, whose loss scaler
        overflows routinely while it searches its scale)."""
        in_a_row = int(self.sums[BAD_IN_A_ROW])
        limit = self.max_bad_steps * (10 if fp16 else 1)
        if in_a_row >= limit:
            raise TrainingError(
                f"loss or gradients were not finite for {in_a_row} steps in a row "
                f"(trainer.max_bad_steps={self.max_bad_steps}); lower trainer.lr or "
                "use trainer.precision=bf16/fp32. Those steps were skipped: the checkpoints "
                "hold finite weights."
            )

    def write(self, step: int, epoch: int, lr: float, loss_scale: float, fp16: bool, bar) -> float:
        """The log line, TensorBoard's points (`Monitor.training`) and the progress bar; returns target tokens/s."""
        numbers = self.read()
        self.skipped_total += numbers["skipped"]
        self.check_finite(fp16)
        elapsed = time.monotonic() - self.started
        tokens = max(numbers["finite_tokens"], 1.0)
        loss, nll = numbers["loss_sum"] / tokens, numbers["nll_sum"] / tokens
        values = {
            "loss": loss,
            "nll": nll,
            "ppl": math.exp(min(nll, 50)),
            "accuracy": numbers["correct"] / tokens,
            "lr": lr,
            "grad_norm": float(self.grad_norm),
            "loss_scale": loss_scale,
            "tokens_per_s": numbers["tokens"] / max(elapsed, 1e-9),
            "padding_share": self.padding / max(1, self.steps),
            "skipped_steps": self.skipped_total,
        }
        if self.mfu is not None:
            values["mfu"] = self.mfu.read(elapsed)
        if self.monitor:
            self.monitor.training(step, epoch, values, self.device)
        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{values['tokens_per_s']:.0f}")
        log.info(
            "step %d | epoch %d | loss %.3f | nll %.3f | ppl %.2f | accuracy %.1f%% | lr %.3g | gnorm %.2f | "
            "tok/s %.0f%s | pad %.1f%%%s%s",
            step,
            epoch,
            loss,
            nll,
            values["ppl"],
            100 * values["accuracy"],
            lr,
            values["grad_norm"],
            values["tokens_per_s"],
            f" | mfu {100 * values['mfu']:.1f}%" if self.mfu is not None else "",
            100 * values["padding_share"],
            f" | loss scale {loss_scale:g}" if fp16 else "",
            f" | {numbers['skipped']} non-finite steps skipped" if numbers["skipped"] else "",
        )
        self._start_window()
        return values["tokens_per_s"]


class TrainingBar:
    """The training bar: steps done out of the steps the run will make. That is trainer.max_steps,
    unless trainer.max_minutes ends the run first: then the steps that fit in the minutes left at the
    rate measured since `started` (validations included, as for the limit), re-estimated at every step,
    so that the bar's total and its time left follow the clock. On a terminal only (stderr), rank 0."""

    def __init__(
        self, step: int, max_steps: int, max_minutes: float, started: float, show: bool = True, clock=time.monotonic
    ):
        self.max_steps, self.seconds = max_steps or None, 60.0 * max_minutes
        self.first_step, self.started, self.clock = step, started, clock
        desc = f"train ({max_minutes:g} min)" if max_minutes else "train"
        self.bar = tqdm(
            total=self.total(step),
            initial=step,
            desc=desc,
            unit="step",
            disable=bars_disabled(show),
            dynamic_ncols=True,
        )

    def total(self, step: int) -> int | None:
        """The steps the run will have made when it stops, as far as can be told at `step`."""
        done, elapsed = step - self.first_step, self.clock() - self.started
        if not self.seconds or done <= 0 or elapsed <= 0:
            return self.max_steps
        in_time = step + int(done / elapsed * max(0.0, self.seconds - elapsed))
        return in_time if self.max_steps is None else min(self.max_steps, in_time)

    def advance(self, step: int) -> None:
        """One step done (`step` is the run's step count now)."""
        self.bar.total = self.total(step)
        self.bar.update(1)

    def set_postfix(self, **values) -> None:
        self.bar.set_postfix(**values)

    def close(self, finished: bool) -> None:
        """`finished`: the run reached a limit, so the steps done are all it makes (the bar shows N/N)."""
        if finished:
            self.bar.total = self.bar.n
            self.bar.refresh()
        self.bar.close()


def _is_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in (sys.stdout, sys.stderr)


@contextlib.contextmanager
def log_lines_above_bars():
    """While open, log records for the console (stdout/stderr: Hydra's handler) are written through
    tqdm, which clears the bars, writes the line and draws them again below it: a log line never lands
    on a bar's line. tqdm's handler takes the console handler's place with its format, and here its level
    and filters too (+hydra.job_logging.handlers.console.level=WARNING keeps INFO lines off the console).
    Without a console handler (train() called as a library) nothing changes."""
    root = logging.getLogger()
    before = list(root.handlers)
    console = next((h for h in before if _is_console(h)), None)
    if console is None:
        yield
        return
    with logging_redirect_tqdm():
        for handler in root.handlers:
            if handler not in before:  # tqdm's, in the console handler's place
                handler.setLevel(console.level)
                for kept in console.filters:
                    handler.addFilter(kept)
        yield
