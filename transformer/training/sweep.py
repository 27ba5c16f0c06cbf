"""Sweeps: `make sweep trainer.lr=1e-3,5e-4` (Hydra's --multirun) runs one training job per setting.

Every job trains in its own directory under runs/sweeps/..., named by its number and the values it
was given of the swept keys (`3_trainer.lr=0.001,model.dropout=0.3`: `job_name`, conf/config.yaml's
hydra.sweep.subdir), so that TensorBoard's run list says which run is which. This Hydra callback (named in
conf/config.yaml) appends a row per finished job to the sweep directory's `summary.tsv` and prints
the table, best validation BLEU first, when the sweep ends. A job that fails, whatever the error, is
recorded as failed with its one-line reason (the traceback of an unexpected error goes to its
train.log) and the sweep goes on with the next one; a sweep in which some job failed exits with 1 after
its table (as xargs does, so that `make sweep ... && next-step` stops there), one whose every job failed
with 2.
Ctrl-C (or SIGTERM) stops the sweep: the job running saves last.pt and is recorded as interrupted, the
jobs after it as not run, and the sweep exits with 130 (SIGTERM: 143) after its table.
"""

from __future__ import annotations

import csv
import logging
import sys
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from transformer.errors import signal_exit_status
from transformer.training.run_dir import override_key

log = logging.getLogger(__name__)

COLUMNS = ("job", "overrides", "status", "best_val_bleu", "run_dir", "error")

# Why the job running in this process failed: set by the training job (`job_failed`), read when it ends.
# A module variable, not the job's return value: that is the best BLEU a sweeper such as Optuna reads.
_failure: str | None = None
_status = "failed"
# The signal that stopped a job of the running sweep (SIGINT, SIGTERM): the jobs after it do not run.
_interrupted: str | None = None


# The keys the running sweep varies (`trainer.lr` of `trainer.lr=1e-3,5e-4`): set when it starts.
_swept_keys: set[str] | None = None
# Longest job directory name (file systems allow 255 bytes).
MAX_JOB_NAME = 120


def swept_keys(overrides: list[str]) -> set[str]:
    """The keys of a sweep's command-line overrides that take several values."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return {o.key_or_group for o in OverridesParser.create().parse_overrides(list(overrides)) if o.is_sweep_override()}


def job_name(number: int, overrides) -> str:
    """A sweep job's directory: its number, then its values of the swept keys (of all its overrides when
    those are unknown: another launcher's process), `/` made `_`, cut to MAX_JOB_NAME characters."""
    settings = [o for o in overrides if _swept_keys is None or override_key(o) in _swept_keys]
    name = "_".join([str(number)] + ([",".join(settings)] if settings else [])).replace("/", "_")
    return name[:MAX_JOB_NAME]


OmegaConf.register_new_resolver("transformer.sweep_job", job_name, replace=True)


def job_failed(reason: str, status: str = "failed") -> None:
    """The training job of a sweep failed (or was interrupted, or not run: `status`): its summary row
    says `reason` (one line)."""
    global _failure, _status
    _failure, _status = " ".join(reason.split()), status


def interrupt_sweep(signal_name: str) -> None:
    """A job of the sweep was stopped by `signal_name`: the jobs after it are not run."""
    global _interrupted
    _interrupted = signal_name


def sweep_interrupted() -> str | None:
    return _interrupted


def read_summary(path: Path) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle, delimiter="\t"))


def latest_rows(rows: list[dict]) -> list[dict]:
    """One row per job, its last: a sweep resumed with trainer.resume=true appends its jobs' rows again,
    and a job that failed (or was interrupted) and then finished is ok."""
    return sorted({row["job"]: row for row in rows}.values(), key=lambda row: int(row["job"]))


def format_summary(rows: list[dict]) -> str:
    """The rows as an aligned table, best validation BLEU first, failed jobs last; overrides that
    every job shares are said once, above the table."""

    def order(row):
        return (row["status"] != "ok", -float(row["best_val_bleu"] or "-inf"), int(row["job"]))

    settings = [row["overrides"].split() for row in rows]
    common = [o for o in settings[0] if all(o in s for s in settings[1:])] if rows else []
    header = ("job", "best val BLEU", "status", "swept settings")
    table = [header] + [
        (
            r["job"],
            r["best_val_bleu"] or "-",
            r["status"],
            " ".join(o for o in r["overrides"].split() if o not in common) or "-",
        )
        for r in sorted(rows, key=order)
    ]
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3] for row in table]
    failed = [r for r in sorted(rows, key=lambda r: int(r["job"])) if r["status"] != "ok"]
    lines += [f"job {r['job']} {r['status']}: {r.get('error') or 'see its train.log'}" for r in failed]
    failures = [r for r in failed if r["status"] == "failed"]
    if failures:
        lines.append(
            f"{len(failures)} of {len(rows)} jobs failed: see their train.log under the run_dir column of the .tsv"
        )
    return "\n".join(([f"common to every job: {' '.join(common)}"] if common else []) + lines)


class SweepSummary(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        global _swept_keys
        _swept_keys = swept_keys(config.hydra.overrides.task)

    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        global _failure, _status
        _failure, _status = None, "failed"

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        path = Path(config.hydra.sweep.dir) / "summary.tsv"
        completed = job_return.status == JobStatus.COMPLETED
        error = _failure if completed else f"{type(job_return._return_value).__name__}: {job_return._return_value}"
        bleu = job_return.return_value if completed and error is None else None
        row = {
            "job": str(config.hydra.job.num),
            "overrides": " ".join(job_return.overrides or ()) or "(none)",
            "status": (_status if completed else "failed") if error else "ok",
            "best_val_bleu": "" if bleu is None or bleu < 0 else f"{bleu:.2f}",
            "run_dir": config.hydra.runtime.output_dir,
            "error": " ".join((error or "").split()),
        }
        new = not path.exists()
        with open(path, "a", newline="") as handle:
            writer = csv.DictWriter(handle, COLUMNS, delimiter="\t")
            if new:
                writer.writeheader()
            writer.writerow(row)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        path = Path(config.hydra.sweep.dir) / "summary.tsv"
        if not path.exists():
            return
        rows = latest_rows(read_summary(path))
        print(f"\nsweep summary ({path}):\n{format_summary(rows)}", flush=True)
        if _interrupted:
            print(
                f"interrupted: the sweep was stopped by {_interrupted}; an interrupted job resumes with "
                f"trainer.resume=true and its hydra.run.dir (its train.log ends with the command)",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(signal_exit_status(_interrupted))
        if rows and all(r["status"] != "ok" for r in rows):
            print(
                f"error: every job of the sweep failed ({len(rows)} of {len(rows)}); the reasons are above and "
                f"in {path}",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(2)
        failed = [r for r in rows if r["status"] == "failed"]
        if failed:
            print(
                f"error: {len(failed)} of {len(rows)} jobs of the sweep failed (job{'s' if len(failed) > 1 else ''} "
                f"{', '.join(r['job'] for r in failed)}); the reasons are above and in {path}",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(1)
