"""trainer.max_tokens_auto (transformer/training/batch_fit.py): the search driven by fake memory probes,
the worst batch it probes with, the CPU fallback, and a run that logs its budget, writes it into its
checkpoints and keeps it on resume without searching again."""

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import FAST, compose_config
from transformer.checkpoint import load_checkpoint
from transformer.config import MAX_BATCH_TOKENS
from transformer.special import BOS_ID, EOS_ID
from transformer.training import batch_fit
from transformer.training.batch_fit import RUNG, choose_max_tokens, largest_fitting_budget, worst_batch
from transformer.training.trainer import train

MOST_TRIES = 2 * math.log2(MAX_BATCH_TOKENS // RUNG) + 2


@pytest.mark.parametrize("limit", [1024, 1500, 5000, 8192, 8193, 23000, 100_000, MAX_BATCH_TOKENS, 10**12])
@pytest.mark.parametrize("first", [1024, 4096, 8192, 30_000])
def test_the_search_picks_the_largest_fitting_rung_in_few_tries(limit, first):
    probed = []

    def fits(budget):
        probed.append(budget)
        return budget <= limit

    budget, tries = largest_fitting_budget(fits, first=first)
    expected = min(limit, MAX_BATCH_TOKENS) // RUNG * RUNG
    assert budget == expected and budget % 8 == 0  # the largest rung that fits: never one that does not
    assert tries == len(probed) <= MOST_TRIES
    assert all(b % RUNG == 0 and RUNG <= b <= MAX_BATCH_TOKENS for b in probed)  # only rungs, never past the cap


def test_the_search_says_none_when_not_even_one_rung_fits():
    assert largest_fitting_budget(lambda budget: budget <= 1000, first=8192) == (None, 4)  # 8k, 4k, 2k, 1k


def test_the_worst_batch_is_the_budgets_rows_of_the_longest_sentences():
    batch = worst_batch(budget=1000, max_len=99, vocab=50, device="cpu")
    assert batch.src.shape == batch.tgt_in.shape == batch.tgt_out.shape == (10, 100)  # 1000 // (99 + 1) rows
    assert (batch.src[:, -1] == EOS_ID).all() and (batch.tgt_out[:, -1] == EOS_ID).all()
    assert (batch.tgt_in[:, 0] == BOS_ID).all() and torch.equal(batch.tgt_in[:, 1:], batch.tgt_out[:, :-1])
    assert (batch.src[:, :-1] > EOS_ID).all() and batch.num_tgt_tokens == 1000 == batch.tgt_positions.numel()


def test_on_a_cpu_the_key_falls_back_to_max_tokens_with_a_warning(caplog):
    tc = SimpleNamespace(max_tokens=3000, rdrop=0.0)
    runtime = SimpleNamespace(device=torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="transformer.train"):
        assert choose_max_tokens(tc, SimpleNamespace(max_len=256), None, runtime, 100) == 3000
    assert "trainer.max_tokens_auto=true" in caplog.text and "trainer.max_tokens=3000 is used" in caplog.text


@pytest.mark.slow
def test_a_run_logs_the_chosen_budget_keeps_it_in_its_checkpoints_and_on_resume(
    tmp_path, data_cache, monkeypatch, caplog
):
    """The CUDA probe faked: a 'GPU' where 2,500 tokens fit, so the search picks 2,048, not FAST's 1,024."""
    searches = []

    def fake_choose(*args, **kwargs):
        searches.append(1)
        return choose_max_tokens(*args, probe=lambda budget: budget <= 2500, **kwargs)

    monkeypatch.setattr("transformer.training.trainer.choose_max_tokens", fake_choose)
    common = FAST + ["trainer.max_tokens_auto=true", "trainer.device=cpu", "trainer.precision=fp32"]
    common += ["trainer.validate_every=100", "trainer.test_at_end=false", "trainer.max_minutes=0"]
    with caplog.at_level(logging.INFO, logger="transformer.train"):
        train(compose_config(common + ["trainer.max_steps=3"], data_cache), tmp_path / "split")
    assert "trainer.max_tokens_auto: trainer.max_tokens=2048, the largest budget" in caplog.text
    assert load_checkpoint(tmp_path / "split/checkpoints/last.pt")["config"]["trainer"]["max_tokens"] == 2048
    assert searches == [1]

    caplog.clear()
    monkeypatch.setattr(batch_fit, "largest_fitting_budget", pytest.fail)  # a resumed run never searches
    with caplog.at_level(logging.INFO, logger="transformer.train"):
        resume = ["trainer.max_steps=5", "trainer.resume=true"]
        train(compose_config(common + resume, data_cache), tmp_path / "split")
    assert "the resumed run keeps trainer.max_tokens=2048" in caplog.text
    assert "differ from the checkpoint" not in caplog.text  # an exact resume
    assert load_checkpoint(tmp_path / "split/checkpoints/last.pt")["config"]["trainer"]["max_tokens"] == 2048
    assert searches == [1]

    monkeypatch.setattr(batch_fit, "largest_fitting_budget", largest_fitting_budget)
    train(compose_config(common + ["trainer.max_steps=5"], data_cache), tmp_path / "full")
    full = load_checkpoint(tmp_path / "full/checkpoints/last.pt")["model"]
    resumed = load_checkpoint(tmp_path / "split/checkpoints/last.pt")["model"]
    assert all(torch.equal(full[name], resumed[name]) for name in full)  # 3 steps + 2 resumed == 5 steps
