"""The data sections of `make bench` (imported by bench.py; `python scripts/bench_data.py` runs them alone).

data       : seconds to prepare Multi30k train + validation with the SentencePiece model cached (encoding
             included) and with everything cached, epoch-0 batching, padding share, collate time of
             8k-token batches (vectorised, and the plain per-sentence loop it replaced, for scale).
data_scale : Multi30k train repeated to 1M and 4.5M pairs (WMT14 en-de's size); per size, whole processes
             of `transformer.train model=tiny trainer.max_steps=1`: cold (nothing cached: SentencePiece,
             encoding, batching, one step) and warm (everything cached and checked), wall time, time to
             the end of the first step (from the log), peak RSS and peak anonymous memory (RssAnon, sampled
             from /proc: what memory-mapped files do not explain, paid again by every rank) and the anonymous
             bytes each pair adds between two sizes; the seconds that checking the prepared training
             split takes (sizes and CRC-32 of every file, part of every warm start); for the largest, also
             a cold `torchrun --nproc_per_node=2` run: peak RSS of the largest rank (and its anonymous
             memory) and the number of prepared corpus directories (one per split: prepared once).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer.data.batching import TokenBatchSampler  # noqa: E402
from transformer.data.corpus import check_prepared  # noqa: E402
from transformer.data.prepare import prepare  # noqa: E402
from transformer.special import BOS_ID, EOS_ID, PAD_ID  # noqa: E402


def _loop_collate(corpus, positions):
    """The per-sentence Python loop that collated batches before (for scale only)."""
    pairs = [corpus.ids(p) for p in positions]
    out = []
    for prefix, suffix, side in (([], [EOS_ID], 0), ([BOS_ID], [], 1), ([], [EOS_ID], 1)):
        seqs = [[*prefix, *pair[side], *suffix] for pair in pairs]
        tensor = torch.full((len(seqs), max(map(len, seqs))), PAD_ID, dtype=torch.long)
        for row, seq in enumerate(seqs):
            tensor[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        out.append(tensor)
    return out


def bench_data(cfg) -> dict:
    data_cfg = cfg.data
    prepare(data_cfg)  # make sure the SentencePiece model is cached
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(Path(data_cfg.cache_dir) / "spm", Path(tmp) / "spm")
        data_cfg.cache_dir = tmp
        timings = {}
        for name in ("spm_cached", "all_cached"):  # first pass encodes, second reads the cache
            started = time.perf_counter()
            prepared = prepare(data_cfg)
            batches = TokenBatchSampler(
                prepared.train.src_lens, prepared.train.tgt_lens, cfg.trainer.max_tokens, seed=1
            ).batches(0)
            timings[name] = time.perf_counter() - started
        train = prepared.train
        real = padded = 0
        for indices in batches:
            batch = train.collate(indices)
            real += int((batch.src != PAD_ID).sum() + (batch.tgt_out != PAD_ID).sum())
            padded += batch.src.numel() + batch.tgt_out.numel()
        big = TokenBatchSampler(train.src_lens, train.tgt_lens, 8192, seed=1).batches(0)
        sample = [big[k] for k in range(min(200, len(big)))]
        collate_ms, loop_ms = [], []
        for indices in sample:
            start = time.perf_counter()
            train.collate(indices)
            collate_ms.append(1000 * (time.perf_counter() - start))
            start = time.perf_counter()
            _loop_collate(train, indices)
            loop_ms.append(1000 * (time.perf_counter() - start))
    return {
        "section": "data",
        "prepare_spm_cached_s": timings["spm_cached"],
        "prepare_all_cached_s": timings["all_cached"],
        "batches": len(batches),
        "max_tokens": cfg.trainer.max_tokens,
        "padding_share": 1 - real / padded,
        "collate_8k_ms_median": statistics.median(collate_ms),
        "collate_8k_loop_ms_median": statistics.median(loop_ms),
        "collate_8k_sentences_mean": float(np.mean([len(b) for b in sample])),
    }


def _repeat_corpus(multi30k: Path, pairs: int, folder: Path) -> None:
    """`pairs` lines of Multi30k train, repeated, plus its validation and test files."""
    if (folder / "train.en").exists() and sum(1 for _ in open(folder / "train.en", "rb")) == pairs:
        return
    folder.mkdir(parents=True, exist_ok=True)
    for lang in ("de", "en"):
        lines = (multi30k / f"train.{lang}").read_bytes().splitlines(keepends=True)
        copies, rest = divmod(pairs, len(lines))
        with open(folder / f"train.{lang}", "wb") as out:
            for _ in range(copies):
                out.writelines(lines)
            out.writelines(lines[:rest])
        for split in ("val", "test_2016_flickr"):
            shutil.copy(multi30k / f"{split}.{lang}", folder / f"{split}.{lang}")


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it (from /proc/PID/task/*/children)."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        for children in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                queue += [int(child) for child in children.read_text().split()]
            except OSError:  # ended meanwhile
                pass
    return found


def _memory_kb(pid: int) -> tuple[int, int]:
    """(RssAnon, VmRSS) of a process in KB; (0, 0) once it has ended."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0, 0
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return tuple(int(fields.get(key, "0 kB").split()[0]) for key in ("RssAnon", "VmRSS"))


def _timed(command: list[str], log: Path) -> tuple[float, float, float]:
    """(wall seconds, peak RSS in MB, peak anonymous memory in MB) of a command run to completion, the
    peaks those of its largest process (the training process, or a torchrun rank), sampled from /proc
    every 0.2 s. Anonymous memory (RssAnon) is what memory-mapped files do not explain: what every rank
    pays again."""
    started = time.perf_counter()
    rss = anon = 0
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        while process.poll() is None:
            for pid in _descendants(process.pid):
                pid_anon, pid_rss = _memory_kb(pid)
                anon, rss = max(anon, pid_anon), max(rss, pid_rss)
            time.sleep(0.2)
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} failed (exit {process.returncode}); see {log}")
    return time.perf_counter() - started, rss / 1024, anon / 1024


def _to_first_step(log: Path, started: float) -> float:
    """Seconds from `started` (time.time()) to the log line that says the first step is done."""
    line = next(line for line in log.read_text().splitlines() if "reached trainer.max_steps" in line)
    return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp() - started


def bench_data_scale(multi30k: Path, sizes: list[int], folder: Path) -> list[dict]:
    rows = []
    for pairs in sizes:
        corpus = folder / str(pairs)
        _repeat_corpus(multi30k, pairs, corpus)
        cache = corpus / "cache"
        shutil.rmtree(cache, ignore_errors=True)
        # The run validates once at its end: on one sentence and without EMA, since an untrained model
        # decodes every sentence to its length limit (a minute of decoding, not of starting up).
        args = [
            "-m",
            "transformer.train",
            "data=multi30k_de_en",
            f"data.path={corpus}",
            f"data.cache_dir={cache}",
            "model=tiny",
            "trainer.max_steps=1",
            "trainer.test_at_end=false",
            "trainer.validate_every=1000000",
            "trainer.val_max_sentences=1",
            "trainer.ema_decay=0",
            "trainer.average_last=0",
            "trainer.overwrite=true",
            f"hydra.run.dir={corpus / 'run'}",
        ]
        row = {"section": "data_scale", "pairs": pairs}
        for run in ("cold", "warm"):
            started = time.time()
            row[f"{run}_s"], row[f"{run}_rss_mb"], row[f"{run}_anon_mb"] = _timed(
                [sys.executable, *args], corpus / f"{run}.log"
            )
            row[f"{run}_first_step_s"] = _to_first_step(corpus / f"{run}.log", started)
        (train_dir,) = (cache / "corpus").glob("*.train.*")
        started = time.perf_counter()
        check_prepared(train_dir)
        row["check_s"] = time.perf_counter() - started
        row["train_split_mb"] = sum(file.stat().st_size for file in train_dir.iterdir()) / 1e6
        if pairs == max(sizes):
            shutil.rmtree(cache, ignore_errors=True)
            ddp = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
            row["ddp2_cold_s"], row["ddp2_max_rss_mb"], row["ddp2_max_anon_mb"] = _timed(ddp, corpus / "ddp.log")
            row["ddp2_corpus_dirs"] = len(list((cache / "corpus").iterdir()))
        if rows:  # what each pair more costs, between the previous size and this one
            previous = rows[-1]
            for run in ("cold", "warm"):
                extra_mb = row[f"{run}_anon_mb"] - previous[f"{run}_anon_mb"]
                row[f"{run}_anon_bytes_per_pair"] = extra_mb * 2**20 / (pairs - previous["pairs"])
        rows.append(row)
        print_row(row)
    return rows


def print_row(row: dict) -> None:
    if row["section"] == "data":
        print(
            f"data   prepare Multi30k (SentencePiece cached) {row['prepare_spm_cached_s']:.1f} s | all cached "
            f"{row['prepare_all_cached_s']:.2f} s | {row['batches']} batches of max_tokens={row['max_tokens']} | "
            f"padding {100 * row['padding_share']:.1f}% | collate 8k-token batch {row['collate_8k_ms_median']:.2f} ms "
            f"(per-sentence loop {row['collate_8k_loop_ms_median']:.2f} ms)"
        )
    else:
        ddp = (
            f" | torchrun x2 cold {row['ddp2_cold_s']:.0f} s, largest rank {row['ddp2_max_rss_mb']:.0f} MB "
            f"({row['ddp2_max_anon_mb']:.0f} MB anonymous), {row['ddp2_corpus_dirs']} corpus dirs"
            if "ddp2_cold_s" in row
            else ""
        )
        per_pair = (
            f" | {row['cold_anon_bytes_per_pair']:.1f} / {row['warm_anon_bytes_per_pair']:.1f} anonymous bytes a "
            "pair more than the size before (cold / warm)"
            if "warm_anon_bytes_per_pair" in row
            else ""
        )
        print(
            f"scale  {row['pairs']:>9,} pairs | cold {row['cold_s']:6.1f} s (first step after "
            f"{row['cold_first_step_s']:.1f} s), {row['cold_rss_mb']:5.0f} MB, {row['cold_anon_mb']:5.0f} MB "
            f"anonymous | warm {row['warm_s']:5.1f} s (first step after {row['warm_first_step_s']:.1f} s), "
            f"{row['warm_rss_mb']:5.0f} MB, {row['warm_anon_mb']:5.0f} MB anonymous, checking the "
            f"{row['train_split_mb']:.0f} MB training split {row['check_s']:.2f} s{per_pair}{ddp}"
        )


if __name__ == "__main__":
    import argparse
    import os

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000000,4500000")
    parser.add_argument("--folder", default="/tmp/bench-data-scale")
    args = parser.parse_args()
    bench_data_scale(Path(os.environ["MULTI30K_DIR"]), [int(x) for x in args.sizes.split(",")], Path(args.folder))
