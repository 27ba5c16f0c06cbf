"""Weight averaging: the EMA against hand-computed values, swapping weights, and both averages in a run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import FAST, compose_config
from transformer.checkpoint import average_checkpoints, load_checkpoint, step_checkpoints
from transformer.config import ConfigError
from transformer.training.ema import ExponentialMovingAverage, weights_swapped


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(3, 2)
        self.out = nn.Linear(2, 3, bias=False)
        self.out.weight = self.embed.weight  # tied: one parameter under two names
        self.bias = nn.Parameter(torch.zeros(3))


def test_ema_update_matches_the_formula_by_hand():
    model = _Tied()
    with torch.no_grad():
        model.embed.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
        model.bias.copy_(torch.tensor([1.0, 0.0, -1.0]))
    ema = ExponentialMovingAverage(model, decay=0.9)
    assert sorted(ema.names) == ["bias", "embed.weight"]  # the tied matrix once
    expected_embed, expected_bias = model.embed.weight.detach().clone(), model.bias.detach().clone()
    for step, shift in ((1, 1.0), (2, -2.0), (50, 0.5), (200, 0.25)):
        with torch.no_grad():
            model.embed.weight.add_(shift)
            model.bias.mul_(2.0)
        ema.update(step)
        # d_t = min(0.9, (1 + t) / (10 + t)): 2/11, 3/12, 51/60, then 0.9
        d = {1: 2 / 11, 2: 3 / 12, 50: 51 / 60, 200: 0.9}[step]
        expected_embed = d * expected_embed + (1 - d) * model.embed.weight.detach()
        expected_bias = d * expected_bias + (1 - d) * model.bias.detach()
        average = dict(zip(ema.names, ema.average))
        assert torch.allclose(average["embed.weight"], expected_embed, atol=1e-6)
        assert torch.allclose(average["bias"], expected_bias, atol=1e-6)
    state = ema.model_state(model)
    assert set(state) == set(model.state_dict())  # both names of the tied matrix
    assert torch.equal(state["embed.weight"], state["out.weight"])
    assert torch.allclose(state["embed.weight"], expected_embed, atol=1e-6)

    again = ExponentialMovingAverage(_Tied(), decay=0.9)
    again.load_state_dict(ema.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(again.average, ema.average))


def test_ema_warmup_sets_how_long_the_decay_warms_up():
    model = _Tied()
    ema = ExponentialMovingAverage(model, decay=0.9, warmup=4.0)
    # d_t = min(0.9, (1 + t) / (4 + t)): reaches 0.9 at t = (4 * 0.9 - 1) / (1 - 0.9) = 26
    assert [ema.decay_at(t) for t in (1, 5, 25)] == [2 / 5, 6 / 9, 26 / 29]
    assert ema.decay_at(26) == pytest.approx(0.9) and ema.decay_at(27) == 0.9
    start = model.bias.detach().clone()
    with torch.no_grad():
        model.bias.add_(1.0)
    ema.update(1)
    assert torch.allclose(dict(zip(ema.names, ema.average))["bias"], start + (1 - 2 / 5))
    with pytest.raises(ValueError, match="above 1"):
        ExponentialMovingAverage(model, decay=0.9, warmup=1.0)


def test_the_run_state_builds_its_ema_from_the_config():
    from transformer.training.state import TrainingState

    cfg = compose_config(["trainer.ema_decay=0.99", "trainer.ema_warmup=3"])
    state = TrainingState(cfg, _Tied(), None, None, None, None, None, "", None, torch.device("cpu"))
    assert (state.ema.decay, state.ema.warmup) == (0.99, 3.0)
    without = TrainingState(compose_config([]), _Tied(), None, None, None, None, None, "", None, torch.device("cpu"))
    assert without.ema is None


def test_weights_swapped_restores_the_model_bit_for_bit():
    model = _Tied()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    other = {k: torch.randn_like(v) for k, v in before.items()}
    other["out.weight"] = other["embed.weight"]
    with weights_swapped(model, other):
        assert torch.equal(model.embed.weight, other["embed.weight"])
        assert model.out.weight is model.embed.weight
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["trainer.ema_decay=1.0"], "trainer.ema_decay=1.0 must be in"),
        (["trainer.ema_warmup=1"], "trainer.ema_warmup=1.0 must be above 1"),
        (["trainer.average_last=1"], "trainer.average_last=1 must be 0"),
        (["trainer.average_last=5", "trainer.keep_last=3"], "set trainer.keep_last=5"),
    ],
)
def test_averaging_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_config(overrides)


@pytest.mark.slow
def test_a_run_validates_raw_ema_and_average_and_keeps_the_best(tmp_path, data_cache):
    from transformer.training.trainer import train

    cfg = compose_config(
        FAST
        + [
            "data.embedded_pairs=800",
            "trainer.max_steps=24",
            "trainer.validate_every=8",
            "trainer.checkpoint_every=4",
            "trainer.keep_last=3",
            "trainer.average_last=3",
            "trainer.ema_decay=0.9",
            "trainer.val_max_sentences=16",
            "decode.beam_size=1",
            "trainer.lr=3e-3",
            "trainer.warmup=8",
            "trainer.test_at_end=false",
        ],
        data_cache,
    )
    metrics = train(cfg, tmp_path)
    history = metrics["val_history"]
    # Every validation scored the raw weights and the EMA; the average was validated once, at the end.
    assert all("bleu_raw" in v and "bleu_ema" in v for v in history[:3])
    assert history[-1]["weights"] == "average of step_16, step_20, step_24"
    best = load_checkpoint(tmp_path / "checkpoints/best.pt")
    assert best["weights"] == metrics["best_weights"]
    assert metrics["best_bleu"] == max(v["bleu"] for v in history)
    if best["weights"].startswith("average"):
        expected = average_checkpoints(step_checkpoints(tmp_path)[-3:])["model"]
    elif best["weights"] == "ema":
        expected = None  # the EMA at best_step: compared through last.pt below when that is the last step
    else:
        expected = load_checkpoint(tmp_path / f"checkpoints/step_{best['step']}.pt")["model"]
    if expected is not None:
        assert all(torch.equal(expected[k], best["model"][k]) for k in expected)
    last = load_checkpoint(tmp_path / "checkpoints/last.pt")
    assert last["weights"] == "raw" and "ema" in last
    # step_24.pt and last.pt were saved before the average was validated: last.pt was saved again with it
    assert last["step"] == 24 and last["metrics"]["val_history"] == history
    if best["weights"] == "ema" and best["step"] == last["step"]:
        assert torch.equal(best["model"]["tgt_embed.weight"], last["ema"]["weights"]["tgt_embed.weight"])
    # FAST's trainer.attention_heatmaps=off: the validations wrote their numbers and no picture
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"val/bleu", "val_ema/bleu"} <= set(events.Tags()["scalars"]) and events.Tags()["images"] == []


def test_a_checkpoint_holding_averaged_weights_cannot_resume_a_run():
    from transformer.errors import TrainingError
    from transformer.training.resume import _resumable

    full = {"optimizer": {}, "scheduler": {}, "scaler": {}, "rng": [], "data_state": {}}
    assert _resumable({**full, "weights": "raw"}, "last.pt")
    with pytest.raises(TrainingError, match="best.pt: holds the ema weights .* resume from last.pt"):
        _resumable({**full, "weights": "ema"}, "best.pt")
