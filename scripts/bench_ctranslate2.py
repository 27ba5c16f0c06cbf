"""The bench's whole-process translation sections: `transformer-translate` in its settings (defaults,
--workers 1, --quantize int8) and the checkpoint exported with `transformer-export --format
ctranslate2` (float32 and int8, each thread setting) translating the same files beside it, with BLEU,
each row's ratio to CTranslate2's fastest, the share of sentences where CTranslate2's fp32 greedy
output equals ours, our start-up time, and optionally an ensemble against its members. Every row also
carries its own start-up (the same command on empty input) and the time it spent translating, the
whole time less that start-up, with the ratio of those: throughput, what a long-running process
(a pipe, `Translator`) sees, where torch's import is paid once. CTranslate2's length penalty is set
to the checkpoint's decode.alpha (its normalisation differs slightly from our GNMT formula: with both
at 0.6, validation BLEU of the README's model was 40.14 against our 40.13).

Run alone: `python scripts/bench_ctranslate2.py CKPT SOURCE REFERENCE [--lines N] [--ensemble CKPT2 ...]
[--fastest]`.
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
    parser.add_argument(
        "--length-penalty",
        type=float,
        default=1.0,
        help="CTranslate2's length_penalty (the bench passes the checkpoint's decode.alpha)",
    )
    args = parser.parse_args(argv)
    folder = Path(args.model_dir)
    joint = (folder / "spm.model").exists()
    src = spm.SentencePieceProcessor(model_file=str(folder / ("spm.model" if joint else "src.spm.model")))
    tgt = src if joint else spm.SentencePieceProcessor(model_file=str(folder / "tgt.spm.model"))
    lines = sys.stdin.buffer.read().decode("utf-8").splitlines()
    translator = ctranslate2.Translator(
        str(folder),
        device="cpu",
        compute_type=args.compute_type,
        inter_threads=args.inter_threads,
        intra_threads=args.intra_threads,
    )
    pieces = src.encode([line.strip() for line in lines], out_type=str)
    results = translator.translate_iterable(
        pieces, max_batch_size=args.batch_size, beam_size=args.beam, length_penalty=args.length_penalty
    )
    out = [tgt.decode(result.hypotheses[0]) for result in results]
    sys.stdout.buffer.write("".join(text + "\n" for text in out).encode("utf-8"))
    return 0


def first_lines(path: Path, count: int, folder: Path) -> Path:
    """A copy of the first `count` lines of `path` in `folder`."""
    out = folder / f"{path.stem}.first{count}{path.suffix}"
    with open(path, encoding="utf-8") as source:
        out.write_text("".join(line for _, line in zip(range(count), source)), encoding="utf-8")
    return out


def _timed(command: list[str], source_file: Path, repeats: int) -> tuple[list[float], list[str]]:
    times, output = [], ""
    for _ in range(repeats):
        start = time.perf_counter()
        with open(source_file, "rb") as source:
            result = subprocess.run(command, stdin=source, capture_output=True, check=True, cwd=ROOT)
        times.append(time.perf_counter() - start)
        output = result.stdout.decode("utf-8")
    return times, output.splitlines()


def _startup_seconds(command: list[str], repeats: int, known: dict) -> float:
    """Median time of `command` on empty input (the interpreter, the imports, the model; nothing to
    translate), measured once per command: `known` holds what earlier rows measured."""
    key = tuple(command)
    if key not in known:
        with tempfile.NamedTemporaryFile(suffix=".txt") as empty:
            times, _ = _timed(command, Path(empty.name), repeats)
        known[key] = statistics.median(times)
    return known[key]


def _with_startup(row: dict, command: list[str], repeats: int, known: dict) -> dict:
    """`row` with its command's start-up (the beam left out: start-up does not depend on it) and the
    seconds it spent translating, its median time less that start-up (at least a millisecond: on a
    file of a few lines the two medians may cross, and the ratios divide by it)."""
    at = command.index("--beam")
    startup = _startup_seconds(command[:at] + command[at + 2 :], repeats, known)
    return {**row, "startup_seconds": startup, "translating_seconds": max(row["seconds_median"] - startup, 1e-3)}


def _bleu(lines: list[str], reference_file: Path, checkpoint: str) -> float:
    """BLEU the way validation and transformer-evaluate compute it (`validate.score`: NFC, the target
    language's tokenizer)."""
    from transformer.inference.scoring import score

    references = reference_file.read_text(encoding="utf-8").splitlines()
    return round(score(lines, references, _target_language(checkpoint))["bleu"], 2)


@functools.cache
def _target_language(checkpoint: str) -> str:
    from transformer.checkpoint import load_checkpoint

    return load_checkpoint(checkpoint, mmap=True)["config"]["data"]["tgt_lang"]


# transformer-translate's settings beside CTranslate2's: its defaults (auto precision: bf16 on this CPU;
# one worker per core), one batch at a time on every core (the release before workers), and int8.
OURS_SETTINGS = {"default": [], "--workers 1": ["--workers", "1"], "--quantize int8": ["--quantize", "int8"]}


def bench_translate_cli(
    checkpoints: list[str],
    source_file: Path,
    reference_file: Path,
    repeats: int,
    settings: dict[str, list[str]] = OURS_SETTINGS,
    beams=(5, 1),
    startups: dict | None = None,
) -> list[dict]:
    """`transformer-translate CKPT... --beam N [flags] < source_file` as whole processes, model load
    included; each row with its start-up (`_with_startup`; `startups` keeps them across calls)."""
    rows, startups = [], {} if startups is None else startups
    for beam in beams:
        for setting, flags in settings.items():
            command = [sys.executable, "-m", "transformer.cli.translate", *checkpoints, "--beam", str(beam), *flags]
            times, lines = _timed(command, source_file, repeats)
            row = {
                "section": "translate_cli",
                "engine": "transformer-translate",
                "setting": setting,
                "checkpoints": len(checkpoints),
                "beam": beam,
                "file": str(source_file),
                "sentences": len(lines),
                "seconds_median": statistics.median(times),
                "seconds_min": min(times),
                "seconds_max": max(times),
                "repeats": repeats,
                "bleu": _bleu(lines, reference_file, checkpoints[0]),
            }
            rows.append(_with_startup(row, command, repeats, startups))
    return rows


def bench_startup(checkpoint: str, repeats: int) -> dict:
    """A whole `transformer-translate` process on empty input: Python, torch, the model, no decoding."""
    with tempfile.NamedTemporaryFile(suffix=".de") as empty:
        times, _ = _timed([sys.executable, "-m", "transformer.cli.translate", checkpoint], Path(empty.name), repeats)
    return {"section": "translate_startup", "seconds_median": statistics.median(times), "repeats": repeats}


def bench_ctranslate2(
    checkpoint: str,
    source_file: Path,
    reference_file: Path,
    repeats: int,
    startups: dict | None = None,
    fastest: bool = False,
) -> list[dict]:
    """The same file through CTranslate2 (the checkpoint exported in float32 and int8, every thread
    setting), as whole processes, each row with its start-up (`_with_startup`); the fp32 greedy rows say
    how many lines equal ours. `fastest`: only its fastest setting here (int8, two single-thread workers)."""
    startups = {} if startups is None else startups
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        print("bench: CTranslate2 section skipped (pip install ctranslate2)", file=sys.stderr)
        return []
    from transformer.checkpoint import load_checkpoint, model_from_checkpoint
    from transformer.inference.ctranslate2 import export_ctranslate2

    quantizations, thread_settings = (
        (("int8",), THREAD_SETTINGS[:1]) if fastest else (("float32", "int8"), THREAD_SETTINGS)
    )
    if not fastest:
        _, ours_fp32_greedy = _timed(
            [sys.executable, "-m", "transformer.cli.translate", checkpoint, "--beam", "1", "--precision", "fp32"],
            source_file,
            1,
        )
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-ct2-") as tmp:
        model, tokenizer, config = model_from_checkpoint(load_checkpoint(checkpoint), checkpoint)
        for quantization in quantizations:
            directory = export_ctranslate2(model, tokenizer, Path(tmp) / quantization, quantization)
            for beam in (5, 1):
                for inter, intra in thread_settings:
                    command = [
                        sys.executable,
                        str(Path(__file__).resolve()),
                        "translate",
                        str(directory),
                        "--beam",
                        str(beam),
                        "--compute-type",
                        quantization,
                        "--inter-threads",
                        str(inter),
                        "--intra-threads",
                        str(intra),
                        "--length-penalty",
                        str(config.decode.alpha),
                    ]
                    times, lines = _timed(command, source_file, repeats)
                    row = {
                        "section": "ctranslate2",
                        "engine": "ctranslate2",
                        "setting": f"{quantization}, {inter} worker(s) x {intra} thread(s)",
                        "beam": beam,
                        "file": str(source_file),
                        "sentences": len(lines),
                        "seconds_median": statistics.median(times),
                        "repeats": repeats,
                        "bleu": _bleu(lines, reference_file, checkpoint),
                    }
                    if quantization == "float32" and beam == 1:
                        same = sum(a == b for a, b in zip(lines, ours_fp32_greedy))
                        row["identical_to_ours_fp32_greedy"] = same / max(1, len(lines))
                    rows.append(_with_startup(row, command, repeats, startups))
    return rows


def bench_translation(
    checkpoint: str, files: list[tuple[Path, Path]], repeats: int, ensemble: list[str] = (), fastest: bool = False
) -> list[dict]:
    """For each (source, reference) file: our settings and CTranslate2's side by side, each row with its
    ratio to CTranslate2's fastest at the same beam, with and without start-up; start-up; and, given
    `ensemble` (more checkpoints of the same vocabulary), each model alone and all together on the first
    file at beam 5. `fastest`: only each engine's fastest settings (ours: defaults and int8)."""
    rows, startups = [bench_startup(checkpoint, repeats)], {}
    settings = {k: v for k, v in OURS_SETTINGS.items() if k != "--workers 1"} if fastest else OURS_SETTINGS
    for source_file, reference_file in files:
        ours = bench_translate_cli([checkpoint], source_file, reference_file, repeats, settings, startups=startups)
        theirs = bench_ctranslate2(checkpoint, source_file, reference_file, repeats, startups, fastest)
        for beam in (5, 1):
            at_beam = [r for r in theirs if r["beam"] == beam]
            if not at_beam:
                continue
            best = min(r["seconds_median"] for r in at_beam)
            best_translating = min(r["translating_seconds"] for r in at_beam)
            for row in ours + theirs:
                if row["beam"] == beam:
                    row["over_ctranslate2_best"] = row["seconds_median"] / best
                    row["translating_over_ctranslate2_best"] = row["translating_seconds"] / best_translating
        rows += ours + theirs
    if ensemble:
        source_file, reference_file = files[0]
        members = [checkpoint, *ensemble]
        for each in members:
            rows += bench_translate_cli(
                [each], source_file, reference_file, repeats, {"ensemble member": []}, (5,), startups
            )
        rows += bench_translate_cli(members, source_file, reference_file, repeats, {"ensemble": []}, (5,), startups)
    return rows


def print_row(row: dict) -> None:
    if row["section"] == "translate_startup":
        print(f"transformer-translate start-up (empty input: Python, torch, the model) | {row['seconds_median']:.2f} s")
        return
    same = (
        f" | identical to ours (fp32 greedy) {100 * row['identical_to_ours_fp32_greedy']:.1f}%"
        if "identical_to_ours_fp32_greedy" in row
        else ""
    )
    ratio = f" | {row['over_ctranslate2_best']:.2f}x CTranslate2's fastest" if "over_ctranslate2_best" in row else ""
    if "translating_seconds" in row:
        ratio += f" | start-up {row['startup_seconds']:.2f} s, translating {row['translating_seconds']:.2f} s"
        if "translating_over_ctranslate2_best" in row:
            ratio += f" ({row['translating_over_ctranslate2_best']:.2f}x)"
    models = f" ({row['checkpoints']} models)" if row.get("checkpoints", 1) > 1 else ""
    print(
        f"{row['engine']:21s} {row['setting']:36s}{models} beam {row['beam']} | {Path(row['file']).name} "
        f"{row['sentences']} lines | {row['seconds_median']:6.2f} s | BLEU {row['bleu']:.2f}{ratio}{same}"
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["translate"]:
        sys.exit(translate_main(sys.argv[2:]))
    parser = argparse.ArgumentParser(description="CTranslate2 against transformer-translate, whole processes")
    parser.add_argument("checkpoint")
    parser.add_argument("source")
    parser.add_argument("reference")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lines", type=int, default=0, help="only the first N lines of source and reference")
    parser.add_argument("--ensemble", nargs="*", default=[], help="more checkpoints: ensemble rows on this file")
    parser.add_argument(
        "--fastest",
        action="store_true",
        help="only each engine's fastest settings (CTranslate2 int8 2x1; ours defaults and int8)",
    )
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    files = [(Path(args.source), Path(args.reference))]
    with tempfile.TemporaryDirectory(prefix="bench-lines-") as tmp:
        if args.lines:
            files = [(first_lines(files[0][0], args.lines, Path(tmp)), first_lines(files[0][1], args.lines, Path(tmp)))]
        for r in bench_translation(args.checkpoint, files, args.repeats, args.ensemble, args.fastest):
            print_row(r)
