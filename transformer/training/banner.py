"""What a run says before its first step: the banner at the top of its log (where it writes, how it
starts, where and how it runs) and the settings it cannot honour in full, each said once (rank 0)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from transformer.config import Config
from transformer.data.batching import TokenBatchSampler
from transformer.runtime import Runtime

log = logging.getLogger("transformer.train")


def log_banner(run_dir: Path, start: str, runtime: Runtime, model: torch.nn.Module, model_name: str) -> None:
    run_dir = run_dir.resolve()
    log.info(
        "run directory %s (train.log, checkpoints/); TensorBoard: %s (tensorboard --logdir %s)",
        run_dir,
        run_dir / "tb",
        run_dir.parent,
    )
    log.info("start: %s", start)
    device = runtime.device
    name = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    parameters = sum(p.numel() for p in model.parameters())
    log.info(
        "device %s%s | precision %s | world size %d | model %s: %s parameters",
        device,
        name,
        runtime.precision,
        runtime.dist.world_size,
        model_name,
        f"{parameters:,}",
    )


def warn_about_settings_the_run_cannot_honour(cfg: Config, sampler: TokenBatchSampler, world: int) -> None:
    """More batches per update than an epoch has (an update never spans two epochs), R-Drop without
    dropout, a warm-up longer than the run (the peak lr is never reached)."""
    tc = cfg.trainer
    per_update = tc.update_freq * world
    # Each batch holds at most max_tokens of padded width: a lower bound, before counting exactly.
    if per_update > -(-sampler.padded_tokens() // tc.max_tokens):
        in_epoch = len(sampler.batches(0))
        if per_update > in_epoch:
            log.warning(
                "trainer.update_freq=%d%s asks for more batches per update than an epoch has (%d of at "
                "most trainer.max_tokens=%d tokens): every update takes the whole epoch, %d batches; "
                "lower trainer.update_freq to %d or less, or trainer.max_tokens",
                tc.update_freq,
                f" x {world} processes" if world > 1 else "",
                in_epoch,
                tc.max_tokens,
                in_epoch,
                max(1, in_epoch // world),
            )
    mc = cfg.model
    if tc.rdrop and not (mc.dropout or mc.attention_dropout or mc.src_word_dropout or mc.tgt_word_dropout):
        log.warning(
            "trainer.rdrop=%g with model.dropout=0 and model.attention_dropout=0: the two passes of each "
            "batch are the same, R-Drop adds nothing and doubles the compute; set model.dropout (e.g. "
            "0.3) or trainer.rdrop=0",
            tc.rdrop,
        )
    if tc.max_steps and tc.warmup > tc.max_steps:
        log.warning(
            "trainer.warmup=%d is longer than the run (trainer.max_steps=%d): the learning rate rises to "
            "%.0f%% of trainer.lr=%g and never reaches it; lower trainer.warmup",
            tc.warmup,
            tc.max_steps,
            100 * tc.max_steps / tc.warmup,
            tc.lr,
        )
