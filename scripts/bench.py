"""`make bench`: training and decoding speed, side by side in one process, written to bench.json.

    python scripts/bench.py [--preset small] [--max-tokens 4096] [--checkpoint CKPT] [--sections host,...]

train  : target tokens/s and peak memory of our model's training step (forward, fused label-smoothed loss,
         backward, AdamW) vs a torch.nn.Transformer model of the same shape with tied embeddings and the
         same loss, on the same batches, interleaved; median over repeats, warm-up excluded.
trainer: the trainer's own step (`Trainer.train_step`) on fresh batches from its DataLoader, collate and
         copies to the device included, as `make train` runs it: target tokens/s, and on CUDA peak
         memory and MFU. This is the figure to compare with other toolkits' training logs.
data   : preparing Multi30k with the SentencePiece model cached, and with everything cached; padding
         share; collate time of 8k-token batches (scripts/bench_data.py).
data_scale : Multi30k repeated to 1M and 4.5M pairs: cold and warm start to the first step, peak RSS and
         anonymous memory, the anonymous bytes a pair adds, two torchrun ranks (scripts/bench_data.py;
         --data-scale 0 skips it; --data-scale 4495000,44950000 is issue 75's probe).
decode : sentences/s for greedy and beam 5, with the key/value cache and recomputing the prefix.
translate_cli : with --checkpoint and MULTI30K_DIR, seconds for `transformer-translate` to translate
         test_2016_flickr as a whole process (startup and model load included), beam 5 and greedy.
mfu    : on CUDA, model FLOPs/s over the exact device's dense bf16 peak: the count and the peak table are
         transformer/flops.py's, which the training log's MFU shares.
host   : the trainer's step on the `meta` device, no arithmetic: operators dispatched per step (by phase) and
         the host's milliseconds per step, for --host presets (base, big) at 4k and 32k target tokens; fp32
         only (autocast has no meta version) (scripts/bench_host.py, transformer/training/host_cost.py).

--sections runs some of them (default: all; each still skips itself without what it needs), e.g.
`make bench ARGS="--sections host"`.

Batches are real Multi30k batches when MULTI30K_DIR is set, otherwise the embedded corpus. A model
whose loss is not finite or does not fall over the timed steps fails the bench (exit code 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformer.attention import padding_mask  # noqa: E402
from transformer.compose import compose  # noqa: E402
from transformer.data.batching import TokenBatchSampler  # noqa: E402
from transformer.data.prepare import prepare  # noqa: E402
from transformer.flops import peak_bf16_tflops, train_flops  # noqa: E402
from transformer.loss import batch_loss  # noqa: E402
from transformer.model import SinusoidalPositions, build_model, compile_layers  # noqa: E402
from transformer.runtime import (  # noqa: E402
    DTYPES,
    cpu_has_native_bf16,
    resolve_precision,
    tune_cpu_process,
)
from transformer.special import PAD_ID  # noqa: E402

SECTIONS = ("data", "train", "trainer", "decode", "translate_cli", "data_scale", "host")


class ReferenceTransformer(nn.Module):
    """torch.nn.Transformer with our embeddings, positions, tied output and loss: the yardstick."""

    def __init__(self, cfg, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, cfg.d_model, padding_idx=PAD_ID)
        self.positions = SinusoidalPositions(cfg.d_model, cfg.max_positions)
        self.core = nn.Transformer(
            cfg.d_model,
            cfg.n_heads,
            cfg.encoder_layers,
            cfg.decoder_layers,
            cfg.d_ff,
            cfg.dropout,
            batch_first=True,
            norm_first=cfg.pre_norm,
        )
        self.scale = math.sqrt(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def loss(self, batch, smoothing: float):
        src = self.dropout(self.embed(batch.src) * self.scale + self.positions(batch.src.size(1)))
        tgt = self.dropout(self.embed(batch.tgt_in) * self.scale + self.positions(batch.tgt_in.size(1)))
        causal = nn.Transformer.generate_square_subsequent_mask(batch.tgt_in.size(1), device=src.device)
        src_pad = padding_mask(batch.src, PAD_ID)
        hidden = self.core(
            src, tgt, tgt_mask=causal, src_key_padding_mask=src_pad, memory_key_padding_mask=src_pad, tgt_is_causal=True
        )
        real = batch.tgt_out != PAD_ID
        logits = hidden[real] @ self.embed.weight.t()
        return nn.functional.cross_entropy(
            logits.float(), batch.tgt_out[real], label_smoothing=smoothing, reduction="sum"
        )


class OurModel(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def loss(self, batch, smoothing: float):
        return batch_loss(self.model, batch, smoothing)[0]  # the trainer's own loss


def time_training(models: dict, batches, device, dtype, repeats: int, smoothing: float = 0.1) -> dict:
    optimizers = {
        name: torch.optim.AdamW(m.parameters(), lr=1e-4, betas=(0.9, 0.98), fused=True) for name, m in models.items()
    }
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype is not None else None
    times = {name: [] for name in models}
    losses = {name: [] for name in models}
    peak = {name: 0 for name in models}
    tokens = sum(b.num_tgt_tokens for b in batches)

    def step(name, batch):
        model, optimizer = models[name], optimizers[name]
        if autocast:
            with autocast():
                loss = model.loss(batch, smoothing)
        else:
            loss = model.loss(batch, smoothing)
        (loss / batch.num_tgt_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item() / batch.num_tgt_tokens

    for name in models:  # warm-up: allocator, kernels, compile
        for batch in batches[:2]:
            step(name, batch)
    for _ in range(repeats):
        for name in models:  # interleaved, so drift hits both alike
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            epoch_losses = [step(name, batch) for batch in batches]
            if device.type == "cuda":
                torch.cuda.synchronize()
                peak[name] = max(peak[name], torch.cuda.max_memory_allocated())
            times[name].append(time.perf_counter() - start)
            losses[name].append(statistics.mean(epoch_losses))
    result = {}
    for name in models:
        first, last = losses[name][0], losses[name][-1]
        result[name] = {
            "tokens_per_s": tokens / statistics.median(times[name]),
            "loss_first_repeat": first,
            "loss_last_repeat": last,
            "loss_ok": all(math.isfinite(x) for x in losses[name]) and last < first,
        }
        if device.type == "cuda":
            result[name]["peak_memory_mb"] = peak[name] / 2**20
    return result


def bench_train(cfg, data, device, args) -> list[dict]:
    sampler = TokenBatchSampler(data.train.src_lens, data.train.tgt_lens, args.max_tokens, seed=1)
    epoch = sampler.batches(0)
    batches = [data.train.collate(epoch[k]).to(device) for k in range(min(args.steps, len(epoch)))]
    vocab = data.tokenizer.tgt_vocab_size
    precisions = ["fp32"]
    if device.type == "cuda" or cpu_has_native_bf16():
        precisions.append("bf16")
    rows = []
    for precision in precisions:
        for compiled in [False, True] if args.compile else [False]:
            torch.manual_seed(0)
            ours = OurModel(build_model(cfg.model, vocab, vocab, True)).to(device)
            torch.manual_seed(0)
            reference = ReferenceTransformer(cfg.model, vocab).to(device)
            models = {"ours": ours, "nn.Transformer": reference}
            if compiled:
                models = {k: _compiled(v) for k, v in models.items()}
            result = time_training(models, batches, device, DTYPES[precision], args.repeats)
            row = {
                "section": "train",
                "precision": precision,
                "compiled": compiled,
                "preset": cfg.model.name,
                "max_tokens": args.max_tokens,
                "batches": len(batches),
                "ours_tokens_per_s": result["ours"]["tokens_per_s"],
                "reference_tokens_per_s": result["nn.Transformer"]["tokens_per_s"],
                "speedup_vs_reference": result["ours"]["tokens_per_s"] / result["nn.Transformer"]["tokens_per_s"],
                "loss_ok": result["ours"]["loss_ok"] and result["nn.Transformer"]["loss_ok"],
                "detail": result,
            }
            if device.type == "cuda":
                row["ours_peak_memory_mb"] = result["ours"]["peak_memory_mb"]
                row["reference_peak_memory_mb"] = result["nn.Transformer"]["peak_memory_mb"]
                peak = _peak_tflops(device)
                if peak:
                    flops = sum(train_flops(cfg.model, b, vocab) for b in batches)
                    seconds = sum(b.num_tgt_tokens for b in batches) / row["ours_tokens_per_s"]
                    row["mfu"] = flops / seconds / (peak * 1e12)
            rows.append(row)
    return rows


def bench_trainer(overrides: list[str], device, args) -> list[dict]:
    """The trainer's own step on fresh batches from its DataLoader (see the module docstring)."""
    import tempfile

    from transformer.training.trainer import Trainer

    precisions = ["fp32"] + (["bf16"] if device.type == "cuda" or cpu_has_native_bf16() else [])
    rows = []
    for precision in precisions:
        for compiled in [False, True] if args.compile else [False]:
            cfg = compose(
                overrides
                + [
                    f"trainer.precision={precision}",
                    f"trainer.compile={compiled}",
                    f"trainer.device={device}",
                    "trainer.log_every=100000",
                ]
            )
            with tempfile.TemporaryDirectory() as run_dir:
                trainer = Trainer(cfg, Path(run_dir))
                try:
                    rows.append(_time_trainer(trainer, cfg, device, args.trainer_steps, precision, compiled))
                finally:
                    trainer.leave_process_group(clean=True)
                    trainer.monitor.close()
    return rows


def _time_trainer(trainer, cfg, device, steps: int, precision: str, compiled: bool) -> dict:
    from transformer.training.step_log import TrainLog

    loader = _epochs(trainer)
    for _ in range(5):  # warm-up: allocator, kernels, compile, workers
        micro, _ = next(loader)
        trainer.step.log.add(trainer.step(micro), micro)
    trainer.step.log.read()
    trainer.step.log = TrainLog(trainer.runtime.device, None, max_bad_steps=1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seen = []
    start = time.perf_counter()
    for _ in range(steps):
        micro, _ = next(loader)
        trainer.step.log.add(trainer.step(micro), micro)
        seen.extend(batch for batch, _ in micro)
    numbers = trainer.step.log.read()  # waits for the device
    seconds = time.perf_counter() - start
    row = {
        "section": "trainer",
        "precision": precision,
        "compiled": compiled,
        "preset": cfg.model.name,
        "max_tokens": cfg.trainer.max_tokens,
        "steps": steps,
        "tokens_per_s": numbers["tokens"] / seconds,
        "loss": numbers["loss_sum"] / max(numbers["finite_tokens"], 1),
        "loss_ok": numbers["skipped"] == 0 and math.isfinite(numbers["loss_sum"]),
    }
    if device.type == "cuda":
        row["peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
        peak = _peak_tflops(device)
        if peak:
            vocab = trainer.data.tokenizer.tgt_vocab_size
            row["mfu"] = sum(train_flops(cfg.model, b, vocab) for b in seen) / seconds / (peak * 1e12)
    return row


def _epochs(trainer):
    """The trainer's (micro-batches) items, epoch after epoch, as `Trainer.fit` draws them: a large
    trainer.max_tokens leaves few updates per Multi30k epoch (15 at 32k tokens)."""
    epoch = 0
    while True:
        trainer.batches.updates.start(epoch, 0)
        yield from ((micro, None) for micro, _ in trainer.batches.loader)
        epoch += 1


class _compiled(nn.Module):
    """Compiled as a user would: our model as trainer.compile does it (each layer), nn.Transformer's
    loss as one torch.compile."""

    def __init__(self, module):
        super().__init__()
        self.inner = module
        if isinstance(module, OurModel):
            compile_layers(module.model)
            self.compiled_loss = module.loss
        else:
            self.compiled_loss = torch.compile(module.loss, dynamic=True)

    def loss(self, batch, smoothing):
        return self.compiled_loss(batch, smoothing)


def _peak_tflops(device) -> float | None:
    return peak_bf16_tflops(torch.cuda.get_device_name(device))


def bench_decode(model, tokenizer, cfg, sources: list[str], device, repeats: int) -> list[dict]:
    """Decoding inside this process through `Translator` (tokenizing included) at the precision
    `transformer-translate` picks (auto), with the key/value cache and without."""
    from transformer.inference.translator import Translator

    precision = resolve_precision("auto", device)
    translator = Translator(model.to(device).eval(), tokenizer, cfg, device, precision)
    rows = []
    for beam in (1, 5):
        timings = {}
        for use_cache in (True, False):
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                translator.hypotheses(sources, beam_size=beam, alpha=0.6, use_cache=use_cache)
                times.append(time.perf_counter() - start)
            timings[use_cache] = statistics.median(times)
        rows.append(
            {
                "section": "decode",
                "beam": beam,
                "precision": precision,
                "sentences": len(sources),
                "cached_sentences_per_s": len(sources) / timings[True],
                "uncached_sentences_per_s": len(sources) / timings[False],
                "cache_speedup": timings[False] / timings[True],
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="model preset to time (default small)")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=8, help="batches per timed repeat")
    parser.add_argument("--trainer-steps", type=int, default=30, help="timed steps of the trainer section")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    parser.add_argument("--checkpoint", help="trained checkpoint for the decode section (default: train a tiny one)")
    parser.add_argument("--decode-sentences", type=int, default=0, help="limit decode sentences (0 = all)")
    parser.add_argument(
        "--cli-repeats",
        type=int,
        default=3,
        help="whole-process transformer-translate runs per beam (needs --checkpoint and MULTI30K_DIR; 0 = skip)",
    )
    parser.add_argument(
        "--large-file-lines",
        type=int,
        default=10000,
        help="with --checkpoint: also translate the first N lines of Multi30k train (0 = skip)",
    )
    parser.add_argument(
        "--ensemble",
        nargs="*",
        default=[],
        help="with --checkpoint: more checkpoints of its vocabulary for the ensemble rows",
    )
    parser.add_argument(
        "--data-scale",
        default="1000000,4500000",
        help="corpus sizes (pairs) for the data-scale section, needs MULTI30K_DIR; 0 = skip",
    )
    parser.add_argument("--data-scale-dir", default="/tmp/bench-data-scale", help="where its corpora are written")
    parser.add_argument(
        "--host", default="base,big", help="model presets of the host section (comma-separated; 0 = skip)"
    )
    parser.add_argument("--host-repeats", type=int, default=10, help="timed steps per shape of the host section")
    parser.add_argument(
        "--host-overrides",
        nargs="*",
        default=[],
        help="Hydra overrides for the host section, e.g. trainer.ema_decay=0.998",
    )
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated sections to run (default: all: {', '.join(SECTIONS)})",
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--output", default="bench.json")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if sections - set(SECTIONS):
        parser.error(f"--sections: unknown {', '.join(sorted(sections - set(SECTIONS)))}; one of {', '.join(SECTIONS)}")
    tune_cpu_process()  # as the training and translation CLIs do
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    multi30k = os.environ.get("MULTI30K_DIR")
    if multi30k:
        data_overrides = ["data=multi30k_de_en", f"data.path={multi30k}"]
    else:
        data_overrides = ["data=toy"]
    cfg = compose(data_overrides + [f"model={args.preset}", f"trainer.max_tokens={args.max_tokens}"])
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "data": cfg.data.name,
        "model": {
            k: getattr(cfg.model, k) for k in ("name", "d_model", "n_heads", "d_ff", "encoder_layers", "decoder_layers")
        },
    }
    from bench_data import bench_data, bench_data_scale

    rows = [bench_data(cfg)] if "data" in sections else []
    if "train" in sections:
        rows += bench_train(cfg, prepare(cfg.data), device, args)
    if "trainer" in sections:
        rows += bench_trainer(
            data_overrides + [f"model={args.preset}", f"trainer.max_tokens={args.max_tokens}"], device, args
        )

    from transformer.checkpoint import load_checkpoint, model_from_checkpoint
    from transformer.data.sources import load_split_text

    if "decode" in sections:
        if args.checkpoint:
            model, tokenizer, ckpt_cfg = model_from_checkpoint(load_checkpoint(args.checkpoint), args.checkpoint)
            data_cfg = ckpt_cfg.data
            if multi30k and data_cfg.name.startswith("multi30k"):  # MULTI30K_DIR, wherever it was trained
                data_cfg = dataclasses.replace(data_cfg, path=multi30k)
            sources, _ = load_split_text(data_cfg, "test")
        else:
            model, tokenizer, ckpt_cfg, sources = _quick_model()
        if args.decode_sentences:
            sources = sources[: args.decode_sentences]
        rows += bench_decode(model, tokenizer, ckpt_cfg, sources, device, repeats=1)
    test_file = Path(multi30k or ".") / "test_2016_flickr.de"
    if "translate_cli" in sections and args.checkpoint and multi30k and args.cli_repeats > 0 and test_file.exists():
        import tempfile

        from bench_ctranslate2 import bench_translation, first_lines

        with tempfile.TemporaryDirectory(prefix="bench-lines-") as tmp:
            files = [(test_file, test_file.with_suffix(".en"))]
            if args.large_file_lines:
                files.append(
                    tuple(
                        first_lines(Path(multi30k) / name, args.large_file_lines, Path(tmp))
                        for name in ("train.de", "train.en")
                    )
                )
            rows += bench_translation(args.checkpoint, files, args.cli_repeats, args.ensemble)
    sizes = [int(x) for x in args.data_scale.split(",") if int(x) > 0]
    if "data_scale" in sections and multi30k and sizes:
        rows += bench_data_scale(Path(multi30k), sizes, Path(args.data_scale_dir))
    if "host" in sections and args.host not in ("", "0"):
        from bench_host import bench_host

        rows += bench_host(args.host.split(","), args.host_overrides, args.host_repeats)

    Path(args.output).write_text(json.dumps({"info": info, "results": rows}, indent=2) + "\n")
    _print_table(info, rows)
    bad = [r for r in rows if r.get("loss_ok") is False]
    if bad:
        print("FAIL: a model's loss was not finite or did not fall over the timed steps", file=sys.stderr)
        return 1
    return 0


def _quick_model():
    """No checkpoint given: train the tiny model on the embedded corpus for a minute."""
    import tempfile

    from transformer.checkpoint import load_checkpoint, model_from_checkpoint
    from transformer.data.sources import load_split_text
    from transformer.training.trainer import train

    run_dir = Path(tempfile.mkdtemp(prefix="bench-"))
    cfg = compose(["trainer.max_steps=300", "trainer.validate_every=300", "trainer.max_minutes=0"])
    train(cfg, run_dir)
    state = load_checkpoint(run_dir / "checkpoints" / "best.pt")
    model, tokenizer, cfg = model_from_checkpoint(state)
    return model, tokenizer, cfg, load_split_text(cfg.data, "test")[0]


def _print_table(info: dict, rows: list[dict]) -> None:
    print(
        f"\ndevice: {info['device']} | torch {info['torch']} | threads {info['threads']} | data {info['data']} | "
        f"model {info['model']}"
    )
    for row in rows:
        if row["section"] == "train":
            memory = (
                f" | peak MB ours {row['ours_peak_memory_mb']:.0f} vs ref {row['reference_peak_memory_mb']:.0f}"
                if "ours_peak_memory_mb" in row
                else ""
            )
            mfu = f" | MFU {100 * row['mfu']:.1f}%" if "mfu" in row else ""
            print(
                f"train  {row['precision']:4s} {'compiled' if row['compiled'] else 'eager   '} | ours "
                f"{row['ours_tokens_per_s']:8.0f} tgt tok/s | nn.Transformer {row['reference_tokens_per_s']:8.0f} | "
                f"ratio {row['speedup_vs_reference']:.2f}x | loss falls: {row['loss_ok']}{memory}{mfu}"
            )
        elif row["section"] == "trainer":
            extra = (f" | peak MB {row['peak_memory_mb']:.0f}" if "peak_memory_mb" in row else "") + (
                f" | MFU {100 * row['mfu']:.1f}%" if "mfu" in row else ""
            )
            print(
                f"trainer {row['precision']:4s} {'compiled' if row['compiled'] else 'eager   '} | "
                f"{row['tokens_per_s']:8.0f} tgt tok/s, Trainer.train_step on DataLoader batches "
                f"({row['steps']} steps, max_tokens {row['max_tokens']}) | loss {row['loss']:.2f}{extra}"
            )
        elif row["section"] in ("data", "data_scale"):
            from bench_data import print_row

            print_row(row)
        elif row["section"] == "host":
            from bench_host import print_row as print_host

            print_host(row)
        elif row["section"] in ("ctranslate2", "translate_cli", "translate_startup"):
            from bench_ctranslate2 import print_row as print_translation

            print_translation(row)
        else:
            print(
                f"decode beam {row['beam']} {row['precision']} | {row['sentences']} sentences | cached "
                f"{row['cached_sentences_per_s']:.1f} sent/s | uncached {row['uncached_sentences_per_s']:.1f} "
                f"sent/s | cache speedup {row['cache_speedup']:.2f}x"
            )


if __name__ == "__main__":
    sys.exit(main())
