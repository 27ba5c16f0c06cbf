"""The bench's whole-process translation sections: `transformer-translate` itself, and a checkpoint
exported with `transformer-export --format ctranslate2` (float32 and int8) translating the same file
as a whole process beside it, with BLEU
and the share of sentences where its greedy output equals ours. CTranslate2's length penalty is set
to the checkpoint's decode.alpha (its normalisation differs slightly from our GNMT formula: with both
at 0.6, validation BLEU of the README's model was 40.14 against our 40.13).

Also the whole-process translator it times (what a user of the exported model would run):

    python scripts/bench_ctranslate2.py translate MODEL_DIR --beam 5 [--compute-type int8]
        [--inter-threads 2 --intra-threads 1] < source > translations
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (inter_threads, intra_threads): two single-thread workers, or one worker with two threads.
THREAD_SETTINGS = ((2, 1), (1, 2))


def translate_main(argv: list[str]) -> int:
    import ctranslate2
    import sentencepiece as spm

    parser = argparse.ArgumentParser(prog="bench_ctranslate2.py translate")
    parser.add_argument("model_dir")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--compute-type", default="default")
    parser.add_argument("--inter-threads", type=int, default=1)
    parser.add_argument("--intra-threads", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=32, help="sentences per batch")
    parser.add_argument("--length-penalty", type=float, default=1.0,
                        help="CTranslate2's length_penalty (the bench passes the checkpoint's decode.alpha)")
    args = parser.parse_args(argv)
    folder = Path(args.model_dir)
    joint = (folder / "spm.model").exists()
    src = spm.SentencePieceProcessor(model_file=str(folder / ("spm.model" if joint else "src.spm.model")))
    tgt = src if joint else spm.SentencePieceProcessor(model_file=str(folder / "tgt.spm.model"))
    lines = sys.stdin.buffer.read().decode("utf-8").splitlines()
    translator = ctranslate2.Translator(str(folder), device="cpu", compute_type=args.compute_type,
                                        inter_threads=args.inter_threads, intra_threads=args.intra_threads)
    pieces = src.encode([line.strip() for line in lines], out_type=str)
    results = translator.translate_iterable(pieces, max_batch_size=args.batch_size, beam_size=args.beam,
                                            length_penalty=args.length_penalty)
    out = [tgt.decode(result.hypotheses[0]) for result in results]
    sys.stdout.buffer.write("".join(text + "\n" for text in out).encode("utf-8"))
    return 0


def _timed(command: list[str], source_file: Path, repeats: int) -> tuple[list[float], list[str]]:
    times, output = [], ""
    for _ in range(repeats):
        start = time.perf_counter()
        with open(source_file, "rb") as source:
            result = subprocess.run(command, stdin=source, capture_output=True, check=True, cwd=ROOT)
        times.append(time.perf_counter() - start)
        output = result.stdout.decode("utf-8")
    return times, output.splitlines()


def _bleu(lines: list[str], reference_file: Path, checkpoint: str) -> float:
    """BLEU the way validation and transformer-evaluate compute it (`validate.score`: NFC, the target
    language's tokenizer)."""
    from transformer.validate import score
    references = reference_file.read_text(encoding="utf-8").splitlines()
    return round(score(lines, references, _target_language(checkpoint))["bleu"], 2)


@functools.cache
def _target_language(checkpoint: str) -> str:
    from transformer.checkpoint import load_checkpoint
    return load_checkpoint(checkpoint, mmap=True)["config"]["data"]["tgt_lang"]


def bench_translate_cli(checkpoint: str, source_file: Path, reference_file: Path, repeats: int) -> list[dict]:
    """`transformer-translate CKPT --beam N < source_file` as a whole process, model load included."""
    rows = []
    for beam in (5, 1):
        times, lines = _timed([sys.executable, "-m", "transformer.translate", checkpoint, "--beam", str(beam)],
                              source_file, repeats)
        rows.append({"section": "translate_cli", "beam": beam, "file": str(source_file),
                     "seconds_median": statistics.median(times), "seconds_min": min(times),
                     "seconds_max": max(times), "repeats": repeats, "bleu": _bleu(lines, reference_file, checkpoint)})
    return rows


def bench_ctranslate2(checkpoint: str, source_file: Path, reference_file: Path, repeats: int,
                      ours_rows: list[dict] | None = None) -> list[dict]:
    """CTranslate2 rows beside `transformer-translate`'s (`ours_rows` from `bench_translate_cli`; timed
    here when not given)."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        print("bench: CTranslate2 section skipped (pip install ctranslate2)", file=sys.stderr)
        return []
    from transformer.checkpoint import load_checkpoint, model_from_checkpoint
    from transformer.export import export_ctranslate2

    def bleu(lines):
        return _bleu(lines, reference_file, checkpoint)

    ours_rows = ours_rows or bench_translate_cli(checkpoint, source_file, reference_file, repeats)
    ours = {row["beam"]: {"seconds": row["seconds_median"], "bleu": row["bleu"]} for row in ours_rows}
    _, ours_fp32_greedy = _timed([sys.executable, "-m", "transformer.translate", checkpoint, "--beam", "1",
                                  "--precision", "fp32"], source_file, 1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-ct2-") as tmp:
        model, tokenizer, config = model_from_checkpoint(load_checkpoint(checkpoint), checkpoint)
        for quantization in ("float32", "int8"):
            directory = export_ctranslate2(model, tokenizer, Path(tmp) / quantization, quantization)
            for beam in (5, 1):
                for inter, intra in THREAD_SETTINGS:
                    command = [sys.executable, str(Path(__file__).resolve()), "translate", str(directory),
                               "--beam", str(beam), "--compute-type", quantization,
                               "--inter-threads", str(inter), "--intra-threads", str(intra),
                               "--length-penalty", str(config.decode.alpha)]
                    times, lines = _timed(command, source_file, repeats)
                    row = {"section": "ctranslate2", "quantization": quantization, "beam": beam,
                           "inter_threads": inter, "intra_threads": intra, "seconds_median": statistics.median(times),
                           "bleu": bleu(lines), "ours_seconds_median": ours[beam]["seconds"],
                           "ours_bleu": ours[beam]["bleu"], "file": str(source_file), "repeats": repeats}
                    row["ours_over_ctranslate2"] = row["ours_seconds_median"] / row["seconds_median"]
                    if quantization == "float32" and beam == 1:
                        same = sum(a == b for a, b in zip(lines, ours_fp32_greedy))
                        row["identical_to_ours_fp32_greedy"] = same / max(1, len(lines))
                    rows.append(row)
    return rows


def print_row(row: dict) -> None:
    same = (f" | identical to ours (fp32 greedy) {100 * row['identical_to_ours_fp32_greedy']:.1f}%"
            if "identical_to_ours_fp32_greedy" in row else "")
    print(f"ctranslate2 {row['quantization']:7s} beam {row['beam']} ({row['inter_threads']}x{row['intra_threads']} "
          f"threads) | {row['seconds_median']:.2f} s BLEU {row['bleu']:.2f} | transformer-translate "
          f"{row['ours_seconds_median']:.2f} s BLEU {row['ours_bleu']:.2f} | ours/ct2 "
          f"{row['ours_over_ctranslate2']:.2f}x{same}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["translate"]:
        sys.exit(translate_main(sys.argv[2:]))
    parser = argparse.ArgumentParser(description="CTranslate2 against transformer-translate, whole processes")
    parser.add_argument("checkpoint")
    parser.add_argument("source")
    parser.add_argument("reference")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    rows = bench_ctranslate2(args.checkpoint, Path(args.source), Path(args.reference), args.repeats)
    for r in rows:
        print_row(r)
