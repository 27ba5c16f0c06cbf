"""`bash scripts/gpu_check.sh matrix`: the trainer's own step on a GPU by model, precision, compile and batch
budget, in one call: a printed table, and the rows as JSON in docs/gpu/<date>-<device>.json and in --out.

    python scripts/gpu_matrix.py matrix --data-dir MULTI30K --out DIR [--seconds 420] [--only base/bf16]
    python scripts/gpu_matrix.py matrix --tiny ...     # a tiny model on the CPU, a few steps: the script's own check

What a row measures: `Trainer.train_step` as `make train` runs it (DataLoader, collate, copy to the device, forward,
fused loss, backward, clipping, fused AdamW), timed by scripts/bench.py's `_time_trainer` on Multi30k after a
warm-up (for `trainer.compile=true`, until the compiler has settled), so the figures are steady-state ones:
target tokens/s, MFU (transformer/flops.py: the batches' model FLOPs over the device's dense bf16 peak), the peak
of allocated GPU memory over the timed steps, and the share of the step the GPU was busy.

The GPU's busy share is measured in a separate window of steps right after the timed ones, under
`torch.profiler` with CUDA activity only (CUPTI): the union of the kernels', copies' and memsets' device intervals
over the host's wall time of the same steps. Why not CUDA events: events around a step give its device-side
elapsed time, which includes the gaps in which the GPU waits for the host to launch the next kernel, so on a
host-bound step they read the wall time, not the busy time; NVML's utilisation is sampled over 1/6 s to 1 s
periods and counts a period busy if one kernel ran, too coarse for a window of a few seconds. The profiler adds
a little host time per launch, so it does not run in the timed window; its window's own tokens/s is kept beside
the share (`busy_window_tokens_per_s`) to show how close the two windows are.

The matrix (`FULL`: base and big x bf16 and fp32 x eager and compiled x 4k, 16k, 32k target tokens and
`trainer.max_tokens_auto=true`, 32 rows) is pruned to `GPU_PLAN` (14 rows, in the order they run, most wanted
first): bf16 eager everywhere; fp32 at 4k and 32k for base, 32k for big; compiled bf16 at 4k and 32k for base,
32k for big; the auto budget in bf16 eager. Each row's time is capped (the timed window is about
`row_seconds`, the warm-up has its own cap), a row whose estimate does not fit in what is left of --seconds is
skipped (status `skipped: time`), and a row is skipped after an out-of-memory of the same model and precision at
a smaller or equal budget. The estimate of the whole plan is printed first. The JSON is rewritten after every
row, so a call cut short still returns the rows done; rows of other sources in the same file (the `onmt`
stage's "opennmt-py base", scripts/gpu_onmt.py) are kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

MODELS = ("base", "big")
PRECISIONS = ("bf16", "fp32")
BUDGETS = (4096, 16384, 32768, "auto")
AUTO_START = 8192  # trainer.max_tokens the auto search starts from (it doubles and bisects from there)
BUSY_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}  # chrome-trace categories of device work
BUSY_METHOD = (
    "torch.profiler, CUDA activity only: union of kernel, memcpy and memset device intervals over the host "
    "wall time of the same steps, in a window right after the timed one"
)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One row of the matrix: `budget` is trainer.max_tokens, or "auto" for trainer.max_tokens_auto=true."""

    model: str
    precision: str
    compiled: bool
    budget: int | str

    @property
    def label(self) -> str:
        return f"{self.model}/{self.precision}/{'compiled' if self.compiled else 'eager'}/{self.budget}"


FULL = [Spec(m, p, c, b) for m in MODELS for p in PRECISIONS for c in (False, True) for b in BUDGETS]
GPU_PLAN = [
    Spec("base", "bf16", False, 4096),
    Spec("base", "bf16", False, 16384),
    Spec("base", "bf16", False, 32768),
    Spec("big", "bf16", False, 4096),
    Spec("big", "bf16", False, 16384),
    Spec("big", "bf16", False, 32768),
    Spec("base", "fp32", False, 4096),
    Spec("base", "fp32", False, 32768),
    Spec("base", "bf16", True, 4096),
    Spec("base", "bf16", False, "auto"),
    Spec("big", "bf16", False, "auto"),
    Spec("base", "bf16", True, 32768),
    Spec("big", "fp32", False, 32768),
    Spec("big", "bf16", True, 32768),
]
# --tiny: the script's own check on a CPU (model=small made tiny by TINY_MODEL, fp32, a few steps; the compiled
# row compiles for about a minute on a 2-core CPU: `--only /eager/` leaves it out)
TINY_PLAN = [
    Spec("small", "fp32", False, 1024),
    Spec("small", "fp32", False, 2048),
    Spec("small", "fp32", False, "auto"),
    Spec("small", "fp32", True, 1024),
]
TINY_MODEL = [
    "model.d_model=64",
    "model.n_heads=4",
    "model.d_ff=128",
    "model.encoder_layers=1",
    "model.decoder_layers=1",
]


@dataclasses.dataclass
class Settings:
    """How long a row runs: warm-up steps (eager), the warm-up's caps, the timed window's target length and its
    step bounds, the busy-share window's length and step bound."""

    warm_steps: int = 5
    warm_cap_eager: float = 10.0
    warm_cap_compiled: float = 150.0
    row_seconds: float = 5.0
    min_steps: int = 10
    max_steps: int = 400
    busy_seconds: float = 2.0
    busy_max_steps: int = 12


@dataclasses.dataclass
class Estimates:
    """Seconds a row is expected to take, by part (guesses from the earlier GPU runs in docs/benchmarks.md:
    a model=base layer graph compiled in tens of seconds, eager steps of 30-150 ms)."""

    setup: float = 4.0  # Trainer: model on the device, DataLoader workers
    warm: float = 2.0
    timed: float = 6.0  # row_seconds and _time_trainer's own 5 warm-up steps
    busy: float = 3.0  # two steps, the profiled window, the trace read back
    auto_search: float = 30.0  # about 17 probes of the longest batch, each a forward and backward
    compile_first: float = 80.0  # a model's first compile in this process
    compile_again: float = 25.0  # the same model again (inductor's caches warm)
    startup: float = 20.0  # imports, data preparation, the profiler's first start

    def row(self, spec: Spec, compiled_models: set[str]) -> float:
        seconds = self.setup + self.warm + self.timed + self.busy
        if spec.budget == "auto":
            seconds += self.auto_search
        if spec.compiled:
            seconds += self.compile_again if spec.model in compiled_models else self.compile_first
        return seconds


TINY_SETTINGS = Settings(
    warm_steps=2, warm_cap_eager=5, warm_cap_compiled=60, row_seconds=0.5, min_steps=3, max_steps=10, busy_max_steps=3
)
TINY_ESTIMATES = Estimates(
    setup=1, warm=0.5, timed=1, busy=0, auto_search=0, compile_first=30, compile_again=10, startup=5
)


# --- the plan: what runs, what is skipped -----------------------------------------------------------------------


def pruned(plan: list[Spec]) -> list[Spec]:
    """The rows of the full matrix the plan leaves out."""
    return [spec for spec in FULL if spec not in plan]


def blocked_by_oom(spec: Spec, oom: list[Spec]) -> Spec | None:
    """An earlier row of the same model and precision that ran out of memory at a budget no larger than this
    row's (an auto budget is sized to fit: never blocked), or None."""
    if spec.budget == "auto":
        return None
    return next(
        (
            o
            for o in oom
            if o.model == spec.model
            and o.precision == spec.precision
            and o.budget != "auto"
            and o.budget <= spec.budget
        ),
        None,
    )


def base_row(spec: Spec, status: str) -> dict:
    return {
        "model": spec.model,
        "precision": spec.precision,
        "compiled": spec.compiled,
        "batch_tokens": spec.budget,
        "batch_tokens_chosen": None if spec.budget == "auto" else spec.budget,
        "target_tokens_per_s": None,
        "mfu": None,
        "peak_memory_mb": None,
        "gpu_busy_share": None,
        "steps": 0,
        "status": status,
    }


def run_plan(
    plan: list[Spec],
    measure: Callable[[Spec, float], dict],
    seconds: float,
    estimates: Estimates,
    clock: Callable[[], float] = time.monotonic,
    on_row: Callable[[list[dict]], None] = lambda rows: None,
) -> list[dict]:
    """Each row of `plan` in order through `measure(spec, seconds_left) -> row`, within `seconds` from now: a
    row whose estimate does not fit in the time left is skipped (later, cheaper rows may still run), and so is
    one `blocked_by_oom`; an exception becomes the row's status. `on_row(rows so far)` after each row."""
    start = clock()
    rows, oom, compiled_models = [], [], set()
    for spec in plan:
        left = seconds - (clock() - start)
        estimate = estimates.row(spec, compiled_models)
        blocker = blocked_by_oom(spec, oom)
        if blocker is not None:
            row = base_row(spec, f"skipped: out of memory at {blocker.label}")
        elif estimate > left:
            row = base_row(spec, f"skipped: time (estimate {estimate:.0f} s, {max(left, 0):.0f} s left)")
        else:
            began = clock()
            try:
                row = measure(spec, left)
            except Exception as error:  # a row's failure is its status, the next rows still run
                row = base_row(spec, f"error: {type(error).__name__}: {error}"[:400])
                if _is_oom(error):
                    row["status"] = f"oom: {error}"[:400]
            row["seconds"] = round(clock() - began, 1)
            row["estimate_seconds"] = round(estimate)
            if spec.compiled:
                compiled_models.add(spec.model)
            if row["status"].startswith("oom"):
                oom.append(spec)
        rows.append(row)
        on_row(rows)
    return rows


def predicted_schedule(plan: list[Spec], seconds: float, estimates: Estimates) -> tuple[float, list[Spec]]:
    """(the plan's estimated total seconds, the rows that would be skipped for time if every row took its
    estimate): what is printed before the first row."""
    total, used, cut, compiled_models = 0.0, 0.0, [], set()
    for spec in plan:
        estimate = estimates.row(spec, compiled_models)
        total += estimate
        if used + estimate > seconds:
            cut.append(spec)
            continue
        used += estimate
        if spec.compiled:
            compiled_models.add(spec.model)
    return total, cut


def _is_oom(error: BaseException) -> bool:
    return "out of memory" in str(error).lower() or type(error).__name__ == "OutOfMemoryError"


# --- the busy share ----------------------------------------------------------------------------------------------


def busy_seconds(trace_events: list[dict]) -> float:
    """Seconds in which the device ran at least one kernel, copy or memset: the union of those chrome-trace
    events' [ts, ts + dur] intervals (microseconds), so that overlapping work on two streams counts once."""
    spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in trace_events
        if str(e.get("cat", "")).lower() in BUSY_CATEGORIES and e.get("ph", "X") == "X" and "ts" in e
    )
    busy, end = 0.0, -math.inf
    for lo, hi in spans:
        if hi <= end:
            continue
        busy += hi - max(lo, end)
        end = hi
    return busy / 1e6


# --- one row on a device -----------------------------------------------------------------------------------------


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one_step(trainer, loader) -> None:
    micro, _ = next(loader)
    trainer.step.log.add(trainer.step(micro), micro)


def warm_up(trainer, device, compiled: bool, settings: Settings, cap: float) -> dict:
    """Steps until the step time has settled: `settings.warm_steps` eager; compiled, until the last four steps
    are within 3x of each other (no compile among them) and at least 8 were made. Stops at `cap` seconds."""
    from bench import _epochs

    loader = _epochs(trainer)
    times: list[float] = []
    start = time.perf_counter()
    cut = False
    while True:
        began = time.perf_counter()
        _one_step(trainer, loader)
        _sync(device)
        times.append(time.perf_counter() - began)
        last = times[-4:]
        settled = len(times) >= (8 if compiled else settings.warm_steps) and (
            not compiled or max(last) <= 3 * min(last)
        )
        if settled:
            break
        if time.perf_counter() - start > cap:
            cut = True
            break
    trainer.step.log.read()
    return {
        "warmup_steps": len(times),
        "warmup_seconds": round(time.perf_counter() - start, 2),
        "first_step_seconds": round(times[0], 2),
        "warmup_cut": cut,
        "step_seconds": statistics.median(times[-4:]),
    }


def busy_window(trainer, device, steps: int, activities=None) -> dict:
    """The GPU's busy share over `steps` steps (see the module docstring), after two steps outside the profile
    (the loader restarts its epoch). `activities`: the profiler's (default CUDA only; a CPU test passes CPU)."""
    from bench import _epochs
    from torch.profiler import ProfilerActivity, profile

    loader = _epochs(trainer)
    for _ in range(2):
        _one_step(trainer, loader)
    trainer.step.log.read()
    _sync(device)
    with tempfile.TemporaryDirectory() as folder:
        with profile(activities=activities or [ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                _one_step(trainer, loader)
            numbers = trainer.step.log.read()
            _sync(device)
            wall = time.perf_counter() - start
        began = time.perf_counter()
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    busy = busy_seconds(events)
    result = {
        "gpu_busy_share": busy / wall if wall > 0 else None,
        "busy_steps": steps,
        "busy_window_tokens_per_s": numbers["tokens"] / wall if wall > 0 else None,
        "busy_trace_seconds": round(time.perf_counter() - began, 2),
    }
    if busy == 0:  # no device work found: say what the trace held instead
        result["busy_trace_categories"] = sorted({str(e.get("cat")) for e in events})[:20]
    return result


def measure_row(spec: Spec, left: float, overrides: list[str], device_name: str, settings: Settings) -> dict:
    """One row: a fresh Trainer with the row's settings, a warm-up, `_time_trainer`'s timed window and on CUDA the
    busy-share window; the trainer is torn down afterwards (and the compiler's caches reset after a compiled row)."""
    import torch
    from bench import _time_trainer

    from transformer.compose import compose
    from transformer.training.trainer import Trainer

    device = torch.device(device_name)
    budget = (
        ["trainer.max_tokens_auto=true", f"trainer.max_tokens={AUTO_START}"]
        if spec.budget == "auto"
        else [f"trainer.max_tokens={spec.budget}"]
    )
    cfg = compose(
        overrides
        + [f"model={spec.model}"]
        + budget
        + [
            f"trainer.precision={spec.precision}",
            f"trainer.compile={str(spec.compiled).lower()}",
            f"trainer.device={device_name}",
            "trainer.log_every=100000",
        ]
    )
    row = base_row(spec, "ok")
    began = time.perf_counter()
    if spec.compiled:
        torch._dynamo.reset()
    with tempfile.TemporaryDirectory() as run_dir:
        try:
            trainer = Trainer(cfg, Path(run_dir))
        except BaseException:
            _release(device, spec.compiled)  # what a half-built trainer (the auto search's probes) holds
            raise
        try:
            row["setup_seconds"] = round(time.perf_counter() - began, 2)
            row["batch_tokens_chosen"] = cfg.trainer.max_tokens
            cap = settings.warm_cap_compiled if spec.compiled else settings.warm_cap_eager
            warm = warm_up(trainer, device, spec.compiled, settings, min(cap, max(left - settings.row_seconds, 1.0)))
            step_seconds = warm.pop("step_seconds")
            row.update(warm, warmup_step_ms=round(step_seconds * 1000, 1))
            if trainer.step.oom_skips:
                row["status"] = f"oom: {trainer.step.oom_skips} batches out of memory in the warm-up"
                return row
            steps = int(
                min(settings.max_steps, max(settings.min_steps, settings.row_seconds / max(step_seconds, 1e-6)))
            )
            timed = _time_trainer(trainer, cfg, device, steps, spec.precision, spec.compiled)
            row.update(
                target_tokens_per_s=timed["tokens_per_s"],
                mfu=timed.get("mfu"),
                peak_memory_mb=timed.get("peak_memory_mb"),
                steps=steps,
                loss=timed["loss"],
                loss_ok=timed["loss_ok"],
            )
            if device.type == "cuda":
                busy_steps = int(min(settings.busy_max_steps, max(3, settings.busy_seconds / max(step_seconds, 1e-6))))
                try:
                    row.update(busy_window(trainer, device, busy_steps))
                except Exception as error:  # the timed figures stand without it
                    row["busy_error"] = f"{type(error).__name__}: {error}"[:300]
            if trainer.step.oom_skips:
                row["status"] = f"oom: {trainer.step.oom_skips} batches skipped out of memory"
            elif spec.compiled and row["warmup_cut"]:
                row["status"] = "ok (warm-up cut at its cap: compiles may remain in the timed steps)"
        finally:
            trainer.leave_process_group(clean=True)
            trainer.monitor.close()
            del trainer
            _release(device, spec.compiled)
    return row


def _release(device, compiled: bool) -> None:
    """The device memory and (after a compiled row) the compiler's caches a row leaves behind."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if compiled:
        torch._dynamo.reset()


# --- the results file --------------------------------------------------------------------------------------------


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3': the file name's device part."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def row_key(row: dict) -> tuple:
    return (row["model"], row["precision"], bool(row["compiled"]), str(row["batch_tokens"]))


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """`old` with each row that `new` has again (same model, precision, compiled, budget) replaced in place,
    then the rows of `new` that are new."""
    fresh = {row_key(row): row for row in new}
    merged = [fresh.pop(row_key(row), row) for row in old]
    return merged + [row for row in new if row_key(row) in fresh]


def result_paths(json_dir: Path | None, out: Path | None, date: str, device: str) -> list[Path]:
    name = f"{date}-{device_slug(device)}.json"
    return [folder / name for folder in (json_dir, out) if folder is not None]


def write_results(paths: list[Path], info: dict, rows: list[dict]) -> None:
    """Rewrites each path with what is already recorded (the first of `paths` that exists: the matrix and the
    OpenNMT-py rows share a file) updated by `info`, and its rows merged with `rows` (`merge_rows`)."""
    old: dict = {}
    for path in paths:
        if path.is_file():
            old = json.loads(path.read_text())
            break
    document = {**old, **info, "rows": merge_rows(old.get("rows", []), rows)}
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2) + "\n")


def device_info(device_name: str) -> dict:
    import platform

    import torch

    cuda = device_name.startswith("cuda")
    return {
        "device": torch.cuda.get_device_name(torch.device(device_name)) if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "time_utc": time.strftime("%H:%M:%S", time.gmtime()),
        "gpu_busy_method": BUSY_METHOD if cuda else None,
        "driver": _nvidia_smi("driver_version") if cuda else None,
        "clocks_max_sm_mhz": _nvidia_smi("clocks.max.sm") if cuda else None,
    }


def _nvidia_smi(field: str) -> str | None:
    import subprocess

    try:
        result = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def table(info: dict, rows: list[dict]) -> str:
    lines = [
        f"{info['device']} | torch {info['torch']} | {info['date']}",
        f"{'model':<16} {'prec':<5} {'mode':<8} {'budget':>13} {'tgt tok/s':>10} {'MFU':>6} {'peak MB':>8} "
        f"{'busy':>5} {'steps':>5} {'s':>5}  status",
    ]
    for row in rows:
        budget = str(row["batch_tokens"])
        if row["batch_tokens"] == "auto" and row.get("batch_tokens_chosen"):
            budget = f"auto={row['batch_tokens_chosen']}"
        lines.append(
            f"{row['model']:<16} {row['precision']:<5} {'compiled' if row['compiled'] else 'eager':<8} {budget:>13} "
            f"{_fmt(row['target_tokens_per_s'], ',.0f'):>10} {_fmt(row['mfu'], '.1%'):>6} "
            f"{_fmt(row['peak_memory_mb'], ',.0f'):>8} {_fmt(row['gpu_busy_share'], '.0%'):>5} {row['steps']:>5} "
            f"{_fmt(row.get('seconds'), '.0f'):>5}  {row['status']}"
        )
    return "\n".join(lines)


# --- the command -------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    matrix = sub.add_parser("matrix", help="the matrix (module docstring)")
    matrix.add_argument("--data-dir", help="Multi30k (data=multi30k_de_en data.path=DIR); else --override's data")
    matrix.add_argument("--cache-dir", default="/tmp/gpu_cache", help="data.cache_dir")
    matrix.add_argument("--override", nargs="*", default=[], help="more Hydra overrides for every row")
    matrix.add_argument("--out", type=Path, help="a second folder for the JSON and the table (the device call's $OUT)")
    matrix.add_argument("--json-dir", type=Path, help="default: docs/gpu (none under --tiny)")
    matrix.add_argument("--seconds", type=float, default=420.0, help="the whole matrix's time, startup included")
    matrix.add_argument(
        "--only",
        default="",
        help="comma-separated label fragments: run only rows whose label "
        "(model/precision/eager|compiled/budget) contains one, e.g. base/bf16,/auto",
    )
    matrix.add_argument("--device", default="cuda")
    matrix.add_argument("--tiny", action="store_true", help="model=small made tiny, fp32, a few steps (a CPU check)")
    args = parser.parse_args(argv)
    return run_matrix(args)


def run_matrix(args) -> int:
    import torch

    start = time.monotonic()
    plan, settings, estimates = (
        (TINY_PLAN, TINY_SETTINGS, TINY_ESTIMATES) if args.tiny else (GPU_PLAN, Settings(), Estimates())
    )
    if args.only:
        plan = [spec for spec in plan if any(part in spec.label for part in args.only.split(","))]
    json_dir = args.json_dir if args.json_dir is not None else (None if args.tiny else ROOT / "docs" / "gpu")
    overrides = (
        (["data=multi30k_de_en", f"data.path={args.data_dir}"] if args.data_dir else [])
        + [f"data.cache_dir={args.cache_dir}"]
        + (TINY_MODEL if args.tiny else [])
        + list(args.override)
    )
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_matrix: no CUDA device (use --tiny --device cpu for the CPU check)", file=sys.stderr)
        return 2
    info = device_info(args.device)
    info["plan"] = {
        "seconds": args.seconds,
        "settings": dataclasses.asdict(settings),
        "pruned": [spec.label for spec in pruned(GPU_PLAN)] if not args.tiny else [],
        "only": args.only or None,
    }
    total, cut = predicted_schedule(plan, args.seconds - estimates.startup, estimates)
    print(
        f"gpu_matrix: {len(plan)} rows on {info['device']}, estimated {total + estimates.startup:.0f} s "
        f"(about {(total + estimates.startup) / 60:.1f} min) against a limit of {args.seconds:.0f} s"
        + (f"; if the estimates hold, skipped for time: {', '.join(s.label for s in cut)}" if cut else ""),
        flush=True,
    )
    from transformer.compose import compose
    from transformer.data.prepare import prepare

    prepare(compose(overrides).data)  # once, outside the rows
    if args.device.startswith("cuda"):  # the profiler's first start (CUPTI) outside the rows
        from torch.profiler import ProfilerActivity, profile

        try:
            with profile(activities=[ProfilerActivity.CUDA]):
                torch.ones(8, device=args.device).add_(1)
                torch.cuda.synchronize()
        except Exception as error:  # each row's busy window will say so too
            print(f"gpu_matrix: the profiler did not start: {type(error).__name__}: {error}", flush=True)
    paths = result_paths(json_dir, args.out, info["date"], info["device"])

    def on_row(rows: list[dict]) -> None:
        row = rows[-1]
        print(
            f"gpu_matrix: {Spec(row['model'], row['precision'], row['compiled'], row['batch_tokens']).label}: "
            f"{_fmt(row['target_tokens_per_s'], ',.0f')} tok/s, {row['status']} ({_fmt(row.get('seconds'), '.0f')} s, "
            f"{time.monotonic() - start:.0f} s in all)",
            flush=True,
        )
        write_results(paths, info, rows)

    rows = run_plan(
        plan,
        lambda spec, left: measure_row(spec, left, overrides, args.device, settings),
        args.seconds - (time.monotonic() - start),
        estimates,
        on_row=on_row,
    )
    info["seconds"] = round(time.monotonic() - start)
    write_results(paths, info, rows)
    document = json.loads(paths[0].read_text()) if paths else {"rows": rows}
    text = table(info, document["rows"]) + f"\n{info['seconds']} s; rows in {', '.join(str(p) for p in paths)}"
    print(text)
    if args.out is not None:
        (args.out / "matrix.txt").write_text(text + "\n")
    return 0 if all(not row["status"].startswith("error") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
