"""transformer-export and transformer-average misused (issue 27): `--force` replaces only a previous export
and `-o` only a previous average; a checkpoint from a newer release, with a damaged tokenizer or with
non-finite weights, and a full disk while exporting, each end in one line (exit 2) with nothing lost.
Nothing here trains: the checkpoint is an untrained tiny model with a small SentencePiece model."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_one_line_refusal, one_line, run_main, write_untrained_checkpoint
from transformer.checkpoint import (
    CHECKPOINT_FORMAT_VERSION,
    CheckpointError,
    load_checkpoint,
    model_from_checkpoint,
    non_finite_tensors,
    save_checkpoint,
)
from transformer.cli import export as export_command
from transformer.cli.average import main as average_main
from transformer.cli.evaluate import main as evaluate_main
from transformer.cli.translate import main as translate_main
from transformer.config import ConfigError
from transformer.inference import model_directory, pretrained

try:
    import ctranslate2  # noqa: F401

    FORMATS = ["safetensors", "ctranslate2"]
except ImportError:  # the [export] extra is not installed: the safetensors format only
    FORMATS = ["safetensors"]

EXPORT, AVERAGE = "transformer-export", "transformer-average"  # the programs' names, which start their refusals


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """best.pt of an untrained tiny model, as training writes it (weights, config, tokenizer, step), in a run
    directory of this module's own."""
    return write_untrained_checkpoint(tmp_path_factory.mktemp("run") / "checkpoints" / "best.pt")


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _export(capsys, checkpoint, out, fmt, *extra):
    return run_main(export_command.main, capsys, checkpoint, out, "--format", fmt, *extra)


# ----- 1. --force replaces a previous export and nothing else ------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_force_refuses_a_directory_that_merely_holds_a_config_json(fmt, checkpoint, tmp_path, capsys):
    project = tmp_path / "p"
    (project / "src").mkdir(parents=True)
    (project / "config.json").write_text("{}\n")
    (project / "src" / "main.py").write_text("x\n")
    before = _tree(project)
    code, _, err = _export(capsys, checkpoint, project, fmt, "--force")
    assert code == 2
    assert "is not an exported model (it holds config.json, src)" in assert_one_line_refusal(err, EXPORT)
    assert _tree(project) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]  # no staging directory left behind


@pytest.mark.parametrize("fmt", FORMATS)
def test_force_from_inside_the_directory_loses_nothing(fmt, checkpoint, tmp_path, capsys, monkeypatch):
    project = tmp_path / "p"
    (project / "src").mkdir(parents=True)
    (project / "config.json").write_text("{}\n")
    (project / "src" / "main.py").write_text("x\n")
    before = _tree(project)
    monkeypatch.chdir(project)
    code, _, err = _export(capsys, checkpoint, ".", fmt, "--force")
    assert code == 2 and "config.json, src" in assert_one_line_refusal(err, EXPORT)
    assert _tree(project) == before and Path.cwd() == project

    # Even a directory that holds only a previous export is not replaced from inside it; from below it,
    # the directory the shell is in is not the export's, so it is named and kept.
    shutil.rmtree(project / "src")
    (project / "config.json").unlink()
    monkeypatch.chdir(tmp_path)
    assert _export(capsys, checkpoint, project, fmt, "--force")[0] == 0
    exported = _tree(project)
    monkeypatch.chdir(project)
    code, _, err = _export(capsys, checkpoint, ".", fmt, "--force")
    assert code == 2 and "is the current directory or holds it" in assert_one_line_refusal(err, EXPORT)
    (project / "sub").mkdir()
    monkeypatch.chdir(project / "sub")
    code, _, err = _export(capsys, checkpoint, "..", fmt, "--force")
    assert code == 2 and "did not write (sub)" in assert_one_line_refusal(err, EXPORT)
    assert _tree(project) == exported and (project / "sub").is_dir()


@pytest.mark.parametrize("fmt", FORMATS)
def test_reexport_into_an_export_holding_user_files_keeps_them(fmt, checkpoint, tmp_path, capsys):
    out = tmp_path / "model"
    assert _export(capsys, checkpoint, out, fmt)[0] == 0
    manifest = json.loads((out / model_directory.MANIFEST_FILE).read_text())
    assert manifest["format"] == fmt and sorted(manifest["files"]) == sorted(p.name for p in out.iterdir())
    (out / "notes.md").write_text("my notes\n")
    (out / "extra").mkdir()
    (out / "extra" / "data.txt").write_text("keep\n")
    shutil.copy(checkpoint, out / "best.pt")
    before = _tree(out)
    code, _, err = _export(capsys, checkpoint, out, fmt, "--force")
    assert code == 2
    assert "holds files the previous export did not write (best.pt, extra, notes.md)" in assert_one_line_refusal(
        err, EXPORT
    )
    assert _tree(out) == before

    for name in ("notes.md", "best.pt"):
        (out / name).unlink()
    shutil.rmtree(out / "extra")
    (out / "config.json").write_text("edited\n")  # an export's own file, edited: replaced with --force
    code, out_text, err = _export(capsys, checkpoint, out, fmt, "--force")
    assert code == 0, err
    assert (out / "config.json").read_text() != "edited\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_force_replaces_an_hf_export_from_before_manifests(checkpoint, tmp_path, capsys):
    out = tmp_path / "model"
    assert _export(capsys, checkpoint, out, "hf")[0] == 0
    for name in (
        model_directory.MANIFEST_FILE,
        model_directory.CARD_FILE,
    ):  # as exports were written before the manifest
        (out / name).unlink()
    assert _export(capsys, checkpoint, out, "hf", "--force")[0] == 0
    assert (out / model_directory.MANIFEST_FILE).is_file()
    for name in (model_directory.MANIFEST_FILE, model_directory.CARD_FILE):
        (out / name).unlink()
    (out / "notes.txt").write_text("mine\n")
    code, _, err = _export(capsys, checkpoint, out, "hf", "--force")
    assert (
        code == 2
        and "(notes.txt)" in assert_one_line_refusal(err, EXPORT)
        and (out / "notes.txt").read_text() == "mine\n"
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_force_refuses_a_file_and_a_checkpoint_directory(fmt, checkpoint, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine\n")
    code, _, err = _export(capsys, checkpoint, tmp_path / "notes.txt", fmt, "--force")
    assert code == 2 and "notes.txt: exists and is not a directory" in assert_one_line_refusal(err, EXPORT)
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
    before = _tree(checkpoint.parent)
    code, _, err = _export(capsys, checkpoint, checkpoint.parent, fmt, "--force")
    assert code == 2 and "is not an exported model (it holds best.pt)" in assert_one_line_refusal(err, EXPORT)
    assert _tree(checkpoint.parent) == before
    code, _, err = _export(capsys, checkpoint, tmp_path / "notes.txt" / "model", fmt)
    assert code == 2 and "a part of" in assert_one_line_refusal(err, EXPORT) and "is a file, not a directory" in err
    for target in (tmp_path / "notes.txt", checkpoint.parent):  # without --force: no advice --force refuses
        code, _, err = _export(capsys, checkpoint, target, fmt)
        assert (
            code == 2
            and "--force to replace" not in err
            and "choose a new directory" in assert_one_line_refusal(err, EXPORT)
        )


# ----- 6. a full disk while exporting ------------------------------------------------------------------


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("failure", ["enospc", "bare-oserror", "runtime-error"])
def test_a_failed_write_says_what_failed_and_keeps_the_previous_export(
    fmt, failure, checkpoint, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "model"
    assert _export(capsys, checkpoint, out, fmt)[0] == 0
    previous = _tree(out)

    def fail(*args, **kwargs):
        if failure == "enospc":
            _disk_full()
        if failure == "bare-oserror":  # CTranslate2's: no errno, no filename, no strerror
            raise OSError()
        try:  # a writer that wraps the OSError (as torch does)
            _disk_full()
        except OSError as error:
            raise RuntimeError("write failed") from error

    if fmt == "safetensors":
        import safetensors.torch

        monkeypatch.setattr(safetensors.torch, "save_model", fail)
    else:
        from ctranslate2.specs import model_spec

        monkeypatch.setattr(model_spec.ModelSpec, "_serialize", fail)
    code, _, err = _export(capsys, checkpoint, out, fmt, "--force")
    assert code == 2
    reason = "OSError" if failure == "bare-oserror" else "No space left on device"
    assert one_line(err) == f"transformer-export: error: {out}: cannot write the export: {reason}"
    assert _tree(out) == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging directory left behind

    code, _, err = _export(capsys, checkpoint, tmp_path / "new", fmt)
    assert code == 2 and "cannot write the export" in assert_one_line_refusal(err, EXPORT)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_full_disk_in_safetensors_own_words(checkpoint, tmp_path, capsys, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    monkeypatch.setattr(safetensors.torch, "save_model", full)
    code, _, err = _export(capsys, checkpoint, tmp_path / "model", "hf")
    assert code == 2 and assert_one_line_refusal(err, EXPORT).endswith(
        "model: cannot write the export: No space left on device"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_writing_the_json_and_the_tokenizer(checkpoint, tmp_path, capsys, monkeypatch):
    real_write_text, real_write_bytes = Path.write_text, Path.write_bytes
    for method, real in (("write_text", real_write_text), ("write_bytes", real_write_bytes)):
        monkeypatch.setattr(Path, method, lambda self, *a, **k: _disk_full())
        code, _, err = _export(capsys, checkpoint, tmp_path / "model", "hf")
        assert code == 2 and assert_one_line_refusal(err, EXPORT).endswith(
            "cannot write the export: No space left on device"
        ), method
        assert list(tmp_path.iterdir()) == []
        monkeypatch.setattr(Path, method, real)


def test_interrupted_export_keeps_the_previous_one(checkpoint, tmp_path, capsys, monkeypatch):
    out = tmp_path / "model"
    assert _export(capsys, checkpoint, out, "hf")[0] == 0
    previous = _tree(out)
    real_replace, renames = os.replace, []

    def interrupt_second_rename(src, dst):  # Ctrl-C once the previous export was moved aside
        renames.append(dst)
        if len(renames) == 2:
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(model_directory.os, "replace", interrupt_second_rename)
    code, _, err = _export(capsys, checkpoint, out, "hf", "--force")
    monkeypatch.setattr(model_directory.os, "replace", real_replace)
    assert code == 130 and one_line(err) == "transformer-export: interrupted; nothing was exported"
    assert _tree(out) == previous and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


# ----- 2. transformer-average -o replaces only an earlier average --------------------------------------


def test_average_replaces_an_earlier_average_and_with_force_anything(checkpoint, tmp_path, capsys):
    avg = tmp_path / "avg.pt"
    assert run_main(average_main, capsys, checkpoint, "-o", avg)[0] == 0
    assert run_main(average_main, capsys, checkpoint, "-o", avg)[0] == 0  # an earlier average: replaced
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    code, _, err = run_main(average_main, capsys, checkpoint, "-o", notes)
    assert (
        code == 2
        and "exists and is not an averaged checkpoint written by transformer-average"
        in assert_one_line_refusal(err, AVERAGE)
    )
    assert notes.read_text() == "mine\n"
    assert run_main(average_main, capsys, checkpoint, "-o", notes, "--force")[0] == 0
    assert load_checkpoint(notes)["metrics"]["averaged_from"] == [str(checkpoint)]
    code, _, err = run_main(average_main, capsys, checkpoint, "-o", checkpoint, "--force")  # never an input
    assert code == 2 and "is one of the checkpoints being averaged" in assert_one_line_refusal(err, AVERAGE)
    code, _, err = run_main(average_main, capsys, checkpoint, "-o", tmp_path / "typo" / "avg.pt")
    assert (
        code == 2
        and "the directory " in assert_one_line_refusal(err, AVERAGE)
        and "typo does not exist; create it first" in err
    )
    assert not (tmp_path / "typo").exists()


def test_average_refuses_a_checkpoint_given_twice_and_a_resume_point_as_output(checkpoint, tmp_path, capsys):
    """The same file twice (or through a link) doubled its weight with exit 0; -o last.pt --force replaced
    a run's resume point with weights only."""
    link = tmp_path / "link.pt"
    link.symlink_to(checkpoint)
    for inputs in ((checkpoint, checkpoint), (checkpoint, link)):
        code, _, err = run_main(average_main, capsys, *inputs, "-o", tmp_path / "avg.pt")
        assert (
            code == 2
            and "given twice (or through a link); each checkpoint is averaged once"
            in assert_one_line_refusal(err, AVERAGE)
        )
    assert not (tmp_path / "avg.pt").exists()
    state = load_checkpoint(checkpoint)
    last = tmp_path / "last.pt"
    save_checkpoint({**state, "optimizer": {"state": {}, "param_groups": []}}, last)
    before = last.read_bytes()
    code, _, err = run_main(average_main, capsys, checkpoint, "-o", last, "--force")
    assert code == 2 and "holds a run's training state (it resumes the run)" in assert_one_line_refusal(err, AVERAGE)
    assert last.read_bytes() == before
    for directory in (checkpoint.parent, checkpoint.parent.parent):  # was: .../checkpoints/checkpoints/best.pt
        with pytest.raises(
            CheckpointError, match=f"is a directory, not a checkpoint file; did you mean {checkpoint}\\?"
        ):
            load_checkpoint(directory)
    (tmp_path / "folder").mkdir()
    with pytest.raises(CheckpointError, match="is a directory, not a checkpoint file; a checkpoint is a run's "):
        load_checkpoint(tmp_path / "folder")


def test_average_refuses_to_write_a_non_finite_average(checkpoint, tmp_path, capsys):
    state = load_checkpoint(checkpoint)
    name = next(iter(state["model"]))
    state["model"][name][0] = float("nan")
    save_checkpoint(state, tmp_path / "diverged.pt")
    code, _, err = run_main(average_main, capsys, checkpoint, tmp_path / "diverged.pt", "-o", tmp_path / "avg.pt")
    assert code == 2 and f"holds NaN or infinite values in {name}" in assert_one_line_refusal(err, AVERAGE)
    assert not (tmp_path / "avg.pt").exists()


def test_average_refuses_checkpoints_of_another_vocabulary_and_a_last_that_picks_nothing(checkpoint, tmp_path, capsys):
    state = load_checkpoint(checkpoint)
    other = tmp_path / "other.pt"  # the same shapes, another SentencePiece model
    save_checkpoint({**state, "tokenizer": {**state["tokenizer"], "src": state["tokenizer"]["src"] + b"x"}}, other)
    code, _, err = run_main(average_main, capsys, other, checkpoint, "-o", tmp_path / "avg.pt")
    assert code == 2 and "other.pt: its SentencePiece vocabulary differs from that of" in assert_one_line_refusal(
        err, AVERAGE
    )
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for step in (1, 2, 3):
        save_checkpoint({**state, "step": step}, run / "checkpoints" / f"step_{step}.pt")
    for last in ("0", "-2"):
        code, _, err = run_main(average_main, capsys, run, f"--last={last}", "-o", tmp_path / "avg.pt")
        assert code == 2 and f"--last {last}: must be a whole number >= 1" in assert_one_line_refusal(err, AVERAGE)
    code, _, err = run_main(average_main, capsys, checkpoint, checkpoint, "--last", "1", "-o", tmp_path / "avg.pt")
    assert code == 2 and "--last picks step checkpoints from a run directory" in assert_one_line_refusal(err, AVERAGE)
    assert run_main(average_main, capsys, run, "--last", "2", "-o", tmp_path / "avg.pt")[1].startswith(
        "averaged 2 checkpoints (step_2.pt, step_3.pt)"
    )


# ----- 3. the checkpoint format version ----------------------------------------------------------------


def test_a_checkpoint_from_a_newer_release_is_refused_and_an_old_one_loads(checkpoint, tmp_path, capsys):
    state = torch.load(checkpoint, weights_only=True)
    assert state["format_version"] == CHECKPOINT_FORMAT_VERSION
    newer = tmp_path / "newer.pt"
    torch.save({**state, "format_version": CHECKPOINT_FORMAT_VERSION + 1}, newer)
    with pytest.raises(CheckpointError, match=r"newer.pt: written by a newer version of this package .*; upgrade"):
        load_checkpoint(newer)
    for main, prog, args in (
        (translate_main, "transformer-translate", [newer, "--input", checkpoint]),
        (export_command.main, EXPORT, [newer, tmp_path / "x", "--format", "hf"]),
        (average_main, AVERAGE, [newer, "-o", tmp_path / "avg.pt"]),
    ):
        code, _, err = run_main(main, capsys, *args)
        assert code == 2 and "written by a newer version of this package" in assert_one_line_refusal(err, prog)
    old = tmp_path / "old.pt"
    torch.save({k: v for k, v in state.items() if k != "format_version"}, old)
    model_from_checkpoint(load_checkpoint(old), old)
    assert run_main(average_main, capsys, old, "-o", tmp_path / "avg.pt")[0] == 0
    assert torch.load(tmp_path / "avg.pt", weights_only=True)["format_version"] == CHECKPOINT_FORMAT_VERSION
    torch.save({**state, "format_version": "2"}, tmp_path / "odd.pt")
    with pytest.raises(CheckpointError, match="format_version '2' is not a whole number"):
        load_checkpoint(tmp_path / "odd.pt")


# ----- 4 and 5. a damaged tokenizer, non-finite weights ------------------------------------------------


def _damaged(checkpoint, directory, **changes) -> Path:
    state = load_checkpoint(checkpoint)
    state.update(changes)
    path = directory / "damaged.pt"
    save_checkpoint(state, path)
    return path


@pytest.mark.parametrize(
    "tokenizer,problem",
    [
        ({"src": b"\x00garbage\xff" * 8, "tgt": None}, "is not a SentencePiece model"),
        ({}, "is missing"),
        ("spm", "is missing"),
        ({"src": None}, "is missing"),
    ],
)
def test_a_damaged_embedded_tokenizer_is_one_line(tokenizer, problem, checkpoint, tmp_path, capsys):
    path = _damaged(checkpoint, tmp_path, tokenizer=tokenizer)
    with pytest.raises(CheckpointError, match=f"damaged.pt: its embedded tokenizer {problem}"):
        model_from_checkpoint(load_checkpoint(path), path)
    (tmp_path / "in.de").write_text("Der Hund.\n")
    for main, prog, args in (
        (translate_main, "transformer-translate", [path, "--input", tmp_path / "in.de"]),
        (export_command.main, EXPORT, [path, tmp_path / "x", "--format", "hf"]),
        (evaluate_main, "transformer-evaluate", [path, "--src", tmp_path / "in.de", "--ref", tmp_path / "in.de"]),
    ):
        code, out, err = run_main(main, capsys, *args)
        assert code == 2 and f"its embedded tokenizer {problem}" in assert_one_line_refusal(err, prog), (main, err)
    assert not (tmp_path / "x").exists()


def test_an_empty_tokenizer_is_named_before_sentencepiece_sees_it(checkpoint, capfd):
    # (torch cannot store b"" under weights_only; a state dict built in code can hold it)
    state = load_checkpoint(checkpoint)
    for entry in ({"src": b"", "tgt": None}, {"src": state["tokenizer"]["src"], "tgt": b""}):
        with pytest.raises(CheckpointError, match="best.pt: its embedded tokenizer is empty"):
            model_from_checkpoint({**state, "tokenizer": entry}, checkpoint)
    assert capfd.readouterr().err == ""  # no SentencePiece log lines


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(value, checkpoint, tmp_path, capsys):
    state = load_checkpoint(checkpoint)
    name = sorted(k for k, v in state["model"].items() if v.is_floating_point())[3]
    weights = {k: v.clone() for k, v in state["model"].items()}
    weights[name].view(-1)[-1] = value
    assert non_finite_tensors(weights) == [name] and non_finite_tensors(state["model"]) == []
    path = _damaged(checkpoint, tmp_path, model=weights)
    with pytest.raises(CheckpointError, match=f"damaged.pt: weight {name} holds NaN or infinite values"):
        model_from_checkpoint(load_checkpoint(path), path)
    (tmp_path / "in.de").write_text("Der Hund.\n")
    for main, prog, args in (
        (translate_main, "transformer-translate", [path, "--input", tmp_path / "in.de"]),
        (export_command.main, EXPORT, [path, tmp_path / "x", "--format", FORMATS[-1]]),
        (evaluate_main, "transformer-evaluate", [path, "--src", tmp_path / "in.de", "--ref", tmp_path / "in.de"]),
    ):
        code, _, err = run_main(main, capsys, *args)
        assert code == 2 and f"weight {name} holds NaN or infinite values" in assert_one_line_refusal(err, prog)
    assert not (tmp_path / "x").exists()


def test_an_exported_directory_with_non_finite_weights_is_refused(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    model, tokenizer, config = model_from_checkpoint(load_checkpoint(checkpoint))
    out = pretrained.save_pretrained(model, tokenizer, config, tmp_path / "hf")
    weights = load_file(out / model_directory.WEIGHTS_FILE)
    name = sorted(weights)[0]
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, out / model_directory.WEIGHTS_FILE, metadata={"format": model_directory.FORMAT_NAME})
    manifest = json.loads((out / model_directory.MANIFEST_FILE).read_text())
    manifest["sha256"][model_directory.WEIGHTS_FILE] = model_directory.file_sha256(
        out / model_directory.WEIGHTS_FILE
    )  # NaN as exported
    (out / model_directory.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"model.safetensors: weight {name} holds NaN"):
        pretrained.load_pretrained(out)
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = float("inf")
    with pytest.raises(CheckpointError, match="the model: weight .* holds NaN or infinite values"):
        pretrained.save_pretrained(model, tokenizer, config, tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_a_damaged_config_or_model_entry_is_one_line(checkpoint, tmp_path):
    for changes, problem in (
        ({"config": "x"}, "its stored config is not a mapping"),
        ({"model": {"w": "not a tensor"}}, "its model entry is not a set of named tensors"),
    ):
        path = _damaged(checkpoint, tmp_path, **changes)
        with pytest.raises(CheckpointError, match=problem):
            model_from_checkpoint(load_checkpoint(path), path)


def test_a_checkpoint_whose_config_a_new_run_would_refuse_still_loads(checkpoint, tmp_path):
    """Checks added for new runs (subword_nbest with BPE, a test direction no corpus trains) do not lock
    out checkpoints saved before them."""
    state = load_checkpoint(checkpoint)
    data = {
        **state["config"]["data"],
        "subword_nbest": 4,
        "tokenizer_type": "bpe",
        "corpora": [{"path": "/somewhere", "src_lang": "fr", "tgt_lang": "en"}],
    }
    older = tmp_path / "older.pt"
    save_checkpoint({**state, "config": {**state["config"], "data": data}}, older)
    _, _, config = model_from_checkpoint(load_checkpoint(older), older)
    assert config.data.subword_nbest == 4
    with pytest.raises(ConfigError, match="data.subword_nbest=4 applies to unigram sampling only"):
        config.data.validate_for_training()


# ----- a stored config is never resolved (issue 71, class 4) ------------------------------------------


def test_a_stored_config_with_an_interpolation_is_refused_and_resolves_nothing(
    checkpoint, tmp_path, capsys, monkeypatch
):
    """A checkpoint or config.json edited to hold `${oc.env:...}`: loading it would copy the environment
    variable into what is exported; every loader refuses it, naming the key, and writes nothing."""
    monkeypatch.setenv("TRANSFORMER_TEST_SECRET", "s3cr3t-token")
    state = load_checkpoint(checkpoint)
    state["config"]["data"]["name"] = "${oc.env:TRANSFORMER_TEST_SECRET}"
    edited = tmp_path / "edited.pt"
    save_checkpoint(state, edited)
    out = tmp_path / "export"
    code, stdout, err = _export(capsys, edited, out, "safetensors")
    line = assert_one_line_refusal(err, EXPORT)
    assert code == 2 and stdout == "" and not out.exists()
    assert "data.name='${oc.env:TRANSFORMER_TEST_SECRET}': a saved config holds plain values" in line
    assert "s3cr3t-token" not in err
    code, _, err = run_main(translate_main, capsys, edited, "--input", checkpoint)
    assert code == 2 and "data.name='${oc.env:TRANSFORMER_TEST_SECRET}'" in assert_one_line_refusal(
        err, "transformer-translate"
    )
    # An export's config.json edited the same way (nested inside a list too) is refused by its reader.
    assert _export(capsys, checkpoint, tmp_path / "clean", "safetensors")[0] == 0
    meta = json.loads((tmp_path / "clean" / "config.json").read_text())
    meta["config"]["data"]["corpora"] = [{"path": "${oc.env:TRANSFORMER_TEST_SECRET}"}]
    (tmp_path / "clean" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"data\.corpora\.path='\$\{oc\.env:TRANSFORMER_TEST_SECRET\}'"):
        pretrained.load_pretrained(tmp_path / "clean")
