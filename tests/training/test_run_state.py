"""The training state a checkpoint holds (`run_state.TrainingState`), saved and loaded without training:
every part a resume needs comes back, and what must not be written is refused."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tests.helpers import FAST, compose_config
from transformer import distributed as D
from transformer.checkpoint import (
    TRAINING_STATE_KEYS,
    average_checkpoints,
    load_checkpoint,
    model_from_checkpoint,
    step_checkpoints,
)
from transformer.data.tokenizer import Tokenizer
from transformer.model import build_model
from transformer.training.checkpoint_dir import CheckpointDirectory
from transformer.training.optim import build_optimizer
from transformer.training.resume import WeightsOnly, find_resume_state
from transformer.training.run_dir import TrainingError
from transformer.training.state import TrainingState

CORPUS = "toy.train.0123abcd"


def _state(
    untrained_checkpoint, tmp_path, seed: int, world_size: int = 1, corpus: str = CORPUS, extra: list[str] = ()
) -> TrainingState:
    """Fresh parts as `Trainer` builds them: a model with weights drawn from `seed`, AdamW, the schedule,
    a disabled loss scaler, an EMA (trainer.ema_decay=0.9); `extra` overrides."""
    cfg = compose_config(FAST + ["trainer.ema_decay=0.9", "trainer.keep_last=2", "trainer.warmup=4", *extra])
    tokenizer = Tokenizer.from_state_dict(load_checkpoint(untrained_checkpoint)["tokenizer"])
    torch.manual_seed(seed)
    model = build_model(cfg.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint)
    optimizer, scheduler = build_optimizer(model, cfg.trainer, torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    checkpoints = CheckpointDirectory(tmp_path / "checkpoints", cfg.trainer.keep_last, is_main=True)
    return TrainingState(
        cfg,
        model,
        tokenizer,
        optimizer,
        scheduler,
        scaler,
        checkpoints,
        corpus,
        D.DistInfo(world_size=world_size),
        torch.device("cpu"),
        bad_in_a_row=lambda: 2,
    )


def _update(state: TrainingState) -> None:
    """One optimizer update of a stand-in loss, as the loop records it."""
    loss = sum((p.float() ** 2).sum() for p in state.model.parameters()) * 1e-3
    loss.backward()
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.progress.step += 1
    state.progress.position += 3
    state.ema.update(state.progress.step)


def test_loading_a_saved_state_restores_weights_optimizer_schedule_ema_progress_and_random_streams(
    untrained_checkpoint, tmp_path
):
    saved = _state(untrained_checkpoint, tmp_path, seed=0)
    for step in range(1, 6):
        _update(saved)
        if step == 3:
            saved.progress.record_validation({"loss": 3.0, "bleu": 7.5, "weights": "raw"})
        saved.save("last.pt", periodic=True)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt"))
    assert names == ["last.pt", "step_4.pt", "step_5.pt"]  # trainer.keep_last=2
    saved.save("best.pt", weights="ema")
    best = load_checkpoint(tmp_path / "checkpoints" / "best.pt")
    ema_weights = saved.ema.model_state(saved.model)
    assert best["weights"] == "ema"
    assert all(torch.equal(best["model"][k], ema_weights[k]) for k in ema_weights)
    assert not all(torch.equal(best["model"][k], v) for k, v in saved.model.state_dict().items())
    after_save = torch.rand(4)  # the stream the interrupted run would have drawn next

    torch.manual_seed(99)  # a new process: other random streams, other weights
    resumed = _state(untrained_checkpoint, tmp_path, seed=1)
    resumed.load(load_checkpoint(tmp_path / "checkpoints" / "last.pt"))
    assert torch.equal(torch.rand(4), after_save)
    for key, value in saved.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[key], value), key
    first = next(iter(saved.optimizer.state.values()))
    again = next(iter(resumed.optimizer.state.values()))
    assert all(torch.equal(first[k], again[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert resumed.scheduler.get_last_lr() == saved.scheduler.get_last_lr()
    assert resumed.scheduler.last_epoch == 5
    assert all(torch.equal(resumed.ema.model_state(resumed.model)[k], v) for k, v in ema_weights.items())
    assert (resumed.progress.step, resumed.progress.position) == (5, 15)
    assert (resumed.progress.best_bleu, resumed.progress.best_step) == (7.5, 3)
    # The next update continues the interrupted run's exactly.
    _update(saved)
    _update(resumed)
    assert all(torch.equal(a, b) for a, b in zip(saved.model.parameters(), resumed.model.parameters()))


def test_non_finite_weights_are_not_saved_and_the_error_names_the_last_good_checkpoint(untrained_checkpoint, tmp_path):
    state = _state(untrained_checkpoint, tmp_path, seed=0)
    _update(state)
    state.save("last.pt", periodic=True)
    before = (tmp_path / "checkpoints" / "last.pt").read_bytes()
    _update(state)
    with torch.no_grad():
        next(state.model.parameters())[0, 0] = float("nan")
    with pytest.raises(TrainingError) as error:
        state.save("last.pt", periodic=True)
    message = str(error.value)
    assert "step 2: the weights are not finite" in message
    assert "not been finite since step 1" in message  # bad_in_a_row() = 2
    assert f"last good checkpoint is {tmp_path / 'checkpoints' / 'last.pt'} (step 1)" in message
    assert (tmp_path / "checkpoints" / "last.pt").read_bytes() == before
    assert not (tmp_path / "checkpoints" / "step_2.pt").exists()


def test_a_resume_with_another_process_count_or_corpus_is_refused_or_said(untrained_checkpoint, tmp_path, caplog):
    state = _state(untrained_checkpoint, tmp_path, seed=0)
    _update(state)
    state.save("last.pt")
    checkpoint = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    with pytest.raises(TrainingError, match="written with 1 processes; resume with the same number \\(now 2\\)"):
        _state(untrained_checkpoint, tmp_path, seed=0, world_size=2).load(checkpoint)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="transformer"):
        _state(untrained_checkpoint, tmp_path, seed=0).load(checkpoint)
        assert not caplog.records
        _state(untrained_checkpoint, tmp_path, seed=0, corpus="toy.train.99999999").load(checkpoint)
    assert "the training corpus differs" in caplog.text


def test_best_and_step_files_hold_the_weights_only_and_last_pt_the_training_state(untrained_checkpoint, tmp_path):
    saved = _state(untrained_checkpoint, tmp_path, seed=0)
    for _ in range(2):
        _update(saved)
        saved.save("last.pt", periodic=True)
    saved.save("best.pt", weights="ema")
    folder = tmp_path / "checkpoints"
    last, step, best = (load_checkpoint(folder / name) for name in ("last.pt", "step_2.pt", "best.pt"))
    assert set(TRAINING_STATE_KEYS) <= set(last)  # exact resume reads all of it
    for weights_only in (step, best):
        assert not set(TRAINING_STATE_KEYS) & set(weights_only), sorted(weights_only)
        assert {"model", "config", "tokenizer", "step", "metrics", "weights"} <= set(weights_only)
    assert step["step"] == last["step"] == 2 and step["weights"] == "raw" and best["weights"] == "ema"
    assert all(torch.equal(step["model"][k], v) for k, v in last["model"].items())  # the raw weights of last.pt
    ema = saved.ema.model_state(saved.model)
    assert all(torch.equal(best["model"][k], ema[k]) for k in ema)
    assert not os.path.samefile(folder / "last.pt", folder / "step_2.pt")
    # last.pt: the weights, Adam's two moments and the EMA (4 x 0.7 MB) beside the tokenizer and config
    # (0.3 MB) that the weights-only files hold too: these are a third of it (a quarter for larger models)
    size = {name: (folder / name).stat().st_size for name in ("last.pt", "step_2.pt", "best.pt")}
    assert size["step_2.pt"] < 0.36 * size["last.pt"] and size["best.pt"] < 0.36 * size["last.pt"], size
    # A weights-only file still rebuilds the model (translate, evaluate, export read nothing else)
    model, _, _ = model_from_checkpoint(step, folder / "step_2.pt")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in step["model"].items())


def test_full_checkpoints_make_every_file_resumable(untrained_checkpoint, tmp_path):
    saved = _state(untrained_checkpoint, tmp_path, seed=0, extra=["trainer.full_checkpoints=true"])
    _update(saved)
    saved.save("last.pt", periodic=True)
    saved.save("best.pt")
    folder = tmp_path / "checkpoints"
    assert os.path.samefile(folder / "last.pt", folder / "step_1.pt")  # one file, two names
    assert set(TRAINING_STATE_KEYS) <= set(load_checkpoint(folder / "best.pt"))
    resumed = _state(untrained_checkpoint, tmp_path / "other", seed=1)
    resumed.load(load_checkpoint(folder / "step_1.pt"))
    assert resumed.progress.step == 1


def test_resuming_from_a_weights_only_file_is_refused_in_one_line_naming_last_pt(
    untrained_checkpoint, tmp_path, caplog
):
    saved = _state(untrained_checkpoint, tmp_path, seed=0)
    for _ in range(3):
        _update(saved)
        saved.save("last.pt", periodic=True)
    saved.save("best.pt")
    folder = tmp_path / "checkpoints"
    for name in ("step_3.pt", "best.pt"):
        tc = compose_config(FAST + [f"trainer.resume={folder / name}"]).trainer
        with pytest.raises(WeightsOnly) as refused:
            find_resume_state(tc, folder, D.DistInfo())
        message = str(refused.value)
        assert "\n" not in message
        assert message.startswith(f"{folder / name}: holds weights only (best.pt and step_N.pt of a run are, unless ")
        assert f"resume from {folder / 'last.pt'}" in message and f"trainer.init_from={folder / name}" in message
    # trainer.resume=true takes last.pt and passes over the weights-only step files without a warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="transformer"):
        state = find_resume_state(compose_config(FAST + ["trainer.resume=true"]).trainer, folder, D.DistInfo())
    assert state["step"] == 3 and "optimizer" in state and not caplog.records


def test_weights_only_step_files_average(untrained_checkpoint, tmp_path, capsys):
    from transformer.cli.average import main as average_main

    saved = _state(untrained_checkpoint, tmp_path, seed=0, extra=["trainer.keep_last=0"])
    for _ in range(3):
        _update(saved)
        saved.save("last.pt", periodic=True)
    paths = step_checkpoints(tmp_path)
    assert [p.name for p in paths] == ["step_1.pt", "step_2.pt", "step_3.pt"]
    averaged = average_checkpoints(paths)
    steps = [load_checkpoint(p)["model"] for p in paths]
    key = "encoder_layers.0.feed_forward.up.weight"
    assert torch.allclose(averaged["model"][key], sum(s[key] for s in steps) / 3, atol=1e-6)
    assert averaged["step"] == 3 and not set(TRAINING_STATE_KEYS) & set(averaged)
    assert average_main([str(tmp_path), "--last", "2", "-o", str(tmp_path / "avg.pt")]) == 0
    assert "averaged 2 checkpoints (step_2.pt, step_3.pt)" in capsys.readouterr().out
