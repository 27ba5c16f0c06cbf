"""The host section of `make bench` (imported by bench.py; `python scripts/bench_host.py` runs it alone).

host : the trainer's training step on the `meta` device (transformer/training/host_cost.py): the operators it
       dispatches, by phase, and the host's median milliseconds per step, for each model preset (base and
       big by default) at 4k- and 32k-target-token batches of 32-token rows (30 real). fp32 only: autocast
       has no meta version, so the bf16 rows say so and are skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformer.compose import compose  # noqa: E402
from transformer.training.host_cost import BatchShape, autocast_on_meta, chunk_rows, measure  # noqa: E402

BUDGETS = (4096, 32768)  # trainer.max_tokens of the batches timed: the default budget, and a GPU's


def bench_host(presets: list[str], overrides: list[str], repeats: int) -> list[dict]:
    """One row per preset and budget (fp32), and one bf16 row per preset saying why it is not measured."""
    shapes = [BatchShape.for_budget(tokens) for tokens in BUDGETS]
    rows = []
    for preset in presets:
        cfg = compose([f"model={preset}", *overrides])
        model = {k: getattr(cfg.model, k) for k in ("d_model", "n_heads", "d_ff", "encoder_layers", "decoder_layers")}
        for budget, row in zip(BUDGETS, measure(cfg.model, cfg.trainer, shapes, repeats)):
            row.update(
                section="host",
                device="meta",
                preset=preset,
                overrides=overrides,
                model=model,
                precision="fp32",
                max_tokens=budget,
                chunk_rows=chunk_rows(),
                repeats=repeats,
                us_per_op=1000 * row["host_ms"] / row["ops"],
            )
            rows.append(row)
        if not autocast_on_meta():
            rows.append(
                {
                    "section": "host",
                    "preset": preset,
                    "precision": "bf16",
                    "skipped": "torch.autocast has no meta version (it refuses device_type 'meta')",
                }
            )
    return rows


def print_row(row: dict) -> None:
    if "skipped" in row:
        print(f"host   {row['preset']:5s} {row['precision']} | skipped: {row['skipped']}")
        return
    phases = ", ".join(f"{phase} {n}" for phase, n in row["ops_by_phase"].items())
    extra = f" | {' '.join(row['overrides'])}" if row["overrides"] else ""
    print(
        f"host   {row['preset']:5s} {row['precision']} | {row['max_tokens']:>5} tokens ({row['sentences']} x "
        f"{row['src_len']}/{row['tgt_len']}, {row['tgt_tokens']} targets, {row['loss_chunks']} loss chunk(s)) | "
        f"{row['ops']} ops/step ({phases}) | host {row['host_ms']:.1f} ms/step on meta (median of {row['repeats']}, "
        f"{min(row['host_ms_each']):.0f}-{max(row['host_ms_each']):.0f}; CPU time {row['host_cpu_ms']:.1f}), "
        f"{row['us_per_op']:.0f} us/op{extra}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="base,big", help="model presets (comma-separated)")
    parser.add_argument("--host-repeats", type=int, default=10, help="timed steps per shape (the median is kept)")
    parser.add_argument("--host-overrides", nargs="*", default=[], help="Hydra overrides, e.g. trainer.ema_decay=0.998")
    parser.add_argument("--output", help="also write the rows to this JSON file")
    args = parser.parse_args()
    results = bench_host(args.host.split(","), args.host_overrides, args.host_repeats)
    for result in results:
        print_row(result)
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
