"""Shared fixtures and hooks: the guard that keeps fast tests from training, a small trained checkpoint and an
untrained one, Multi30k's location. Plain helpers live in tests/helpers.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import FAST, compose_config, write_untrained_checkpoint

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest workers on two cores: one thread each, here and in the processes the tests
    # start, since two workers of two threads each fight over the cores (measured: 19 minutes instead of 12)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _fast_tests_train_nothing(request, monkeypatch):
    """`make test-fast` (-m "not slow") must train nothing: a test without the `slow` marker that
    reaches the training loop, itself or through a fixture, fails."""
    if request.node.get_closest_marker("slow") is None:
        import transformer.training.trainer as train_module

        def refuse(*args, **kwargs):
            raise AssertionError(f"{request.node.nodeid} trains a model but is not marked slow")

        monkeypatch.setattr(train_module.Trainer, "fit", refuse)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One SentencePiece/encoding cache for the whole session (what data/ is for a user)."""
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, data_cache):
    """A tiny model trained on the embedded corpus: (run_dir, metrics)."""
    from transformer.training.trainer import train

    run_dir = tmp_path_factory.mktemp("trained-run")
    cfg = compose_config(
        FAST
        + [
            "trainer.attention_heatmaps=mean",
            "model.d_model=96",
            "model.d_ff=256",
            "data.embedded_pairs=4000",
            "trainer.max_steps=240",
            "trainer.validate_every=80",
            "trainer.warmup=60",
            "trainer.lr=3e-3",
            "trainer.max_minutes=0",
        ],
        cache_dir=data_cache,
    )
    metrics = train(cfg, run_dir)
    return run_dir, metrics


@pytest.fixture(scope="session")
def trained_checkpoint(trained_run) -> Path:
    return trained_run[0] / "checkpoints" / "best.pt"


@pytest.fixture(scope="session")
def untrained_checkpoint(tmp_path_factory) -> Path:
    """best.pt of an untrained tiny model, built in a second without training (fast tests may use it);
    read-only: a test that changes it copies it first."""
    return write_untrained_checkpoint(tmp_path_factory.mktemp("untrained-run") / "best.pt")


@pytest.fixture(scope="session")
def multi30k_dir() -> Path:
    """Multi30k from MULTI30K_DIR: skipped on a user's machine without it, a failure under CI."""
    value = os.environ.get("MULTI30K_DIR")
    if not value or not (Path(value) / "train.de").is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but MULTI30K_DIR={value!r} does not hold Multi30k (train.de missing)")
        pytest.skip("MULTI30K_DIR is not set (point it at a Multi30k directory to run this test)")
    return Path(value)
