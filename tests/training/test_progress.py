"""What a user sees of a run: the training bar (its total follows the limit that ends the run), log lines
above the bars on a terminal, the banner, checkpoint and new-best lines of train.log, the command that
continues a run, and the SentencePiece reading bar."""

from __future__ import annotations

import io
import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tqdm import tqdm

from tests.helpers import FAST, ROOT, compose_config, run_on_a_terminal, screen_lines
from transformer.checkpoint import load_checkpoint
from transformer.data import tokenizer as tokenizer_module
from transformer.training.run_dir import LAUNCH_ENV, Launch
from transformer.training.step_log import TrainingBar

RUN = "runs/toy/tiny/x"


# -- the bar's total ------------------------------------------------------------------------------------


def test_the_bar_total_follows_max_minutes_when_it_binds_first():
    now = [0.0]
    bar = TrainingBar(step=0, max_steps=100000, max_minutes=1, started=0.0, show=False, clock=lambda: now[0])
    assert bar.bar.total == 100000  # nothing measured yet: at most max_steps
    for step in range(1, 48):
        now[0] = step * 12 / 47  # 47 steps in 12 s: about 235 in the minute
        bar.advance(step)
    assert bar.bar.total == 47 + int(47 / 12 * 48)
    text = tqdm.format_meter(n=47, total=bar.bar.total, elapsed=12)
    assert "47/235 " in text and "<00:48" in text, text
    # max_steps binds first: the total stays max_steps.
    bar = TrainingBar(step=10, max_steps=60, max_minutes=1, started=0.0, show=False, clock=lambda: 1.0)
    bar.advance(11)  # 1 step/s: 70 steps would fit in the minute
    assert bar.bar.total == 60
    # A resumed run measures its own steps from where it started.
    bar = TrainingBar(step=1000, max_steps=0, max_minutes=2, started=0.0, show=False, clock=lambda: 60.0)
    bar.advance(1030)
    assert bar.bar.total == 1060


# -- the command that continues a run -------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv0, environ, expected",
    [
        (
            "/repo/transformer/cli/train.py",
            {"MAKELEVEL": "1"},
            "make train model=small 'data.path=my data' trainer.resume=true hydra.run.dir=runs/toy/tiny/x "
            "'ARGS=--config-dir presets'",
        ),
        (
            "/repo/transformer/cli/train.py",
            {"MAKELEVEL": "1", "LOCAL_WORLD_SIZE": "2"},
            "make train-ddp NPROC=2 model=small 'data.path=my data' trainer.resume=true hydra.run.dir=runs/toy/tiny/x "
            "'ARGS=--config-dir presets'",
        ),
        (
            "/venv/bin/transformer-train",
            {},
            "transformer-train --config-dir presets model=small 'data.path=my data' trainer.resume=true "
            "hydra.run.dir=runs/toy/tiny/x",
        ),
        (
            "/repo/transformer/train.py",
            {"LOCAL_WORLD_SIZE": "4"},
            "torchrun --standalone --nproc_per_node=4 -m transformer.train --config-dir presets model=small "
            "'data.path=my data' trainer.resume=true hydra.run.dir=runs/toy/tiny/x",
        ),
        (
            "/repo/transformer/cli/train.py",
            {
                "LOCAL_WORLD_SIZE": "8",
                LAUNCH_ENV: "transformer-train-ddp --nnodes 2 --nproc_per_node=8 --rdzv-endpoint=host0:29500",
            },
            "transformer-train-ddp --nnodes 2 --nproc_per_node=8 --rdzv-endpoint=host0:29500 --config-dir presets "
            "model=small 'data.path=my data' trainer.resume=true hydra.run.dir=runs/toy/tiny/x",
        ),
    ],
)
def test_the_resume_command_takes_the_form_the_run_was_started_with(argv0, environ, expected, monkeypatch):
    monkeypatch.chdir(ROOT)  # where the Makefile is, as under `make`
    overrides = ["model=small", "data.path=my data", "trainer.overwrite=true"]
    argv = [argv0, "--config-dir", "presets", *overrides, "hydra.run.dir=runs/old"]
    launch = Launch.detect(argv, environ, overrides)
    assert launch.resume_command(RUN) == expected


def test_the_resume_command_of_python_dash_m_names_this_interpreter(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no Makefile here: MAKELEVEL alone (some other make) is not `make train`
    launch = Launch.detect(
        ["/repo/transformer/train.py", "trainer.resume=false"], {"MAKELEVEL": "2"}, ["trainer.resume=false"]
    )
    command = shlex.split(launch.resume_command(RUN))
    assert command[1:] == ["-m", "transformer.train", "trainer.resume=true", f"hydra.run.dir={RUN}"]
    assert command[0] == "python" or os.path.samefile(command[0], sys.executable)


@pytest.mark.parametrize("run_dir", ["runs/a,b", "runs/my run", "runs/Übersetzung", "runs/x=y", "runs/true"])
def test_the_resume_command_names_a_run_directory_hydra_reads_back(run_dir, monkeypatch, tmp_path):
    """A directory Hydra's unquoted grammar would misread (a comma makes a sweep, non-ASCII and `=` do not
    parse) is quoted for Hydra inside the shell's quoting: the printed command names the same directory."""
    from transformer.training.run_dir import named_run_directory

    monkeypatch.chdir(tmp_path)
    launch = Launch.detect(["/venv/bin/transformer-train", "model=small"], {}, ["model=small"])
    command = shlex.split(launch.resume_command(Path(run_dir)))
    assert named_run_directory(command[1:]) == Path(run_dir), command


# -- SentencePiece --------------------------------------------------------------------------------------


def test_sentencepiece_training_shows_the_lines_it_reads_on_a_terminal_only(monkeypatch, capsys, caplog):
    lines = [f"ein kleiner satz nummer {i} mit worten" for i in range(300)]
    with caplog.at_level(logging.INFO, logger="transformer.data.tokenizer"):
        tokenizer_module.train_sentencepiece(
            iter(lines), vocab_size=40, model_type="bpe", character_coverage=1.0, sample=1000, where="the test lines"
        )
    assert "SentencePiece: reading" not in capsys.readouterr().err  # not a terminal: quiet
    assert "SentencePiece: read 300 lines of the test lines" in caplog.text

    shown = io.StringIO()

    class OnATerminal(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": False, "file": shown, "mininterval": 0})

    monkeypatch.setattr(tokenizer_module, "tqdm", OnATerminal)
    tokenizer_module.train_sentencepiece(
        iter(lines), vocab_size=40, model_type="bpe", character_coverage=1.0, sample=1000
    )
    assert "SentencePiece: reading: 300 lines" in shown.getvalue(), shown.getvalue()


# -- train.log of a short run ---------------------------------------------------------------------------


@pytest.mark.slow
def test_train_log_has_the_banner_every_checkpoint_and_every_new_best(tmp_path, data_cache):
    from transformer.training.trainer import train

    run_dir, common = (
        tmp_path / "run",
        FAST
        + [
            "trainer.validate_every=10",
            "trainer.max_minutes=0",
            "trainer.test_at_end=false",
            "trainer.lr=3e-3",
            "trainer.warmup=10",
        ],
    )
    metrics = train(compose_config(common + ["trainer.max_steps=20"], data_cache), run_dir)
    text = (run_dir / "train.log").read_text()
    ckpt = run_dir.resolve() / "checkpoints"
    assert (
        f"run directory {run_dir.resolve()} (train.log, checkpoints/); TensorBoard: {run_dir.resolve() / 'tb'}" in text
    )
    assert "start: a new run (fresh weights)" in text
    assert re.search(r"device cpu \| precision \w+ \| world size 1 \| model tiny: [\d,]+ parameters", text), text
    for step in (10, 20):
        assert f"saved checkpoint {ckpt}/step_{step}.pt and {ckpt}/last.pt (step {step}, " in text
    # The run ended at step 20, just saved with its validation: last.pt is not written (or logged) again.
    assert f"saved checkpoint {ckpt}/last.pt (step 20, " not in text
    assert load_checkpoint(ckpt / "last.pt")["metrics"]["val_history"] == metrics["val_history"]
    # One new-best line per improvement, with the best before it; each followed by best.pt.
    best, step_of_best, expected = -1.0, None, []
    for result in metrics["val_history"]:
        if result["bleu"] > best:
            before = "first validation" if step_of_best is None else f"previous best {best:.2f} at step {step_of_best}"
            expected.append(
                f"new best validation BLEU {result['bleu']:.2f} at step {result['step']} (raw weights; {before})"
            )
            best, step_of_best = result["bleu"], result["step"]
    found = [line.split(" - ", 1)[1] for line in text.splitlines() if "new best validation" in line]
    assert found == expected and expected
    assert text.count(f"saved checkpoint {ckpt}/best.pt (step ") == len(expected)
    assert f"continue from {ckpt}/last.pt (raise trainer.max_steps: it ended this run)" in text

    train(compose_config(common + ["trainer.max_steps=25", "trainer.resume=true"], data_cache), run_dir)
    text = (run_dir / "train.log").read_text()
    assert f"start: resuming from {ckpt}/last.pt (step 20)" in text
    assert f"saved checkpoint {ckpt}/last.pt (step 25, " in text  # between periodic saves: saved at the end

    train(
        compose_config(common + ["trainer.max_steps=5", f"trainer.init_from={ckpt}/last.pt"], data_cache),
        tmp_path / "tuned",
    )
    assert (
        f"start: fine-tuning from the weights of {ckpt}/last.pt (step 25, trainer.init_from)"
        in (tmp_path / "tuned" / "train.log").read_text()
    )


# -- on a terminal --------------------------------------------------------------------------------------


BAR = re.compile(r"train \(0\.1 min\):\s+\d+%\|.*?\| (\d+)/(\d+) \[")


@pytest.mark.slow
def test_on_a_terminal_log_lines_stay_off_the_bar_whose_total_follows_max_minutes(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    overrides = FAST + [
        "trainer.max_steps=100000",
        "trainer.max_minutes=0.1",
        "trainer.log_every=1",
        "trainer.validate_every=100000",
        "trainer.test_at_end=false",
        "trainer.val_max_sentences=8",
        "trainer.num_workers=0",
        f"data.cache_dir={data_cache}",
    ]
    raw = run_on_a_terminal([sys.executable, "-m", "transformer.train", *overrides, f"hydra.run.dir={run_dir}"], ROOT)
    lines = screen_lines(raw)
    logged = [line for line in lines if re.search(r" - step \d+ \| epoch", line)]
    assert len(logged) >= 3, raw[-3000:]  # a log line every step: 3 steps in the 6 seconds, even on a loaded machine
    for line in logged:  # each log line on a line of its own, no bar text on it
        assert not BAR.search(line) and "step/s" not in line and "train (" not in line, line

    # The bar keeps being drawn after the log lines, and its total follows the minute's tenth.
    renders = [(m.start(), int(m.group(1)), int(m.group(2))) for m in BAR.finditer(raw)]
    first_log = re.search(r" - step 1 \| epoch", raw).start()
    later = [(n, total) for at, n, total in renders if at > first_log]
    assert len(later) >= 3 and later[-1][0] > 1, renders[-5:]
    assert all(total < 100000 for n, total in later), later
    final_n, final_total = later[-1]
    assert final_n == final_total, later[-3:]  # the run stopped where the bar said it would
    reached = re.search(r"reached trainer\.max_minutes=0\.1 at step (\d+)", raw)
    assert reached and int(reached.group(1)) == final_n

    # The command it prints continues the run, as started (python -m transformer.train, same overrides).
    hint = next(line for line in lines if "continue from" in line)
    command = shlex.split(hint.split(" with: ", 1)[1])
    assert command[1:3] == ["-m", "transformer.train"] and os.path.samefile(command[0], sys.executable)
    assert command[3:] == overrides + ["trainer.resume=true", f"hydra.run.dir={run_dir}"]
    command[command.index("trainer.max_minutes=0.1")] = "trainer.max_minutes=0.01"
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"start: resuming from {run_dir}/checkpoints/last.pt (step {final_n})" in done.stdout


@pytest.mark.slow
def test_an_error_after_a_checkpoint_says_how_to_continue(tmp_path, data_cache, monkeypatch):
    from transformer.training.selection import Selection
    from transformer.training.trainer import train

    validate, calls = Selection.validate, []

    def failing_the_second_time(self):
        calls.append(self.state.progress.step)
        if len(calls) == 2:
            raise RuntimeError("the second validation failed")
        return validate(self)

    monkeypatch.setattr(Selection, "validate", failing_the_second_time)
    config = compose_config(
        FAST
        + ["trainer.max_steps=20", "trainer.validate_every=5", "trainer.max_minutes=0", "trainer.test_at_end=false"],
        data_cache,
    )
    with pytest.raises(RuntimeError, match="second validation"):
        train(config, tmp_path)
    last = tmp_path.resolve() / "checkpoints" / "last.pt"
    assert (
        f"continue from {last}: trainer.resume=true with the run directory {tmp_path}"
        in (tmp_path / "train.log").read_text()
    )
