"""Plain helpers for the tests (conftest.py keeps the fixtures and hooks): the repository root, the
tiny training configuration, composing the real config, and an untrained checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from transformer.checkpoint import save_checkpoint
from transformer.config import Config, compose
from transformer.model import build_model
from transformer.tokenizer import Tokenizer, train_sentencepiece
from transformer.toy import generate

ROOT = Path(__file__).resolve().parents[1]

# Small enough to train in seconds; every test that trains starts from this and overrides what it needs.
FAST = [
    "model.d_model=64", "model.n_heads=4", "model.d_ff=128", "model.encoder_layers=2",
    "model.decoder_layers=2", "data.embedded_pairs=2000", "data.vocab_size=200",
    "trainer.max_tokens=1024", "trainer.log_every=10", "trainer.val_max_sentences=50",
]


def compose_config(overrides: list[str] = (), cache_dir: Path | None = None) -> Config:
    """The real conf/ tree composed with overrides, as `make train key=value` would see it."""
    extra = [f"data.cache_dir={cache_dir}"] if cache_dir is not None else []
    return compose(list(overrides) + extra)


def write_untrained_checkpoint(path: Path) -> Path:
    """best.pt of an untrained tiny model, with the metrics a run records after one validation. Enough for
    every test that does not need sensible translations: refusals, file handling, shapes, equivalences."""
    config = compose_config(FAST)
    src, tgt = generate(400, 10, 10)["train"]
    tokenizer = Tokenizer(train_sentencepiece(src + tgt, vocab_size=120, model_type="bpe", character_coverage=1.0,
                                              sample=10_000))
    torch.manual_seed(0)
    model = build_model(config.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint)
    metrics = {"val_history": [{"step": 10, "loss": 4.0, "bleu": 12.345, "chrf": 40.5, "weights": "raw"}],
               "best_bleu": 12.345, "best_step": 10}
    save_checkpoint({"model": model.state_dict(), "config": config.to_dict(), "tokenizer": tokenizer.state_dict(),
                     "step": 10, "metrics": metrics}, path)
    return path
