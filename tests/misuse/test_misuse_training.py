"""Misuse of training (issue 27): nothing lost, nothing silently wrong.

- trainer.resume=true where no checkpoint can resume the run is refused, never a new run over best.pt;
- a checkpoint whose weights are not all finite is never written;
- options that a resumed run ignores, or that change it, are said once;
- a sweep job that fails, whatever the error, is a failed row of the summary and the sweep goes on (and
  exits 1 at its end).
"""

import logging
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import FAST, ROOT, assert_one_line_refusal, compose_config, flip_a_byte_of, one_line
from transformer.checkpoint import CheckpointError, load_checkpoint, non_finite_tensors
from transformer.config import ConfigError, DataConfig, TrainerConfig
from transformer.distributed import DistInfo
from transformer.errors import TrainingError
from transformer.training.resume import adopt_resumed_config, find_resume_state
from transformer.training.sweep import read_summary

TRAINING_STATE = {"optimizer": {}, "scheduler": {}, "scaler": {}, "rng": [], "data_state": {}}


def _checkpoint(path: Path, step: int, *, training_state: bool = True, weights: str = "raw") -> Path:
    """A small file in the checkpoint format (what `find_resume_state` reads: keys, step, weights)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "model": {"w": torch.ones(2)},
        "config": {},
        "tokenizer": {},
        "step": step,
        "weights": weights,
        **(TRAINING_STATE if training_state else {}),
    }
    torch.save(state, path)
    return path


def _damaged(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"PK\x03\x04 truncated")
    return path


def _resume(ckpt_dir: Path, **options):
    return find_resume_state(TrainerConfig(resume=True, max_steps=1, **options), ckpt_dir, DistInfo())


# --- trainer.resume=true with nothing to resume -------------------------------------------------------


@pytest.mark.parametrize("last", ["missing", "damaged", "weights only"])
def test_resume_true_with_only_best_readable_is_refused_and_best_is_kept(tmp_path, last):
    ckpt_dir = tmp_path / "checkpoints"
    best = _checkpoint(ckpt_dir / "best.pt", 40)
    if last == "damaged":
        _damaged(ckpt_dir / "last.pt")
    elif last == "weights only":
        _checkpoint(ckpt_dir / "last.pt", 40, training_state=False)
    before = best.read_bytes()
    with pytest.raises(TrainingError) as error:
        _resume(ckpt_dir)
    message = str(error.value)
    expected = {
        "missing": "last.pt is missing",
        "damaged": "last.pt is damaged",
        "weights only": "last.pt holds no training state",
    }[last]
    assert f"trainer.resume=true finds no checkpoint to resume from ({expected}; only best.pt" in message
    assert f"trainer.init_from={best}" in message and "trainer.overwrite=true" in message and "\n" not in message
    assert best.read_bytes() == before


def test_resume_true_with_nothing_readable_is_refused(tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    _damaged(ckpt_dir / "last.pt")
    _damaged(ckpt_dir / "best.pt")
    with pytest.raises(
        TrainingError,
        match=r"\(best.pt is damaged, last.pt is damaged; nothing in it is readable\); "
        r"pass trainer.overwrite=true",
    ):
        _resume(ckpt_dir)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["best.pt", "last.pt"]


def test_resume_true_passes_over_a_damaged_last_to_the_newest_step_file(tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    _checkpoint(ckpt_dir / "step_2.pt", 2)
    _checkpoint(ckpt_dir / "step_4.pt", 4)
    _damaged(ckpt_dir / "last.pt")
    _checkpoint(ckpt_dir / "best.pt", 6)
    assert _resume(ckpt_dir)["step"] == 4


def test_resume_true_in_an_empty_directory_starts_a_new_run_and_overwrite_clears_an_unresumable_one(tmp_path):
    assert _resume(tmp_path / "checkpoints") is None
    ckpt_dir = tmp_path / "old"
    _checkpoint(ckpt_dir / "best.pt", 40)
    assert _resume(ckpt_dir, overwrite=True) is None and not ckpt_dir.exists()


def test_resuming_another_runs_checkpoint_into_a_directory_with_checkpoints_is_refused(tmp_path):
    elsewhere = _checkpoint(tmp_path / "a" / "checkpoints" / "last.pt", 7)
    ckpt_dir = tmp_path / "b" / "checkpoints"
    best = _checkpoint(ckpt_dir / "best.pt", 40)
    before = best.read_bytes()
    options = dict(resume=str(elsewhere), max_steps=1)
    with pytest.raises(TrainingError, match="already holds checkpoints of another run"):
        find_resume_state(TrainerConfig(**options), ckpt_dir, DistInfo())
    assert best.read_bytes() == before
    # its own directory's checkpoint, or an empty directory: resumed
    assert find_resume_state(TrainerConfig(**options), elsewhere.parent, DistInfo())["step"] == 7
    assert find_resume_state(TrainerConfig(**options), tmp_path / "c" / "checkpoints", DistInfo())["step"] == 7


def test_cli_resume_true_with_only_best_exits_2_with_one_line_and_best_byte_identical(tmp_path):
    best = _checkpoint(tmp_path / "checkpoints" / "best.pt", 40)
    before = best.read_bytes()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "transformer.train",
            *FAST,
            "trainer.max_steps=3",
            "trainer.resume=true",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    line = assert_one_line_refusal(proc.stderr, None)
    assert re.fullmatch(
        rf"error: {re.escape(str(tmp_path))}/checkpoints: trainer.resume=true finds no checkpoint to "
        r"resume from \(last.pt is missing; only best.pt is readable\); to fine-tune from its weights "
        r".* trainer.init_from=.*/best.pt, or pass trainer.overwrite=true .*",
        line,
    ), line
    assert best.read_bytes() == before
    assert sorted(p.name for p in best.parent.iterdir()) == ["best.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "checkpoints"]  # nor .hydra/ nor train.log


def test_a_quoted_run_directory_is_checked_before_hydra_writes_into_it(tmp_path):
    """`hydra.run.dir='runs/my run'` (quoted for Hydra) is read as Hydra reads it, so the pre-check runs
    for it too: a refused resume leaves the directory as it was."""
    from transformer.training.run_dir import named_run_directory

    run_dir = tmp_path / "my run"
    best = _checkpoint(run_dir / "checkpoints" / "best.pt", 40)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "transformer.train",
            *FAST,
            "trainer.max_steps=3",
            "trainer.resume=true",
            f"hydra.run.dir='{run_dir}'",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "finds no checkpoint to resume from" in assert_one_line_refusal(proc.stderr, None)
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "checkpoints"]  # nor .hydra/ nor train.log
    assert sorted(p.name for p in best.parent.iterdir()) == ["best.pt"]
    assert named_run_directory(["hydra.run.dir=runs/a\\ b", "x=1"]) == Path("runs/a b")  # Hydra's escape
    assert named_run_directory(['hydra.run.dir="runs/x,y"']) == Path("runs/x,y")
    assert named_run_directory(["hydra.run.dir=runs/a", "hydra.run.dir=runs/b"]) == Path("runs/b")
    for unresolved in (["hydra.run.dir=runs/${now:%H}"], ["hydra.run.dir=a,b"], ["hydra.run.dir='open"], ["x=1"]):
        assert named_run_directory(unresolved) is None, unresolved


@pytest.mark.parametrize("empty", ["hydra.run.dir=", "hydra.run.dir=''"])
def test_an_empty_run_directory_is_refused_before_anything_is_written(tmp_path, empty):
    """`hydra.run.dir=$RUN` with RUN unset wrote checkpoints, tb/ and train.log into the working directory."""
    import os

    proc = subprocess.run(
        [sys.executable, "-m", "transformer.train", *FAST, "trainer.max_steps=3", empty],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2, proc.stderr
    assert one_line(proc.stderr) == (
        "error: hydra.run.dir is empty (an unset shell variable?); name the run's directory, or leave hydra.run.dir "
        "out for runs/<data>/<model>/<time>"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "model=smal",
            "error: In 'config': Could not find 'model/smal'; available options in 'model': base, big, small, tiny",
        ),
        (
            "trainer.max_step=5",
            "error: Could not override 'trainer.max_step'.: trainer.max_step: Key 'max_step' not in "
            "'TrainerConfig'; did you mean trainer.max_steps?",
        ),
    ],
)
def test_training_refuses_a_config_hydra_cannot_compose_in_one_line_and_writes_nothing(tmp_path, override, message):
    """Hydra's own answer: several lines ending in HYDRA_FULL_ERROR, exit 1, and for a misspelt key the
    advice to write +trainer.max_step=5 (which fails next)."""
    import os

    proc = subprocess.run(
        [sys.executable, "-m", "transformer.train", override, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2, proc.stderr
    assert assert_one_line_refusal(proc.stderr, None).startswith(message)
    assert list(tmp_path.iterdir()) == []


def test_the_composition_check_lets_through_what_hydra_takes(tmp_path):
    """A search path given as hydra.searchpath, and sweeps Hydra runs from hydra.mode=MULTIRUN or a sweep
    function, are Hydra's to take: the one-line check must not refuse them."""
    from transformer.cli.train import refuse_uncomposable

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.yaml").write_text("defaults:\n  - custom\n  - _self_\npath: /corpus\nname: mine\n")
    refuse_uncomposable([f"hydra.searchpath=[file://{tmp_path}]", "data=mine"])
    refuse_uncomposable(["hydra.mode=MULTIRUN", "trainer.seed=range(3)"])
    refuse_uncomposable(["model=glob(*)"])
    refuse_uncomposable(["trainer.seed=1,2"])
    with pytest.raises(SystemExit) as refused:
        refuse_uncomposable(["data=mine"])  # without the search path: no such preset
    assert refused.value.code == 2


def test_the_cli_refuses_before_hydra_writes_into_the_run_directory(tmp_path):
    from transformer.training.resume import check_run_directory
    from transformer.training.run_dir import RunDirectoryLock

    best = _checkpoint(tmp_path / "checkpoints" / "best.pt", 40)
    elsewhere = _checkpoint(tmp_path / "other" / "last.pt", 7)
    refused = {
        ("trainer.resume=true",): "finds no checkpoint to resume from (last.pt is missing; only best.pt",
        (f"trainer.resume={elsewhere}",): "already holds checkpoints of another run",
        ("trainer.max_steps=3",): "already holds checkpoints of another run",
    }
    try:
        for overrides, message in refused.items():
            with pytest.raises(TrainingError, match=re.escape(message)):
                check_run_directory(tmp_path, ["trainer.max_steps=3", *overrides])
        check_run_directory(tmp_path, ["trainer.resume=true", "trainer.overwrite=true"])
        check_run_directory(tmp_path, [f"+trainer.resume={best.parent / 'last.pt'}"])  # its own checkpoint
    finally:
        RunDirectoryLock.acquire(tmp_path).release()  # the lock this process holds


def test_a_resume_that_leaves_out_the_runs_corpus_or_model_is_refused_with_what_to_repeat(tmp_path):
    """`make train trainer.resume=true hydra.run.dir=DIR` alone would compose the defaults (the embedded toy
    corpus, model=tiny) around the checkpoint: the run's own overrides (Hydra's record of its launch)
    must be named again; limits, decoding and the run directory may be dropped, values may change."""
    from transformer.training.resume import check_run_directory
    from transformer.training.run_dir import RunDirectoryLock

    _checkpoint(tmp_path / "checkpoints" / "last.pt", 40)
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text(
        "- data=multi30k_de_en\n- data.path=/corpora/multi30k\n- model=small\n- trainer.max_steps=500\n"
        "- decode.beam_size=2\n- hydra.run.dir=runs/my-run\n- +trainer.rdrop=2\n- trainer.lr=1e-3\n"
    )
    run_dir = f"hydra.run.dir={tmp_path}"
    try:
        with pytest.raises(TrainingError) as refused:
            check_run_directory(tmp_path, ["trainer.resume=true", run_dir])
        assert str(refused.value) == (
            f"trainer.resume: {tmp_path} was started with data=multi30k_de_en data.path=/corpora/multi30k "
            "model=small +trainer.rdrop=2, which this command leaves out (each would take its default: another "
            "corpus, model or setting); repeat them (new values are allowed), as in the command its log's last "
            "line prints"
        )
        with pytest.raises(TrainingError, match=r"started with model=small, which"):
            check_run_directory(
                tmp_path,
                ["data=multi30k_de_en", "data.path=/elsewhere", "trainer.rdrop=1", "trainer.resume=true", run_dir],
            )
        check_run_directory(
            tmp_path,
            [
                "data=multi30k_de_en",
                "data.path=/elsewhere",
                "model=small",
                "trainer.rdrop=1",
                "trainer.max_steps=900",
                "trainer.resume=true",
                run_dir,
            ],
        )
        with pytest.raises(TrainingError, match=r"started with data=multi30k_de_en"):  # from a named checkpoint
            check_run_directory(tmp_path, [f"trainer.resume={tmp_path}/checkpoints/last.pt", run_dir])
        # read unresolved: an interpolation whose variable is unset now neither fails nor escapes the check
        (tmp_path / ".hydra" / "overrides.yaml").write_text("- data.path=${oc.env:UNSET_CORPUS_DIR}/m30k\n")
        with pytest.raises(TrainingError, match=re.escape("started with data.path=${oc.env:UNSET_CORPUS_DIR}/m30k,")):
            check_run_directory(tmp_path, ["trainer.resume=true", run_dir])
        (tmp_path / ".hydra" / "overrides.yaml").write_text("{unclosed: [")  # a damaged record: no check
        check_run_directory(tmp_path, ["trainer.resume=true", run_dir])
    finally:
        RunDirectoryLock.acquire(tmp_path).release()


def test_a_resume_that_leaves_out_the_runs_config_name_or_config_dir_is_refused(tmp_path):
    """A run started with `--config-name my_exp --config-dir DIR` and resumed without them would compose
    conf/config.yaml around the checkpoint: Hydra's record of the launch (.hydra/hydra.yaml) names them."""
    from transformer.training.resume import check_run_directory
    from transformer.training.run_dir import RunDirectoryLock

    _checkpoint(tmp_path / "checkpoints" / "last.pt", 40)
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "hydra.yaml").write_text(
        "hydra:\n  run:\n    dir: ${now:%H}\n  job:\n    config_name: my_exp\n  runtime:\n    config_sources:\n"
        "    - {path: hydra.conf, schema: pkg, provider: hydra}\n"
        "    - {path: /exp/my conf, schema: file, provider: command-line}\n"
    )
    run_dir = f"hydra.run.dir={tmp_path}"
    try:
        with pytest.raises(TrainingError) as refused:
            check_run_directory(tmp_path, ["trainer.resume=true", run_dir])
        assert str(refused.value).startswith(
            f"trainer.resume: {tmp_path} was started with --config-name my_exp --config-dir '/exp/my conf', which "
            "this command leaves out"
        )
        with pytest.raises(TrainingError, match=r"started with --config-dir '/exp/my conf', which"):
            check_run_directory(tmp_path, ["--config-name=my_exp", "trainer.resume=true", run_dir])
        with pytest.raises(TrainingError, match=r"started with --config-name my_exp, which"):
            check_run_directory(tmp_path, ["-cd", "/exp/other", "trainer.resume=true", run_dir])
        check_run_directory(tmp_path, ["-cn", "other", "--config-dir=/exp/my conf", "trainer.resume=true", run_dir])
        # the default config and no --config-dir: nothing to repeat
        (tmp_path / ".hydra" / "hydra.yaml").write_text(
            "hydra:\n  job: {config_name: config}\n  runtime:\n    config_sources: [{path: x, provider: main}]\n"
        )
        check_run_directory(tmp_path, ["trainer.resume=true", run_dir])
        (tmp_path / ".hydra" / "hydra.yaml").write_text("hydra: [unclosed")  # damaged: no check
        check_run_directory(tmp_path, ["trainer.resume=true", run_dir])
    finally:
        RunDirectoryLock.acquire(tmp_path).release()


@pytest.mark.parametrize(
    "old",
    ["/corpora/a b", "/a,b", "~/m30k", "/data/Übersetzung", "true", "123", 'say "hi"', "C:\\", None, False, 1e-05],
)
def test_the_overrides_that_restore_a_checkpoints_value_parse_back_to_it(old, caplog):
    """What the warning prints is pasted into a shell and read by Hydra: both must give back the value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    saved = _saved(compose_config())
    saved["config"]["data"]["max_len_ratio"] = old  # any key a resume may change; the value is the test
    with caplog.at_level(logging.WARNING):
        adopt_resumed_config(compose_config(), saved, Path("last.pt"))
    printed = caplog.records[-1].getMessage().split("to continue it as it was, add ")[1]
    (override,) = shlex.split(printed)
    assert OverridesParser.create().parse_override(override).value() == old


def test_a_longer_decay_is_not_undone_by_the_restoring_overrides(caplog):
    schedule = ["trainer.schedule=cosine", "trainer.warmup=10"]
    saved = _saved(compose_config(schedule + ["trainer.max_steps=100", "model.dropout=0.2"]))
    with caplog.at_level(logging.WARNING):
        adopt_resumed_config(compose_config(schedule + ["trainer.max_steps=300"]), saved, Path("last.pt"))
    assert "trainer.max_steps 100 -> 300" in caplog.text
    assert caplog.text.rstrip().endswith("to continue it as it was, add model.dropout=0.2")


# --- non-finite weights are never saved ---------------------------------------------------------------


def test_non_finite_tensors_names_each_float_tensor_with_a_nan_or_an_infinity():
    tensors = {
        "a": torch.ones(3),
        "b": torch.tensor([1.0, float("nan")]),
        "c": torch.tensor([float("-inf")]),
        "ids": torch.arange(3),
        "empty": torch.zeros(0),
        "half": torch.ones(2, dtype=torch.bfloat16),
    }
    assert non_finite_tensors(tensors) == ["b", "c"]
    assert non_finite_tensors({"a": torch.ones(2), "ids": torch.arange(2)}) == []


@pytest.mark.slow
def test_weights_gone_non_finite_stop_the_run_before_any_checkpoint_holds_them(tmp_path, data_cache, monkeypatch):
    import transformer.training.trainer as train_module
    from transformer.training.step import TrainingStep

    real_step = TrainingStep.__call__

    def step_that_overflows_a_weight(self, micro):
        stats = real_step(self, micro)
        if self.state.progress.step == 2:  # the update of step 3 (finite gradients) overflows
            with torch.no_grad():
                self.state.model.output.weight.fill_(float("inf"))
        return stats

    monkeypatch.setattr(TrainingStep, "__call__", step_that_overflows_a_weight)
    cfg = compose_config(
        FAST
        + [
            "trainer.max_steps=6",
            "trainer.checkpoint_every=2",
            "trainer.validate_every=100",
            "trainer.test_at_end=false",
        ],
        data_cache,
    )
    with pytest.raises(TrainingError) as error:
        train_module.train(cfg, tmp_path)
    message = str(error.value)
    last = tmp_path / "checkpoints" / "last.pt"
    assert re.fullmatch(
        r"step 4: the weights are not finite \(.*output.weight.*\), so nothing was saved; the loss "
        rf"has not been finite since step 4; the last good checkpoint is {re.escape(str(last))} "
        r"\(step 2\): train again with a lower trainer.lr .*",
        message,
    ), message
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.pt", "step_2.pt"]
    assert load_checkpoint(last)["step"] == 2


# --- what a resumed run ignores or changes is said -----------------------------------------------------


def _saved(cfg) -> dict:
    return {"config": cfg.to_dict(), "step": 40}


def test_resume_keeps_what_the_checkpoint_fixes_and_warns_once(caplog):
    saved = _saved(compose_config())
    cfg = compose_config(
        [
            "trainer.lr=1e-3",
            "model.d_model=64",
            "data.vocab_size=300",
            "trainer.max_steps=900",
            "trainer.max_minutes=1",
            "trainer.resume=true",
            "decode.beam_size=2",
        ]
    )
    with caplog.at_level(logging.WARNING):
        adopt_resumed_config(cfg, saved, Path("run/checkpoints/last.pt"))
    assert (cfg.trainer.lr, cfg.model.d_model, cfg.data.vocab_size) == (2e-3, 128, 400)  # the checkpoint's
    assert (cfg.trainer.max_steps, cfg.trainer.max_minutes, cfg.decode.beam_size) == (900, 1, 2)  # honoured
    assert [r.getMessage() for r in caplog.records] == [
        "trainer.resume: model.d_model=64 (keeps 128), data.vocab_size=300 (keeps 400), trainer.lr=0.001 (keeps "
        "0.002) ignored: a resumed run keeps the model, tokenizer and optimizer settings of its checkpoint; to "
        "change them start a new run from its weights with trainer.init_from=run/checkpoints/last.pt"
    ]


def test_resume_says_which_changed_settings_make_it_inexact(caplog):
    saved = _saved(compose_config())
    cfg = compose_config(
        [
            "model.dropout=0.3",
            "trainer.seed=5",
            "trainer.update_freq=2",
            "data.max_len=32",
            "trainer.label_smoothing=0",
            "trainer.max_steps=700",
        ]
    )
    with caplog.at_level(logging.WARNING):
        adopt_resumed_config(cfg, saved, Path("last.pt"))
    assert [r.getMessage() for r in caplog.records] == [
        "trainer.resume: model.dropout 0.1 -> 0.3, data.max_len 64 -> 32, trainer.update_freq 1 -> 2, "
        "trainer.label_smoothing 0.1 -> 0.0, trainer.seed 1 -> 5 differ from the checkpoint: they apply from its "
        "step 40 on, so the run does not continue as the interrupted one would have (not an exact resume); to "
        "continue it as it was, add model.dropout=0.1 data.max_len=64 trainer.update_freq=1 "
        "trainer.label_smoothing=0.1 trainer.seed=1"
    ]
    assert cfg.model.dropout == 0.3 and cfg.trainer.seed == 5


def test_a_run_of_the_previous_recipe_resumed_under_the_new_one_is_told_how_to_continue_as_it_was(caplog):
    """recipe=multi30k_long gained R-Drop and dropout 0.2: a run started before resumes with them unless
    the overrides the warning prints are added, and with those added it resumes as it was (no warning)."""
    previous = [
        "data=multi30k_en_de",
        "recipe=multi30k_long",
        "trainer.rdrop=0",
        "model.dropout=0.3",
        "decode.alpha=1.5",
    ]
    saved = _saved(compose_config(previous))
    with caplog.at_level(logging.WARNING):
        adopt_resumed_config(compose_config(previous[:2]), saved, Path("last.pt"))
    message = caplog.records[-1].getMessage()
    assert message.startswith("trainer.resume: model.dropout 0.3 -> 0.2, trainer.rdrop 0.0 -> 2.0 differ")
    restoring = message.split("to continue it as it was, add ")[1].split()
    assert restoring == ["model.dropout=0.3", "trainer.rdrop=0.0"]  # decode.alpha changes no training
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        adopt_resumed_config(compose_config(previous[:2] + restoring), saved, Path("last.pt"))
    assert caplog.records == []


def test_a_changed_corpus_list_is_named_not_spelled_out(caplog):
    multi = ["data=multi30k_multi", "data.path=/corpora/multi30k"]
    saved = _saved(compose_config(multi))
    saved["config"]["data"]["corpora"] = saved["config"]["data"]["corpora"][:2]
    with caplog.at_level(logging.WARNING):
        adopt_resumed_config(compose_config(multi + ["model.dropout=0.2"]), saved, Path("last.pt"))
    assert [r.getMessage() for r in caplog.records] == [
        "trainer.resume: model.dropout 0.1 -> 0.2, data.corpora (not the checkpoint's) differ from the checkpoint: "
        "they apply from its step 40 on, so the run does not continue as the interrupted one would have (not an "
        "exact resume); to continue it as it was, add model.dropout=0.1 and data.corpora as in the checkpoint's "
        "config"
    ]


def test_resume_with_a_decaying_schedule_says_a_new_max_steps_moves_the_decay(caplog):
    schedule = ["trainer.schedule=cosine", "trainer.warmup=10"]
    saved = _saved(compose_config(schedule + ["trainer.max_steps=100"]))
    with caplog.at_level(logging.WARNING):
        adopt_resumed_config(compose_config(schedule + ["trainer.max_steps=300"]), saved, Path("last.pt"))
    assert "trainer.max_steps 100 -> 300 differ from the checkpoint" in caplog.text


def test_resume_of_a_checkpoint_older_than_a_fixed_key_keeps_that_keys_default(caplog):
    """Checkpoints written before trainer.weight_decay_norm_bias decayed every parameter (one optimizer
    group): resumed with the key false, they keep it true, whose state they hold, and say so."""
    saved = _saved(compose_config())
    del saved["config"]["trainer"]["weight_decay_norm_bias"]
    cfg = compose_config(["trainer.weight_decay_norm_bias=false"])
    with caplog.at_level(logging.WARNING):
        adopt_resumed_config(cfg, saved, Path("last.pt"))
    assert cfg.trainer.weight_decay_norm_bias is True
    assert "trainer.weight_decay_norm_bias=False (keeps True) ignored" in caplog.text


def test_resume_with_the_checkpoints_lr_checks_the_config_again():
    saved = _saved(compose_config(["trainer.lr=1e-4"]))
    cfg = compose_config(["trainer.lr=1e-3", "trainer.min_lr=5e-4"])
    with pytest.raises(ConfigError, match=r"trainer.min_lr=0.0005 must be in \[0, trainer.lr=0.0001\]"):
        adopt_resumed_config(cfg, saved, Path("last.pt"))


def test_resume_and_overwrite_together_warn_that_overwrite_is_ignored(tmp_path, caplog):
    _checkpoint(tmp_path / "last.pt", 3)
    with caplog.at_level(logging.WARNING):
        assert _resume(tmp_path, overwrite=True)["step"] == 3
    assert "trainer.overwrite=true is ignored: trainer.resume=true continues the run" in caplog.text
    assert (tmp_path / "last.pt").exists()


def test_an_update_freq_beyond_an_epoch_and_a_warmup_beyond_the_run_are_said(caplog):
    from transformer.data.batching import TokenBatchSampler
    from transformer.training.banner import warn_about_settings_the_run_cannot_honour

    sampler = TokenBatchSampler([9] * 40, [9] * 40, max_tokens=100, seed=1)  # 10 pairs a batch: 4 batches
    assert len(sampler.batches(0)) == 4

    def warnings_for(*overrides):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            warn_about_settings_the_run_cannot_honour(compose_config(list(overrides)), sampler, world=1)
        return [r.getMessage() for r in caplog.records]

    assert warnings_for("trainer.update_freq=4", "trainer.max_tokens=100") == []
    assert warnings_for("trainer.update_freq=5", "trainer.max_tokens=100") == [
        "trainer.update_freq=5 asks for more batches per update than an epoch has (4 of at most trainer.max_tokens=100 "
        "tokens): every update takes the whole epoch, 4 batches; lower trainer.update_freq to 4 or less, or "
        "trainer.max_tokens"
    ]
    assert warnings_for("trainer.warmup=1000", "trainer.max_steps=250") == [
        "trainer.warmup=1000 is longer than the run (trainer.max_steps=250): the learning rate rises to 25% of "
        "trainer.lr=0.002 and never reaches it; lower trainer.warmup"
    ]


# --- sweeps -------------------------------------------------------------------------------------------

# The training job replaced by one that returns a BLEU, or raises an unexpected error for the seeds given.
SWEEP = """
import sys
import transformer.training.trainer as train_module
failing = {int(seed) for seed in sys.argv[1].split(",") if seed}
def train(cfg, run_dir):
    if cfg.trainer.seed in failing:
        raise RuntimeError(f"unexpected failure of seed {cfg.trainer.seed}")
    return {"best_bleu": 10.0 + cfg.trainer.seed}
train_module.train = train
sys.argv = ["train", *sys.argv[2:]]
from transformer.cli.train import main
main()
"""


def _sweep(tmp_path, failing: str):
    return subprocess.run(
        [sys.executable, "-c", SWEEP, failing, "--multirun", "trainer.seed=1,2", f"hydra.sweep.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_sweep_job_failing_with_any_error_is_a_failed_row_and_the_summary_prints(tmp_path):
    proc = _sweep(tmp_path, "1")
    assert proc.returncode == 1 and proc.stderr.strip() == (  # the table printed, then a non-zero exit
        f"error: 1 of 2 jobs of the sweep failed (job 0); the reasons are above and in {tmp_path / 'summary.tsv'}"
    )
    rows = read_summary(tmp_path / "summary.tsv")
    assert [(r["job"], r["status"], r["best_val_bleu"], r["error"]) for r in rows] == [
        ("0", "failed", "", "RuntimeError: unexpected failure of seed 1"),
        ("1", "ok", "12.00", ""),
    ]
    summary = proc.stdout[proc.stdout.index("sweep summary") :]
    assert "job 0 failed: RuntimeError: unexpected failure of seed 1" in summary and "1 of 2 jobs failed" in summary
    assert "Traceback" in (tmp_path / "0_trainer.seed=1" / "train.log").read_text()  # for whoever debugs it
    resumed = subprocess.run(
        [*proc.args[:3], "", *proc.args[4:], "trainer.resume=true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )  # the failed job now succeeds
    assert resumed.returncode == 0 and resumed.stderr == "", resumed.stderr
    assert [(r["job"], r["status"]) for r in read_summary(tmp_path / "summary.tsv")] == [
        ("0", "failed"),
        ("1", "ok"),
        ("0", "ok"),
        ("1", "ok"),
    ]  # the .tsv keeps the history
    summary = resumed.stdout[resumed.stdout.index("sweep summary") :]
    assert "failed" not in summary and summary.count(" ok ") == 2  # the table: each job's last row


def test_a_sweep_whose_every_job_failed_exits_2_with_one_line(tmp_path):
    proc = _sweep(tmp_path, "1,2")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: every job of the sweep failed (2 of 2); the reasons are above and in {tmp_path / 'summary.tsv'}"
    )
    assert "job 1 failed: RuntimeError: unexpected failure of seed 2" in proc.stdout


def test_ctrl_c_before_the_training_loop_is_one_line_and_exit_130(tmp_path):
    # KeyboardInterrupt while the data is prepared (the loop's SIGINT handler is not installed yet).
    stub = (
        "import sys\nimport transformer.training.trainer as t\n"
        "def train(cfg, run_dir):\n    raise KeyboardInterrupt\n"
        "t.train = train\nsys.argv = ['train', *sys.argv[1:]]\n"
        "from transformer.cli.train import main\nmain()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", stub, f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        f"interrupted: stopped at once; checkpoints written before now stay in {tmp_path}/checkpoints"
    )


def test_resume_true_skips_a_checkpoint_damaged_on_disk_for_the_step_before_it(tmp_path, caplog):
    """A bit flipped in last.pt's optimizer state (bytes torch.load never checks) would resume the run
    with a wrong moment estimate: the run resumes from the newest intact step instead, saying so."""
    ckpt_dir = tmp_path / "checkpoints"
    older = _checkpoint(ckpt_dir / "step_3.pt", 3)
    last = ckpt_dir / "last.pt"
    exp_avg = torch.randn(5, 7)
    torch.save(
        {
            "model": {"w": torch.ones(2)},
            "config": {},
            "tokenizer": {},
            "step": 4,
            "weights": "raw",
            **TRAINING_STATE,
            "optimizer": {"exp_avg": exp_avg},
        },
        last,
    )
    assert _resume(ckpt_dir)["step"] == 4
    flip_a_byte_of(last, exp_avg)
    with caplog.at_level("WARNING"):
        assert _resume(ckpt_dir)["step"] == 3
    assert f"skipping {last}: damaged on disk: the bytes of a tensor" in caplog.text
    with pytest.raises(CheckpointError, match="damaged on disk"):
        find_resume_state(TrainerConfig(resume=str(last), max_steps=1), ckpt_dir, DistInfo())
    assert older.exists() and last.exists()


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "trainer.lr=1e-3,abc",
            "error: Error merging override trainer.lr=abc: trainer.lr: Value 'abc' of type 'str' could "
            "not be converted to Float",
        ),
        ("model=tiny,nope", "error: In 'config': Could not find 'model/nope'; available options in 'model'"),
        (
            "trainer.nokey=1,2",
            "error: Could not override 'trainer.nokey'.: trainer.nokey: Key 'nokey' not in 'TrainerConfig'",
        ),
    ],
)
def test_a_sweep_with_a_value_hydra_cannot_compose_is_refused_in_one_line_before_any_job(tmp_path, override, message):
    """Under --multirun the composition check stood aside: Hydra's several lines, exit 1 and a sweep
    directory left behind (or the first jobs trained before the bad value's)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "transformer.train",
            "--multirun",
            override,
            "trainer.seed=1,2",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert assert_one_line_refusal(proc.stderr, None).startswith(message)
    assert not (tmp_path / "sweep").exists()


def test_the_sweep_check_composes_each_value_once_and_leaves_other_sweeps_to_hydra():
    from transformer.cli.train import sweep_jobs_to_check

    assert sweep_jobs_to_check(["model=small", "trainer.lr=1e-3,2e-3", "model.dropout=0.1,0.2,0.3"]) == [
        ["model=small", "trainer.lr=0.001", "model.dropout=0.1"],
        ["model=small", "trainer.lr=0.002", "model.dropout=0.1"],
        ["model=small", "trainer.lr=0.001", "model.dropout=0.2"],
        ["model=small", "trainer.lr=0.001", "model.dropout=0.3"],
    ]
    assert sweep_jobs_to_check(["data.path='a,b'", "trainer.max_steps=5"]) == [
        ["data.path='a,b'", "trainer.max_steps=5"]
    ]
    assert sweep_jobs_to_check(["trainer.lr=range(1,3)"]) == [] and sweep_jobs_to_check(["trainer.lr=[1,"]) == []
    assert sweep_jobs_to_check(["model=glob(*)"]) == []


def test_hydra_job_chdir_is_refused_in_one_line(tmp_path):
    """With it, a relative data.path was looked for inside the new run directory ("no such file") and
    the corpus cache was made again inside every run."""
    proc = subprocess.run(
        [sys.executable, "-m", "transformer.train", "hydra.job.chdir=true", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        proc.returncode == 2
        and proc.stderr.startswith("error: hydra.job.chdir=true: training reads relative paths")
        and proc.stderr.count("\n") == 1
    )
    assert not (tmp_path / "run").exists()


def test_hydra_flags_it_answers_with_a_traceback_or_several_lines_are_one_line(tmp_path):
    """`-m --cfg job` and a bare `--shell-completion` were Hydra tracebacks; `-cn nope` eight lines; a
    missing --config-dir Hydra's message and exit 1 (transformer-prepare already said it in one line)."""
    from transformer.cli.train import hydra_flag_error

    (tmp_path / "mine.yaml").write_text("defaults:\n  - config\n  - _self_\n")
    refused = {
        ("-m", "--cfg", "job", "trainer.lr=1,2"): "--multirun and --cfg do not go together",
        ("--shell-completion",): "--shell-completion needs install=SHELL",
        ("-cn", "nope"): "--config-name nope: no nope.yaml in ",
        ("--config-name=nope", "--config-dir", str(tmp_path)): f"--config-name nope: no nope.yaml in .* or {tmp_path}",
        ("--config-dir", str(tmp_path / "missing"), "--cfg", "job"): "--config-dir .*missing: no such directory",
        ("hydra.job.chdir=True",): "hydra.job.chdir=true: training reads relative paths",
    }
    for argv, message in refused.items():
        assert re.match(message, hydra_flag_error(list(argv)) or ""), argv
    for argv in (
        ["--cfg", "job"],
        ["-cn", "config"],
        ["-cn", "mine", "-cd", str(tmp_path)],
        ["-m", "trainer.lr=1,2"],
        ["--shell-completion", "install=bash"],
        ["--config-path", "x", "-cn", "nope"],
    ):
        assert hydra_flag_error(argv) is None, argv


def test_a_resumed_checkpoint_whose_config_holds_an_interpolation_is_refused(monkeypatch):
    """Issue 71, class 4: a saved config is plain values; `${...}` in one was written by hand and is not
    resolved when a run resumes from it either."""
    monkeypatch.setenv("TRANSFORMER_TEST_SECRET", "s3cr3t-token")
    saved = {"config": compose_config().to_dict()}
    saved["config"]["trainer"]["warmup"] = "${oc.env:TRANSFORMER_TEST_SECRET}"
    with pytest.raises(TrainingError) as refused:
        adopt_resumed_config(compose_config(), saved, Path("run/checkpoints/last.pt"))
    assert str(refused.value) == (
        "run/checkpoints/last.pt: its stored config cannot be resumed: "
        "trainer.warmup='${oc.env:TRANSFORMER_TEST_SECRET}': a saved config holds plain values, not "
        "interpolations (a run resolves them before it saves); this one was written by hand and is not "
        "resolved: remove it"
    )


@pytest.mark.parametrize("cache_dir", ["", " "])
def test_an_empty_cache_directory_is_refused_not_the_working_directory(cache_dir):
    """data.cache_dir='' wrote spm/ and corpus/ into the working directory."""
    with pytest.raises(ConfigError, match=r"^data.cache_dir='\s*' is empty; give a directory"):
        compose_config(["data=toy", f"data.cache_dir='{cache_dir}'"])


def test_validation_pairs_that_are_training_pairs_are_counted_once_and_said(tmp_path, caplog, monkeypatch):
    """A validation split copied from the training split was accepted in silence."""
    from transformer.data import overlap
    from transformer.data.prepare import prepare
    from transformer.data.sources import InMemory
    from transformer.data.toy import generate

    src, tgt = generate(200, 10, 10, seed=3)["train"]
    config = DataConfig(name="unit", embedded=True, vocab_size=80, cache_dir=str(tmp_path), drop_duplicates=False)

    def prepared(valid_src, valid_tgt):
        sources = {"train": InMemory(src, tgt, "unit"), "validation": InMemory(valid_src, valid_tgt, "unit")}
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            data = prepare(config, sources=sources)
        return data, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    data, said = prepared(src[:30], tgt[:30])
    assert said == [
        "unit.validation: all 30 validation pairs are also training pairs: validation loss and BLEU then measure "
        "memorisation, not translation; hold them out of the training data"
    ]
    other = generate(40, 10, 10, seed=4)["train"]
    _, said = prepared(src[:5] + other[0][:15], tgt[:5] + other[1][:15])
    assert len(said) == 1 and "5 of 20 validation pairs are also training pairs" in said[0]
    _, said = prepared(src[:5], tgt[5:10])  # training sources with other targets: other pairs
    assert said == []
    # the keys: equal exactly for equal pairs (against Python tuples of the ids)
    train = data.train
    keys = overlap.pair_keys(train)
    (src_ids, src_offsets), (tgt_ids, tgt_offsets) = train.stored("src"), train.stored("tgt")
    pairs = [
        (tuple(src_ids[src_offsets[p] : src_offsets[p + 1]]), tuple(tgt_ids[tgt_offsets[p] : tgt_offsets[p + 1]]))
        for p in train.pair_index
    ]
    for i in range(len(pairs)):
        for j in range(i + 1, len(pairs)):
            assert (keys[i] == keys[j]) == (pairs[i] == pairs[j])
    monkeypatch.setattr(overlap, "pair_keys", lambda corpus: pytest.fail("counted again"))
    _, said = prepared(src[:30], tgt[:30])  # counted once for this training data and split
    assert len(said) == 1 and "all 30 validation pairs" in said[0]
