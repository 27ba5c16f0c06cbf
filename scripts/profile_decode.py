"""Where a decoding step's time goes: translate sentences with the PyTorch profiler on and group the
operators' own time into what they do (linear layers, attention, the key/value cache, the output
distribution and top-k, layer norm, the rest), plus the time no operator accounts for (Python and
dispatch between operators).

    python scripts/profile_decode.py CKPT [--beam 5] [--sentences 500] [--threads 1]
        [--precision auto|bf16|fp32] [--quantize int8] [--source FILE]

One thread by default, so that the shares are those of one core (a worker's view; see --workers in
docs/translating.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

GROUPS = {
    "linear layers": ("aten::addmm", "aten::mm", "quantized::linear_dynamic", "aten::linear"),
    "attention": (
        "aten::bmm",
        "aten::_softmax",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::masked_fill_",
        "aten::baddbmm",
    ),
    "key/value cache": ("aten::index_select", "aten::copy_", "aten::cat"),
    "output distribution, top-k": (
        "aten::_log_softmax",
        "aten::topk",
        "aten::amax",
        "aten::gather",
        "aten::max",
        "aten::sort",
    ),
    "layer norm": ("aten::native_layer_norm",),
}


def group_of(name: str) -> str:
    return next((group for group, names in GROUPS.items() if name in names), "other operators")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--sentences", type=int, default=500)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--quantize", default=None)
    parser.add_argument("--source", help="sentences to translate (default: Multi30k val.de from MULTI30K_DIR)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from transformer.inference.translator import Translator

    torch.set_num_threads(args.threads)
    source = Path(args.source or Path(os.environ.get("MULTI30K_DIR", ".")) / "val.de")
    lines = source.read_text(encoding="utf-8").splitlines()[: args.sentences]
    translator = Translator.from_checkpoint(
        args.checkpoint, device="cpu", precision=args.precision, quantize=args.quantize
    )
    translator.translate(lines[:20], beam_size=args.beam, workers=1)  # warm up
    started = time.perf_counter()
    translator.translate(lines, beam_size=args.beam, workers=1)
    plain = time.perf_counter() - started
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        started = time.perf_counter()
        translator.translate(lines, beam_size=args.beam, workers=1)
        profiled = time.perf_counter() - started
    seconds: dict[str, float] = {}
    for event in profile.key_averages():
        seconds[group_of(event.key)] = seconds.get(group_of(event.key), 0.0) + event.self_cpu_time_total / 1e6
    seconds["Python and dispatch between operators"] = max(0.0, profiled - sum(seconds.values()))
    print(
        f"{len(lines)} sentences, beam {args.beam}, precision {args.precision}, quantize {args.quantize}, "
        f"{args.threads} thread(s): {plain:.2f} s unprofiled, {profiled:.2f} s profiled"
    )
    for group, value in sorted(seconds.items(), key=lambda item: -item[1]):
        print(f"  {group:40s} {100 * value / profiled:5.1f}%  {value:6.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
