"""What the commands print and how a user controls it: trainer.log_level and --quiet (the package's
loggers, train.log, the progress bars), Hydra's job_logging settings honoured, a refusal printed once,
--version this package's, `python -m transformer` listing the commands."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version

import pytest

from tests.helpers import FAST, ROOT, run_on_a_terminal, screen_lines
from transformer.__main__ import COMMANDS

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

# Two steps of the tiny model, no validation before the end; the toy preset's 200 warm-up steps make the
# one warning such a run logs
TWO_STEPS = [*FAST, "trainer.max_steps=2", "trainer.validate_every=1000", "trainer.num_workers=0"]
WARMUP_WARNING = "trainer.warmup=200 is longer than the run (trainer.max_steps=2)"
BAR = re.compile(r"\[\d\d:\d\d[<,]")  # the elapsed time every tqdm bar shows: [00:01<00:02, ...] or [00:01, ...]
LOG_LINE = re.compile(r"\]\[transformer[.\w]*\]\[(DEBUG|INFO|WARNING|ERROR)\] - ")


def _ours() -> str:
    try:
        return version("transformer")
    except PackageNotFoundError:
        from transformer import __version__

        return __version__


def _run(args: list[str], cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "MAKELEVEL"}, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _levels(text: str) -> set[str]:
    return {match.group(1) for match in LOG_LINE.finditer(text)}


@pytest.mark.parametrize(
    "module",
    ["transformer", "transformer.train", *(module for _, module, _ in COMMANDS if module != "transformer.train")],
)
def test_version_is_this_packages_on_every_command(module, tmp_path):
    done = _run([sys.executable, "-m", module, "--version"], tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"transformer {_ours()} (torch "), done.stdout
    assert "Hydra" not in done.stdout and done.stderr == ""


def test_python_m_transformer_lists_every_command_a_line_each(tmp_path):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    assert [name for name, _, _ in COMMANDS] == list(scripts)
    done = _run([sys.executable, "-m", "transformer"], tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    for name, module, what in COMMANDS:
        lines = [line for line in done.stdout.splitlines() if line.split()[:1] == [name]]
        assert len(lines) == 1 and lines[0].endswith(what), done.stdout
        # `python -m MODULE`, which the listing offers, runs the console script's own main
        source = (ROOT / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8")
        target = scripts[name].split(":")[0]
        assert 'if __name__ == "__main__":' in source and (module == target or f"from {target} import main" in source)
    wrong = _run([sys.executable, "-m", "transformer", "trian"], tmp_path, timeout=60)
    assert wrong.returncode == 2 and "'trian' is not an option" in wrong.stderr


def test_a_refusal_is_printed_once_on_stderr_and_kept_in_train_log(tmp_path):
    run_dir = tmp_path / "run"
    done = _run(
        [sys.executable, "-m", "transformer.train", "data=multi30k_de_en", f"data.path={tmp_path}/none",
         "data.hub_id=null", f"hydra.run.dir={run_dir}"],
        tmp_path,
    )  # fmt: skip
    message = f"data.path={tmp_path}/none: no such file or directory"
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {message}"
    assert message not in done.stdout  # the console's log handler had it a second time
    assert message in (run_dir / "train.log").read_text()


@pytest.fixture
def package_logging():
    """The `transformer` loggers' levels and state as they were before the test."""
    loggers = {
        name: (logger.level, logger.disabled)
        for name, logger in logging.Logger.manager.loggerDict.items()
        if name.startswith("transformer") and isinstance(logger, logging.Logger)
    }
    yield
    for name, (level, disabled) in loggers.items():
        logging.getLogger(name).setLevel(level)
        logging.getLogger(name).disabled = disabled
    from transformer.training import run_log

    if run_log._log_handler is not None:
        logging.getLogger().removeHandler(run_log._log_handler)
        run_log._log_handler.close()
        run_log._log_handler = None


@pytest.mark.parametrize(
    "level, kept", [("warning", {"WARNING", "ERROR"}), ("debug", {"DEBUG", "INFO", "WARNING", "ERROR"})]
)
def test_log_level_sets_the_package_loggers_and_train_log(tmp_path, package_logging, level, kept):
    from transformer.training.run_log import attach_log_file

    logging.getLogger("transformer.data.corpus").disabled = True  # as hydra/job_logging=disabled leaves it
    attach_log_file(tmp_path, is_main=True, level=level)
    for name, say in (("transformer.train", "debug"), ("transformer.data.corpus", "info"), ("transformer", "warning")):
        getattr(logging.getLogger(name), say)("a %s line", say)
    logging.getLogger("transformer.train").error("an error line")
    written = (tmp_path / "train.log").read_text()
    assert _levels(written) == kept, written
    attach_log_file(tmp_path, is_main=True)  # null: INFO outside Hydra, so that train.log holds the run
    assert logging.getLogger("transformer").getEffectiveLevel() == logging.INFO


@pytest.mark.slow
def test_quiet_prints_warnings_and_the_score_without_bars_or_info_lines(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    raw = run_on_a_terminal(
        [sys.executable, "-m", "transformer.train", "--quiet", *TWO_STEPS, "trainer.val_max_sentences=4",
         "decode.beam_size=1", f"data.cache_dir={data_cache}", f"hydra.run.dir={run_dir}"],
        ROOT,
    )  # fmt: skip
    lines = [line for line in screen_lines(raw) if line]
    assert _levels(raw) == {"WARNING"} and WARMUP_WARNING in raw, raw[-3000:]
    assert not BAR.search(raw), raw[-3000:]  # no bar drawn, on a terminal where bars are drawn by default
    assert [line for line in lines if line.startswith("test BLEU ")] == [lines[-1]]  # the score, once
    written = (run_dir / "train.log").read_text()
    info = [line for line in written.splitlines() if "][INFO] - " in line]
    assert len(info) == 1 and info[0].endswith(lines[-1]) and WARMUP_WARNING in written  # the score, and warnings
    assert "trainer.log_level=warning" in (run_dir / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    "setting, file_levels",
    [
        ("hydra/job_logging=disabled", {"INFO", "WARNING"}),  # a silent console; train.log is the run's record
        ("hydra.job_logging.root.level=WARNING", {"WARNING"}),  # the root level: console and train.log
        ("+hydra.job_logging.handlers.console.level=WARNING", {"INFO", "WARNING"}),  # the console alone
    ],
)
def test_hydras_logging_settings_are_honoured(tmp_path, data_cache, setting, file_levels):
    run_dir = tmp_path / "run"
    done = _run(
        [sys.executable, "-m", "transformer.train", *TWO_STEPS, "trainer.test_at_end=false",
         f"data.cache_dir={data_cache}", f"hydra.run.dir={run_dir}", setting],
        ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    console = done.stdout + done.stderr
    assert _levels(console) == (set() if "disabled" in setting else {"WARNING"}), console[-2000:]
    written = (run_dir / "train.log").read_text()
    assert _levels(written) == file_levels, written[-2000:]
    if "INFO" in file_levels:
        assert "start: a new run" in written and "reached trainer.max_steps=2 at step 2" in written
