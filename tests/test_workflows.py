"""Workflows around training: sweeps (Hydra's --multirun) and the Makefile's pass-through of overrides."""

import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import FAST, ROOT
from transformer.training.sweep import format_summary, read_summary


@pytest.mark.slow
def test_a_sweep_survives_a_failing_job_and_summarises_by_validation_bleu(tmp_path, data_cache):
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "transformer.train",
            "--multirun",
            *FAST,
            "data.embedded_pairs=600",
            "trainer.max_steps=6",
            "trainer.validate_every=6",
            "trainer.test_at_end=false",
            f"data.cache_dir={data_cache}",
            f"hydra.sweep.dir={sweep_dir}",
            "trainer.lr=-1,1e-3,3e-3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # one job of three failed
    rows = read_summary(sweep_dir / "summary.tsv")
    assert [(r["job"], r["status"]) for r in rows] == [("0", "failed"), ("1", "ok"), ("2", "ok")]
    assert [r["overrides"].split()[-1] for r in rows] == ["trainer.lr=-1", "trainer.lr=0.001", "trainer.lr=0.003"]
    for row in rows[1:]:  # each job ran in its own directory, named by its swept value; its BLEU is the best
        job_dir = sweep_dir / f"{row['job']}_{row['overrides'].split()[-1]}"  # it validated
        assert row["run_dir"] == str(job_dir)
        assert float(row["best_val_bleu"]) >= 0 and (job_dir / "checkpoints" / "best.pt").is_file()
    assert "trainer.lr=-1.0 must be > 0" in (sweep_dir / "0_trainer.lr=-1" / "train.log").read_text()
    printed = proc.stdout[proc.stdout.index("sweep summary") :]
    assert "1 of 3 jobs failed" in printed and printed.index("trainer.lr=0.00") < printed.index("trainer.lr=-1")
    # The same sweep again into its directory: Hydra rewrote the first jobs' .hydra/ records before they
    # refused their checkpoints, and summary.tsv mixed both sweeps' rows.
    before = {p: p.read_bytes() for p in sweep_dir.rglob("*") if p.is_file()}
    again = subprocess.run(proc.args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"error: hydra.sweep.dir={sweep_dir} holds an earlier sweep (summary.tsv, multirun.yaml, 1_trainer.lr=0.001); "
        "its jobs would be overwritten and its summary mixed with this one's: choose a new hydra.sweep.dir, or add "
        "trainer.resume=true to continue that sweep's jobs"
    ], again.stderr
    assert {p: p.read_bytes() for p in sweep_dir.rglob("*") if p.is_file()} == before


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_stops_a_sweep_the_running_job_interrupted_the_rest_not_run(tmp_path, data_cache, sig):
    """Ctrl-C (or SIGTERM) stops the sweep: the running job is listed as interrupted, the jobs after it
    as not run, and the sweep exits 128 + the signal's number (130, 143)."""
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "transformer.train",
            "--multirun",
            *FAST,
            "trainer.max_steps=100000",
            "trainer.max_minutes=0",
            "trainer.test_at_end=false",
            "trainer.checkpoint_every=5",
            f"data.cache_dir={data_cache}",
            f"hydra.sweep.dir={sweep_dir}",
            "trainer.seed=1,2,3",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not list(sweep_dir.glob("0_*/checkpoints/last.pt")):
        time.sleep(0.1)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig.value, err[-3000:]
    rows = read_summary(sweep_dir / "summary.tsv")
    assert [(r["job"], r["status"]) for r in rows] == [("0", "interrupted"), ("1", "not run"), ("2", "not run")]
    assert rows[0]["error"].startswith(f"stopped by {sig.name}; last.pt resumes it")
    assert not list(sweep_dir.glob("1_*/checkpoints/*.pt"))
    assert f"interrupted: the sweep was stopped by {sig.name}" in err and "Traceback" not in err
    assert "jobs failed" not in out


def test_the_summary_puts_the_best_first_and_says_common_settings_once():
    rows = [
        {"job": "0", "overrides": "model=small trainer.lr=1", "status": "ok", "best_val_bleu": "20.00"},
        {"job": "1", "overrides": "model=small trainer.lr=2", "status": "ok", "best_val_bleu": "31.50"},
        {"job": "2", "overrides": "model=small trainer.lr=3", "status": "failed", "best_val_bleu": ""},
    ]
    lines = format_summary(rows).splitlines()
    assert lines[0] == "common to every job: model=small"
    assert [line.split()[0] for line in lines[2:5]] == ["1", "0", "2"]
    assert lines[2].endswith("trainer.lr=2") and "failed" in lines[4]


def test_make_passes_dollar_signs_and_spaces_through_to_hydra():
    proc = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "train",
            "run_dir=runs/x-${now:%Y}",
            "data.local_splits={validation: dev}",
            "ARGS=--cfg job --resolve",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "run_dir: runs/x-20" in proc.stdout  # Hydra's ${now:...}, not the shell's $$
    assert "local_splits:\n    validation: dev" in proc.stdout  # one override, space and all


def test_make_hands_hydra_the_overrides_in_the_order_typed():
    """make lists command-line variables last first; Hydra applies overrides in order and records them
    (.hydra/overrides.yaml, the resume command)."""
    typed = ["model=small", "+trainer.foo=1", "hydra.run.dir=a b", "trainer.max_steps=5", "~trainer.bar"]
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", "train", *typed, "NPROC=3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    command = next(line for line in proc.stdout.splitlines() if "transformer.cli.train" in line)
    assert command.split("transformer.cli.train ", 1)[1].split() == [
        "model=small",
        "+trainer.foo=1",
        "hydra.run.dir=a\\",
        "b",
        "trainer.max_steps=5",
        "~trainer.bar",
    ], command
