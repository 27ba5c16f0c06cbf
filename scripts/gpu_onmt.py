"""`bash scripts/gpu_check.sh onmt`: OpenNMT-py 3.5.1 training our `model=base` shape on the same data and GPU,
its target tokens/s as a row "opennmt-py base" of the matrix's JSON (scripts/gpu_matrix.py).

    python scripts/gpu_onmt.py wheels .gpu/wheels             # the wheels to install beside this python's torch
    python scripts/gpu_onmt.py prepare --data-dir M --work W  # joint 8k BPE (SentencePiece) of Multi30k de-en
    python scripts/gpu_onmt.py config --work W --tokens 32768 --steps 200 --device cuda   # W/base-32768.yaml
    python scripts/gpu_onmt.py row --log W/train-32768.log --tokens 32768 --out DIR      # the row, into the JSON

The shape is `model=<model>`'s as our config composes it (base: 6+6 layers, 512 wide, FFN 2048, 8 heads; tied embeddings
and output layer, as ours), the vocabulary is one joint 8,000-piece BPE as our data.vocab_size, the batches are
`batch_type: tokens` budgets (sentences x the longer side's padded length, our trainer.max_tokens's count), with
Adam, label smoothing 0.1 and Noam's schedule. OpenNMT-py 3.5.1 has fp32 and fp16 (torch.amp with a loss scaler)
but no bf16: on a GPU it trains in fp16. Its log's tok/s per report window counts the target's real tokens over
the window's wall time (data loading included, as ours); the row is the median of the windows after --skip steps.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# OpenNMT-py's needs for training, as (distribution as its wheel is named, module): installed from the carried
# wheels only where this python cannot import the module (the lent machines have most of them)
NEEDS = [
    ("configargparse", "configargparse"),
    ("pyyaml", "yaml"),
    ("sacrebleu", "sacrebleu"),
    ("six", "six"),
    ("tensorboard", "tensorboard"),
    ("sentencepiece", "sentencepiece"),
    ("pyonmttok", "pyonmttok"),
    ("rapidfuzz", "rapidfuzz"),
    ("pyahocorasick", "ahocorasick"),
]
REPORT = re.compile(r"Step\s+(\d+)(?:/\s*\d+)?;.*?([\d.]+)/\s*([\d.]+) tok/s")


def wheels_to_install(
    folder: Path, importable=lambda module: importlib.util.find_spec(module) is not None
) -> list[Path]:
    """OpenNMT-py's wheel and those of NEEDS whose module `importable` says is missing (one wheel each)."""

    def wheel(distribution: str) -> Path:
        normalized = distribution.lower().replace("-", "_")
        found = [p for p in sorted(folder.glob("*.whl")) if p.name.lower().split("-")[0] == normalized]
        if not found:
            raise SystemExit(f"gpu_onmt: no {distribution} wheel in {folder} (bash scripts/gpu_wheels.sh)")
        return found[-1]

    return [wheel("opennmt_py")] + [wheel(dist) for dist, module in NEEDS if not importable(module)]


def prepare(data_dir: Path, work: Path, vocab_size: int = 8000) -> None:
    """The joint BPE of train.de + train.en and the pieces of train and val (as /work/shared/peers' script)."""
    import sentencepiece as spm

    work.mkdir(parents=True, exist_ok=True)
    joint = work / "joint.txt"
    joint.write_text("".join((data_dir / f"train.{lang}").read_text() for lang in ("de", "en")))
    spm.SentencePieceTrainer.train(
        input=str(joint),
        model_prefix=str(work / "spm"),
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=str(work / "spm.model"))
    for split in ("train", "val"):
        for lang in ("de", "en"):
            lines = (data_dir / f"{split}.{lang}").read_text().splitlines()
            pieces = sp.encode([line.strip() for line in lines], out_type=str)
            (work / f"{split}.{lang}.sp").write_text("".join(" ".join(p) + "\n" for p in pieces))


def model_shape(model: str) -> dict:
    """d_model, n_heads, d_ff and the layer counts of `model=<model>`, as our config composes it."""
    from transformer.compose import compose

    cfg = compose([f"model={model}"]).model
    return {key: getattr(cfg, key) for key in ("d_model", "n_heads", "d_ff", "encoder_layers", "decoder_layers")}


def config(
    work: Path, tokens: int, steps: int, device: str, model: str = "base", report_every: int = 20, workers: int = 2
) -> Path:
    """W/<model>-<tokens>.yaml: OpenNMT-py's options for the comparison (module docstring)."""
    shape = model_shape(model)
    cuda = device.startswith("cuda")
    run = work / f"run-{tokens}"
    lines = [
        f"save_data: {run}/data",
        f"src_vocab: {work}/vocab.shared",
        f"tgt_vocab: {work}/vocab.shared",
        "share_vocab: true",
        "src_vocab_size: 9000",  # the 8,000 pieces and OpenNMT-py's specials: nothing cut
        "tgt_vocab_size: 9000",
        "overwrite: true",
        "data:",
        "  corpus_1:",
        f"    path_src: {work}/train.de.sp",
        f"    path_tgt: {work}/train.en.sp",
        "  valid:",
        f"    path_src: {work}/val.de.sp",
        f"    path_tgt: {work}/val.en.sp",
        f"save_model: {run}/model",
        "save_checkpoint_steps: 1000000",
        f"train_steps: {steps}",
        "valid_steps: 1000000",
        f"report_every: {report_every}",
        "seed: 1",
        "batch_type: tokens",
        f"batch_size: {tokens}",
        "valid_batch_size: 2048",
        "bucket_size: 262144",
        f"num_workers: {workers if cuda else 0}",
        *(["world_size: 1", "gpu_ranks: [0]", "model_dtype: fp16"] if cuda else []),
        "encoder_type: transformer",
        "decoder_type: transformer",
        "position_encoding: true",
        f"enc_layers: {shape['encoder_layers']}",
        f"dec_layers: {shape['decoder_layers']}",
        f"heads: {shape['n_heads']}",
        f"hidden_size: {shape['d_model']}",
        f"word_vec_size: {shape['d_model']}",
        f"transformer_ff: {shape['d_ff']}",
        "dropout: [0.1]",
        "attention_dropout: [0.1]",
        "share_embeddings: true",
        "share_decoder_embeddings: true",
        "optim: adam",
        "adam_beta1: 0.9",
        "adam_beta2: 0.98",
        "decay_method: noam",
        "learning_rate: 2.0",
        "warmup_steps: 4000",
        "label_smoothing: 0.1",
        "param_init: 0",
        "param_init_glorot: true",
        "max_grad_norm: 0",
        "normalization: tokens",
        "accum_count: [1]",
    ]
    path = work / f"{model}-{tokens}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def windows(log_text: str) -> list[tuple[int, float, float]]:
    """(step, source tok/s, target tok/s) of each report line of an OpenNMT-py training log."""
    return [(int(m[1]), float(m[2]), float(m[3])) for m in REPORT.finditer(log_text)]


def onmt_row(log_text: str, tokens: int, skip: int, precision: str, rc: int = 0, model: str = "base") -> dict:
    """The JSON row (gpu_matrix's fields) of one OpenNMT-py run: the median target tok/s of the report windows
    that end after step `skip` (the first ones hold the start and the first allocations)."""
    from gpu_matrix import Spec, base_row

    row = base_row(Spec(f"opennmt-py {model}", precision, False, tokens), "ok")
    row["batch_tokens_chosen"] = tokens
    found = windows(log_text)
    kept = [w for w in found if w[0] > skip] or found[-1:]
    stopped = rc in (124, 143) and kept  # `timeout` stopped it: the windows it logged stand
    if (rc != 0 and not stopped) or not kept:
        last = [line for line in log_text.splitlines() if line.strip()][-1:] or ["no output"]
        row["status"] = f"error: rc {rc}, {len(found)} report lines; last line: {last[0][-300:]}"
        return row
    row.update(
        target_tokens_per_s=statistics.median(w[2] for w in kept),
        source_tokens_per_s=statistics.median(w[1] for w in kept),
        steps=kept[-1][0] - max((w[0] for w in found if w[0] < kept[0][0]), default=0),
        windows=len(kept),
    )
    if not [w for w in found if w[0] > skip]:
        row["status"] = f"ok (no report after step {skip}: the last window)"
    if stopped:
        row["status"] += f" (stopped by its time limit after step {kept[-1][0]})"
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    wheels = sub.add_parser("wheels")
    wheels.add_argument("folder", type=Path)
    prep = sub.add_parser("prepare")
    prep.add_argument("--data-dir", type=Path, required=True)
    prep.add_argument("--work", type=Path, required=True)
    conf = sub.add_parser("config")
    conf.add_argument("--work", type=Path, required=True)
    conf.add_argument("--tokens", type=int, required=True)
    conf.add_argument("--steps", type=int, default=200)
    conf.add_argument("--report-every", type=int, default=20)
    conf.add_argument("--device", default="cuda")
    conf.add_argument("--model", default="base")
    row = sub.add_parser("row")
    row.add_argument("--log", type=Path, required=True)
    row.add_argument("--rc", type=int, default=0, help="the training's exit status")
    row.add_argument("--tokens", type=int, required=True)
    row.add_argument("--skip", type=int, default=60, help="report windows up to this step are left out")
    row.add_argument("--seconds", type=float, help="the run's wall time, for the row")
    row.add_argument("--device", default="cuda")
    row.add_argument("--model", default="base", help="the shape it trained (the row's model: opennmt-py MODEL)")
    row.add_argument("--out", type=Path, help="a second folder for the JSON (the device call's $OUT)")
    row.add_argument("--json-dir", type=Path, default=ROOT / "docs" / "gpu")
    args = parser.parse_args(argv)

    if args.command == "wheels":
        print(" ".join(str(p) for p in wheels_to_install(args.folder)))
    elif args.command == "prepare":
        began = time.perf_counter()
        prepare(args.data_dir, args.work)
        print(f"gpu_onmt: pieces of {args.data_dir} in {args.work} ({time.perf_counter() - began:.0f} s)")
    elif args.command == "config":
        print(config(args.work, args.tokens, args.steps, args.device, args.model, args.report_every))
    else:
        from gpu_matrix import device_info, result_paths, write_results

        precision = "fp16" if args.device.startswith("cuda") else "fp32"
        result = onmt_row(args.log.read_text(errors="replace"), args.tokens, args.skip, precision, args.rc, args.model)
        if args.seconds is not None:
            result["seconds"] = round(args.seconds, 1)
        info = device_info(args.device)
        paths = result_paths(args.json_dir, args.out, info["date"], info["device"])
        # the version that ran (installed with --target beside the training's PYTHONPATH; a peer we race, not
        # one of our dependencies, so read from its metadata rather than imported)
        version = importlib.metadata.version("OpenNMT-py")
        opennmt = {"version": version, "precision": precision, "skip_steps": args.skip}
        write_results(paths, {key: info[key] for key in ("device", "torch", "date")} | {"opennmt": opennmt}, [result])
        print(
            f"gpu_onmt: OpenNMT-py {version} {precision} at {args.tokens} tokens: "
            f"{result['target_tokens_per_s'] or 0:,.0f} target tok/s ({result['status']}); rows in "
            + ", ".join(str(p) for p in paths)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
