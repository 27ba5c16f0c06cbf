import os
import pickle

import pytest
import torch

from transformer.checkpoint import (
    CheckpointError,
    average_checkpoints,
    average_main,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
)
from transformer.config import ModelConfig
from transformer.model import build_model


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((2, 2), value), "n": torch.tensor(3)}, "config": {}, "tokenizer": {"src": b"x"},
            "step": int(value), "metrics": {}}


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
    with open(tmp_path / "raw.pkl", "wb") as handle:          # a bare pickle, not a torch zip
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
    from transformer.checkpoint import CheckpointDirectory
    checkpoints = CheckpointDirectory(tmp_path / "checkpoints", keep_last=2, is_main=True)
    for step in (2, 4, 6, 10):
        checkpoints.save_periodic({"step": step, "model": {"w": torch.full((2,), float(step))}, "config": {},
                                   "tokenizer": {}}, step)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt")) == ["last.pt", "step_10.pt", "step_6.pt"]
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["step"] == 10
    CheckpointDirectory(tmp_path / "other", keep_last=2, is_main=False).save({"step": 1}, "last.pt")
    assert not (tmp_path / "other").exists()                   # only the main rank writes
