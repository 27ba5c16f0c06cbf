"""torchrun + DDP on CPU with gloo: 2 ranks equal one process with update_freq=2; DDP resume is exact;
transformer-train-ddp (`transformer.cli.launch`) ends as transformer-train does, without torchrun's reports."""

import os
import re
import shlex
import signal
import subprocess
import sys

import pytest
import torch

from tests.helpers import FAST, ROOT, wait_for_log
from transformer.checkpoint import load_checkpoint

COMMON = FAST + [
    "trainer.precision=fp32",
    "trainer.device=cpu",
    "model.dropout=0.0",
    "trainer.validate_every=5",
    "trainer.val_max_sentences=8",
    "decode.beam_size=1",
    "trainer.max_minutes=0",
    "trainer.num_threads=1",
    "trainer.test_at_end=false",
]


LAUNCHER = [sys.executable, "-m", "transformer.cli.launch"]  # transformer-train-ddp


def _run(args, nproc=None, launcher=False):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nproc and launcher:
        command = [*LAUNCHER, "--standalone", "--nproc_per_node", str(nproc), *args]
    elif nproc:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "transformer.train",
            *args,
        ]
    else:
        command = [sys.executable, "-m", "transformer.train", *args]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _max_diff(a, b) -> float:
    pa, pb = load_checkpoint(a)["model"], load_checkpoint(b)["model"]
    return max((pa[k] - pb[k]).abs().max().item() for k in pa)


@pytest.mark.slow
def test_two_ranks_equal_one_process_with_update_freq_2(tmp_path, data_cache):
    cache = f"data.cache_dir={data_cache}"
    _run(COMMON + [cache, "trainer.max_steps=10", f"hydra.run.dir={tmp_path / 'ddp'}"], nproc=2)
    _run(COMMON + [cache, "trainer.max_steps=10", "trainer.update_freq=2", f"hydra.run.dir={tmp_path / 'single'}"])
    ddp_dir = tmp_path / "ddp" / "checkpoints"
    assert sorted(p.name for p in ddp_dir.iterdir() if "last" in p.name) == ["last.pt"]
    assert load_checkpoint(ddp_dir / "last.pt")["step"] == 10
    assert len(load_checkpoint(ddp_dir / "last.pt")["rng"]) == 2  # every rank's RNG state
    assert _max_diff(ddp_dir / "last.pt", tmp_path / "single/checkpoints/last.pt") < 1e-5
    # and it really trained: not equal to a fresh start
    assert _max_diff(ddp_dir / "last.pt", ddp_dir / "step_5.pt") > 1e-4


@pytest.mark.slow
def test_two_ranks_equal_one_process_with_back_translation_through_the_pivot(tmp_path, data_cache):
    """Issue 74's levers under DDP: each rank translates its own pairs' sources; the draws follow the pairs,
    so two ranks make the synthetic pairs that one process with update_freq=2 makes."""
    from tests.test_zero_shot import _three_languages

    common = (
        COMMON
        + _three_languages(tmp_path / "toy")
        + [f"data.cache_dir={data_cache}", "trainer.max_steps=6", "trainer.max_tokens=1500"]
        + ["data.language_tag=both", "trainer.online_backtranslation=0.5", "trainer.online_backtranslation_from=2"]
        + ["trainer.online_backtranslation_side=source"]
    )
    _run(common + [f"hydra.run.dir={tmp_path / 'ddp'}"], nproc=2)
    _run(common + ["trainer.update_freq=2", f"hydra.run.dir={tmp_path / 'single'}"])
    for run in ("ddp", "single"):
        assert (
            "their sources into a third language (en->fr->de, en->de->fr)" in (tmp_path / run / "train.log").read_text()
        )
    assert _max_diff(tmp_path / "ddp/checkpoints/last.pt", tmp_path / "single/checkpoints/last.pt") < 1e-5
    off = [o for o in common if not o.startswith("trainer.online_backtranslation=")]
    _run(off + ["trainer.update_freq=2", f"hydra.run.dir={tmp_path / 'off'}"])
    assert _max_diff(tmp_path / "off/checkpoints/last.pt", tmp_path / "single/checkpoints/last.pt") > 1e-4


@pytest.mark.slow
def test_ddp_resume_is_exact(tmp_path, data_cache):
    common = COMMON + [f"data.cache_dir={data_cache}", "model.dropout=0.1", "trainer.num_workers=1"]
    _run(common + ["trainer.max_steps=12", f"hydra.run.dir={tmp_path / 'full'}"], nproc=2)
    _run(common + ["trainer.max_steps=7", f"hydra.run.dir={tmp_path / 'split'}"], nproc=2, launcher=True)
    _run(
        common + ["trainer.max_steps=12", "trainer.resume=true", f"hydra.run.dir={tmp_path / 'split'}"],
        nproc=2,
        launcher=True,
    )
    full = load_checkpoint(tmp_path / "full/checkpoints/last.pt")["model"]
    resumed = load_checkpoint(tmp_path / "split/checkpoints/last.pt")["model"]
    for name in full:
        assert torch.equal(full[name], resumed[name]), name


@pytest.mark.slow
def test_ctrl_c_to_the_launcher_saves_last_from_every_rank_and_exits_130(tmp_path, data_cache):
    # torchrun starts each worker in a session of its own, so a terminal's Ctrl-C reaches the agent alone;
    # it passes SIGINT on to every worker once (and SIGKILLs those still running --shutdown-timeout later).
    # The ranks must agree to stop after the same step and write last.pt with both ranks' random state;
    # the launcher then exits 130 where torchrun prints a traceback.
    run_dir = tmp_path / "run"
    overrides = [
        *COMMON,
        f"data.cache_dir={data_cache}",
        "trainer.max_steps=100000",
        "trainer.validate_every=100000",
        "trainer.log_every=1",
        f"hydra.run.dir={run_dir}",
    ]
    command = [*LAUNCHER, *overrides[:3], "--nproc_per_node=2", *overrides[3:], "--standalone"]  # any order
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("MAKELEVEL", None)  # under `make test` the resume command would read `make train-ddp ...`
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    wait_for_log(run_dir / "train.log", "step 5 |", 300)
    assert proc.poll() is None, proc.stdout.read()
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does: the agent's group
    out, _ = proc.communicate(timeout=120)
    assert out.count("SIGINT received: finishing this step") == 2, out[-3000:]
    stopped = re.search(r"stopped by SIGINT at step (\d+)", out)
    assert stopped, out[-3000:]
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert state["step"] == int(stopped.group(1)) >= 5
    assert len(state["rng"]) == 2  # both ranks got as far as the save
    assert proc.returncode == 130 and "Traceback" not in out, out[-3000:]
    resume = re.search(r"continue from \S+ with: (.*)", out).group(1)
    assert resume.endswith(
        " -m transformer.cli.launch --nproc_per_node=2 --standalone "
        + shlex.join([*overrides[:-1], "trainer.resume=true", f"hydra.run.dir={run_dir}"])
    ), resume


@pytest.mark.slow
def test_the_launcher_refuses_a_bad_command_line_or_setting_in_one_line_before_any_rank_starts(tmp_path, data_cache):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [*LAUNCHER, "--standalone", "--nproc_per_node=2", *COMMON, f"data.cache_dir={data_cache}"]
    for extra, message in (
        (["model=bigg"], "error: In 'config': Could not find 'model/bigg'"),
        (["model.d_model=63"], "error: model.d_model=63 is not divisible by model.n_heads=4"),
        (
            ["data.path=/nonexistent", "data.embedded=false"],  # said by each rank that reads it
            "error: data.path=/nonexistent: no such file or directory",
        ),
    ):
        proc = subprocess.run(
            [*base, *extra, f"hydra.run.dir={tmp_path / 'run'}"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "FAILED" not in proc.stderr, proc.stderr[-3000:]
        if "data.embedded=false" in extra:  # torchrun stops the other rank once one has failed: 1 or 2
            assert proc.stderr.count(message) in (1, 2), proc.stderr[-3000:]
        else:
            assert proc.stderr.count(message) == 1, proc.stderr[-3000:]
            assert "local_rank" not in proc.stderr and not (tmp_path / "run").exists()  # no rank started
