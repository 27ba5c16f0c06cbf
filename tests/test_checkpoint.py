import os
import pickle
import shutil

import pytest
import torch

from tests.helpers import flip_a_byte_of
from transformer.checkpoint import (
    CheckpointError,
    average_checkpoints,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
)
from transformer.cli.average import main as average_main
from transformer.cli.translate import main as translate_main
from transformer.config import ModelConfig
from transformer.model import build_model
from transformer.training.checkpoint_dir import CheckpointDirectory


def _state(value: float) -> dict:
    return {
        "model": {"w": torch.full((2, 2), value), "n": torch.tensor(3)},
        "config": {},
        "tokenizer": {"src": b"x"},
        "step": int(value),
        "metrics": {},
    }


def test_atomic_save_leaves_no_temporary_files_and_loads_weights_only(tmp_path):
    path = tmp_path / "ck" / "last.pt"
    save_checkpoint(_state(1.0), path)
    save_checkpoint(_state(2.0), path)
    assert sorted(os.listdir(path.parent)) == ["last.pt"]
    state = torch.load(path, weights_only=True)
    assert state["step"] == 2 and state["tokenizer"]["src"] == b"x"


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint(_state(1.0), path)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(CheckpointError, match=r"last\.pt: cannot write the checkpoint: disk full"):
        save_checkpoint(_state(2.0), path)
    assert load_checkpoint(path)["step"] == 1
    assert os.listdir(tmp_path) == ["last.pt"]


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_malicious_checkpoint_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"model": _Exploit(str(marker)), "config": {}, "tokenizer": {}, "step": 0}, path)
    with pytest.raises(CheckpointError, match="refused to load"):
        load_checkpoint(path)
    assert not marker.exists()
    with open(tmp_path / "raw.pkl", "wb") as handle:  # a bare pickle, not a torch zip
        pickle.dump(_Exploit(str(marker)), handle)
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "raw.pkl")
    assert not marker.exists()


def test_truncated_missing_and_foreign_files(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint(_state(1.0), path)
    data = path.read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cut.pt: not a readable checkpoint"):
        load_checkpoint(tmp_path / "cut.pt")
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")
    for name, content, kind in (
        ("train.de", "Zwei Männer .\n", "text or another format"),
        ("empty.pt", "", "an empty file"),
    ):
        (tmp_path / name).write_text(content)  # trainer.init_from=DIR/train.de: not "unsafe content"
        with pytest.raises(CheckpointError, match=rf"{name}: not a checkpoint \({kind}, not a file torch.save wrote\)"):
            load_checkpoint(tmp_path / name)
    torch.save({"weights": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a transformer checkpoint"):
        load_checkpoint(tmp_path / "other.pt")


def test_shape_mismatch_names_the_parameter():
    small = build_model(ModelConfig(d_model=32, n_heads=4, d_ff=64), 50, 50, True)
    other_vocab = build_model(ModelConfig(d_model=32, n_heads=4, d_ff=64), 60, 60, True)
    with pytest.raises(CheckpointError, match=r"tgt_embed.weight: checkpoint \(60, 32\) vs model \(50, 32\)"):
        load_model_weights(small, other_vocab.state_dict())


def test_averaging(tmp_path, capsys):
    paths = []
    for step in (1, 2, 6):
        paths.append(tmp_path / "checkpoints" / f"step_{step}.pt")
        save_checkpoint(_state(float(step)), paths[-1])
    averaged = average_checkpoints(paths)
    assert torch.allclose(averaged["model"]["w"], torch.full((2, 2), 3.0))
    assert averaged["model"]["n"].item() == 3 and averaged["step"] == 6
    assert average_main([str(tmp_path), "--last", "2", "-o", str(tmp_path / "avg.pt")]) == 0
    assert torch.allclose(load_checkpoint(tmp_path / "avg.pt")["model"]["w"], torch.full((2, 2), 4.0))


def test_the_checkpoint_directory_keeps_the_newest_step_files(tmp_path):
    from transformer.training.checkpoint_dir import CheckpointDirectory

    checkpoints = CheckpointDirectory(tmp_path / "checkpoints", keep_last=2, is_main=True)
    for step in (2, 4, 6, 10):
        checkpoints.save_periodic(
            {"step": step, "model": {"w": torch.full((2,), float(step))}, "config": {}, "tokenizer": {}}, step
        )
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt")) == ["last.pt", "step_10.pt", "step_6.pt"]
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["step"] == 10
    CheckpointDirectory(tmp_path / "other", keep_last=2, is_main=False).save({"step": 1}, "last.pt")
    assert not (tmp_path / "other").exists()  # only the main rank writes


@pytest.mark.parametrize("background", [False, True])
def test_last_pt_is_the_newest_step_file_and_outlives_its_pruning(tmp_path, background):
    from transformer.training.checkpoint_dir import CheckpointDirectory

    checkpoints = CheckpointDirectory(tmp_path / "checkpoints", keep_last=1, is_main=True, background=background)
    for step in (2, 4):
        checkpoints.save_periodic(_state(float(step)), step)
    checkpoints.close()
    folder = tmp_path / "checkpoints"
    assert sorted(os.listdir(folder)) == ["last.pt", "step_4.pt"]  # step_2.pt pruned, no temporaries
    assert os.path.samefile(folder / "last.pt", folder / "step_4.pt")  # one file written, not two
    (folder / "step_4.pt").unlink()
    assert load_checkpoint(folder / "last.pt")["model"]["w"][0, 0].item() == 4.0


def test_last_pt_is_copied_where_the_file_system_has_no_hard_links(tmp_path, monkeypatch):
    import errno

    from transformer.training.checkpoint_dir import CheckpointDirectory

    def refuse(*args, **kwargs):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(os, "link", refuse)
    checkpoints = CheckpointDirectory(tmp_path / "checkpoints", keep_last=0, is_main=True)
    checkpoints.save_periodic(_state(3.0), 3)
    folder = tmp_path / "checkpoints"
    assert sorted(os.listdir(folder)) == ["last.pt", "step_3.pt"]
    assert not os.path.samefile(folder / "last.pt", folder / "step_3.pt")
    assert (folder / "last.pt").read_bytes() == (folder / "step_3.pt").read_bytes()


def test_a_background_save_returns_before_the_write_and_keeps_the_state_as_it_was(tmp_path, monkeypatch):
    import threading

    import transformer.checkpoint as checkpoint

    real_save, release, writing = torch.save, threading.Event(), threading.Event()

    def slow_save(*args, **kwargs):
        writing.set()
        assert release.wait(30), "the test never released the writer"
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", slow_save)
    checkpoints = CheckpointDirectory(tmp_path, keep_last=0, is_main=True, background=True)
    state, written = _state(1.0), []
    checkpoints.save(state, "last.pt", done=written.append)
    assert writing.wait(30) and not (tmp_path / "last.pt").exists() and not written  # training goes on meanwhile
    state["model"]["w"].add_(100.0)  # what the next optimizer step does to the weights
    release.set()
    checkpoints.flush()
    assert load_checkpoint(tmp_path / "last.pt")["model"]["w"][0, 0].item() == 1.0  # the state when saved
    assert len(written) == 1 and written[0] >= 0
    checkpoints.close()


def test_a_failed_background_write_is_raised_at_the_next_save_and_close_only_logs(tmp_path, monkeypatch, caplog):
    import transformer.checkpoint as checkpoint

    checkpoints = CheckpointDirectory(tmp_path, keep_last=0, is_main=True, background=True)
    checkpoints.save(_state(1.0), "last.pt")
    checkpoints.flush()

    def full(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    checkpoints.save(_state(2.0), "best.pt")  # returns: the write fails later
    with pytest.raises(
        CheckpointError,
        match=r"best\.pt: cannot write the checkpoint: disk full; "
        r"the last good checkpoint is .*last\.pt",
    ):
        checkpoints.save(_state(3.0), "best.pt")
    checkpoints.save(_state(4.0), "best.pt")  # fails again, in the background
    checkpoints.close()
    assert "best.pt: cannot write the checkpoint: disk full" in caplog.text
    assert sorted(os.listdir(tmp_path)) == ["last.pt"]


def test_a_byte_changed_on_disk_is_refused_where_it_is_read(tmp_path):
    """torch.load never checks the CRC-32s torch.save writes: a flipped bit in a weight loaded as a wrong
    weight. Translating checks the weights, resuming every record; the step can still be read."""
    state = {
        **_state(1.0),
        "model": {"embed": torch.randn(30, 8), "out": torch.randn(7)},
        "optimizer": {"exp_avg": torch.randn(11, 3)},
    }
    path = tmp_path / "last.pt"
    save_checkpoint(state, path)
    for mmap in (False, True):
        assert torch.equal(load_checkpoint(path, mmap=mmap, verify="all")["model"]["embed"], state["model"]["embed"])

    flip_a_byte_of(path, state["optimizer"]["exp_avg"])
    assert torch.equal(load_checkpoint(path, mmap=True)["model"]["out"], state["model"]["out"])  # weights intact
    with pytest.raises(
        CheckpointError,
        match=r"last.pt: damaged on disk: the bytes of a tensor \(record "
        r"[^)]*data/\d+\) no longer match the checksum",
    ):
        load_checkpoint(path, verify="all")

    save_checkpoint(state, path)
    flip_a_byte_of(path, state["model"]["embed"])
    for mmap in (False, True):
        with pytest.raises(
            CheckpointError,
            match="last.pt: damaged on disk: the bytes of weight embed no longer "
            r"match .* use another checkpoint of the run",
        ):
            load_checkpoint(path, mmap=mmap)
    assert load_checkpoint(path, verify="none")["step"] == 1


def test_translating_with_a_damaged_weight_is_one_line_and_the_intact_file_translates(
    untrained_checkpoint, tmp_path, capsys
):
    damaged = tmp_path / "best.pt"
    shutil.copy(untrained_checkpoint, damaged)
    weights = load_checkpoint(untrained_checkpoint)["model"]
    name = max(weights, key=lambda key: weights[key].numel())
    flip_a_byte_of(damaged, weights[name])
    source = tmp_path / "in.de"
    source.write_text("Ein Hund.\n")
    assert translate_main([str(untrained_checkpoint), "--input", str(source), "--max-len-b", "3"]) == 0
    capsys.readouterr()
    assert translate_main([str(damaged), "--input", str(source)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(f"transformer-translate: error: {damaged}: damaged on disk: the bytes of weight ")
        and "\n" not in err
    )


def test_a_residual_free_layer_is_rebuilt_from_the_checkpoint_and_older_checkpoints_keep_every_residual(
    untrained_checkpoint,
):
    from transformer.checkpoint import model_from_checkpoint

    state = load_checkpoint(untrained_checkpoint)
    older = {**state, "config": {**state["config"], "model": dict(state["config"]["model"])}}
    older["config"]["model"].pop("residual_free_layer", None)  # written before the key existed
    model, _, config = model_from_checkpoint(older)
    assert config.model.residual_free_layer == 0
    assert all(layer.sub_attn.residual for layer in model.encoder_layers)
    src = torch.tensor([[5, 6, 7, 3]])
    with torch.no_grad():
        usual = model.encode(src)
    freed = {**state, "config": {**state["config"], "model": {**state["config"]["model"], "residual_free_layer": 1}}}
    model, _, config = model_from_checkpoint(freed)
    assert config.model.residual_free_layer == 1
    assert [layer.sub_attn.residual for layer in model.encoder_layers] == [False, True]
    with torch.no_grad():
        assert (model.encode(src) - usual).abs().max() > 1e-3  # the same weights, another encoder
