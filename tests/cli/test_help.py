"""`--help` shows every key of the one schema (type, default, meaning) and every preset; transformer-prepare
takes the same arguments as transformer-train: --help, --config-dir DIR, --cfg job, key=value."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import yaml

from tests.helpers import ROOT
from transformer.cli import prepare as prepare_command
from transformer.config import CONF_DIR, Config

SECTIONS = ("model", "data", "trainer", "decode")


def schema_fields(schema: type = Config, prefix: str = ""):
    """(dotted key, dataclass field, default) of every leaf of the schema, walked here, not by the code."""
    for spec in dataclasses.fields(schema):
        default = spec.default if spec.default is not dataclasses.MISSING else spec.default_factory()
        if dataclasses.is_dataclass(default):
            yield from schema_fields(type(default), f"{prefix}{spec.name}.")
        else:
            yield prefix + spec.name, spec, default


def as_override(value) -> str:
    if isinstance(value, list):  # as an override writes it: [tensorboard], [0.9, 0.98]
        return "[" + ", ".join(map(as_override, value)) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def run(module: str, *args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.fixture(scope="module")
def train_help() -> str:
    proc = run("transformer.train", "--help")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return proc.stdout


@pytest.fixture
def preset_dir(tmp_path):
    """A user's preset directory: DIR/data/mypreset.yaml, a small embedded corpus."""
    (tmp_path / "presets" / "data").mkdir(parents=True)
    (tmp_path / "presets" / "data" / "mypreset.yaml").write_text(
        "# @package _global_\ndata:\n  name: mypreset\n  embedded: true\n  embedded_pairs: 300\n"
        "  vocab_size: 120\n  max_len: 64\n"
    )
    return tmp_path / "presets"


def test_every_schema_key_is_in_the_train_help_with_its_type_default_and_meaning(train_help):
    keys = list(schema_fields())
    assert len(keys) > 70
    for key, spec, default in keys:
        meaning = spec.metadata.get("help", "")
        assert meaning.strip(), f"{key} has no meaning in the schema"
        kind = spec.metadata.get("type", spec.type)
        # KEY: TYPE = DEFAULT, then the meaning on the lines below (wrapped, indented)
        block = re.search(
            rf"^  {re.escape(key)}: {re.escape(kind)} = {re.escape(as_override(default))}"
            rf"(?: -> .*)?\n((?:      .*\n?)+)",
            train_help,
            re.MULTILINE,
        )
        assert block, f"{key}: {kind} = {as_override(default)} is not in --help"
        assert " ".join(block[1].split()) == " ".join(meaning.split()), key


def test_the_help_lists_every_preset_and_marks_the_picked_one(train_help):
    presets = {}  # group -> its options, wrapped lines joined
    for line in train_help[train_help.index("\nPresets") : train_help.index("\nKeys")].splitlines():
        if re.match(r"  [a-z]+=", line):
            group = line.strip().split("=", 1)[0]
            presets[group] = line
        elif line.startswith("      ") and presets:
            presets[group] += " " + line.strip()
    for group in [path.name for path in CONF_DIR.iterdir() if path.is_dir()]:
        for option in (path.stem for path in (CONF_DIR / group).glob("*.yaml")):
            assert re.search(rf"[=| ]{option}\*?(?: |$)", presets[group]), f"{group}={option} not in --help"
    assert "tiny*" in presets["model"] and "toy*" in presets["data"] and "beam*" in presets["decode"]
    assert "default*" in presets["trainer"] and "(none picked)" in presets["recipe"]
    for section in SECTIONS:
        assert f"\n[{section}] " in train_help


def test_the_help_fits_100_columns_and_starts_with_the_usage(train_help):
    assert max(len(line) for line in train_help.splitlines()) <= 100
    head = train_help[: train_help.index("Presets")]
    for usage in ("make train", "--config-dir DIR", "--cfg job", "key=value".upper(), "GROUP=OPTION"):
        assert usage in head


def test_prepare_help_exits_0_with_the_same_presets_and_keys(train_help):
    proc = run("transformer.cli.prepare", "--help")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith("transformer-prepare: ")
    assert proc.stdout[proc.stdout.index("\nPresets") :] == train_help[train_help.index("\nPresets") :]


def test_help_with_overrides_shows_the_values_they_give(capsys):
    prepare_command.main(["--help", "model=small", "trainer.lr=0.01"])
    out = capsys.readouterr().out
    assert "  model.d_model: int = 128 -> 256\n" in out and "  trainer.lr: float = 0.0007 -> 0.01\n" in out
    assert "  model.n_heads: int = 4\n" in out  # unchanged by model=small: no arrow
    assert "model=tiny | base | big | small*" in out


def test_prepare_uses_a_user_preset_from_config_dir_and_makes_no_run_directory(
    preset_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "cache"
    prepare_command.main(["--config-dir", str(preset_dir), "data=mypreset", f"data.cache_dir={cache}"])
    assert "prepared mypreset: 300 training pairs" in capsys.readouterr().out
    assert any(path.name.startswith("mypreset.train.") for path in (cache / "corpus").iterdir())
    assert sorted(path.name for path in tmp_path.iterdir()) == ["cache", "presets"]  # no runs/, no outputs/


def test_cfg_job_prints_the_composed_config_the_same_for_train_and_prepare(preset_dir, capsys):
    args = ["--config-dir", str(preset_dir), "data=mypreset", "model=small", "trainer.lr=0.01", "--cfg", "job"]
    prepare_command.main(args)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["name"] == "mypreset" and printed["data"]["embedded_pairs"] == 300
    assert printed["model"]["d_model"] == 256 and printed["trainer"]["lr"] == 0.01
    assert set(printed) == {"model", "data", "trainer", "decode", "run_dir"}  # the job's config, no hydra node
    train = run("transformer.train", *args)
    assert train.returncode == 0 and yaml.safe_load(train.stdout) == printed


def test_cfg_job_resolve_resolves_interpolations(capsys):
    prepare_command.main(["--cfg", "job", "run_dir=runs/x-${now:%Y}"])
    assert "run_dir: runs/x-${now:%Y}" in capsys.readouterr().out
    prepare_command.main(["--cfg", "job", "--resolve", "run_dir=runs/x-${now:%Y}"])
    assert re.search(r"run_dir: runs/x-20\d\d\n", capsys.readouterr().out)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--multirun"],
            "error: transformer-prepare: unrecognized arguments: --multirun; it takes key=value "
            "overrides, --config-dir DIR, --cfg job [--resolve], --quiet, --version and --help",
        ),
        (["--cfg", "hydra"], "error: transformer-prepare: argument --cfg/-c: invalid choice: 'hydra'"),
        (["--config-dir"], "error: transformer-prepare: argument --config-dir/-cd: expected one argument"),
        (
            ["--config-dir", "no/such/dir"],
            "error: --config-dir no/such/dir: no such directory; give the directory "
            "that holds your presets (DIR/data/NAME.yaml, then data=NAME)",
        ),
        (
            ["data=mypresett"],
            "error: In 'config': Could not find 'data/mypresett'; available options in 'data': "
            "custom, iwslt17_de_en, multi30k_de_en, multi30k_en_de, multi30k_multi, mypreset, toy",
        ),
    ],
)
def test_prepare_refuses_what_it_cannot_take_in_one_line(args, message, preset_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        prepare_command.main(["--config-dir", str(preset_dir), *args] if "--config-dir" not in args else args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(message) and err.count("\n") == 1, err
    assert [path.name for path in tmp_path.iterdir()] == ["presets"]
