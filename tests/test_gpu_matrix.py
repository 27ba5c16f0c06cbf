"""The GPU checklist's matrix and OpenNMT-py stages (scripts/gpu_matrix.py, scripts/gpu_onmt.py, issue 69) on a CPU:
the plan and its pruning with fake timings, the busy share from a trace, the results file that both stages share,
OpenNMT-py's log read back, and the matrix's entry on a tiny model (slow: it trains a few steps)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import FAST, ROOT

sys.path.insert(0, str(ROOT / "scripts"))

import gpu_matrix as gm  # noqa: E402
import gpu_onmt  # noqa: E402
from gpu_matrix import Estimates, Spec  # noqa: E402


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_measure(clock: FakeClock, seconds: dict, oom: set = frozenset(), fail: set = frozenset()):
    """A measure that takes `seconds[label]` (10 by default) of the fake clock, runs out of memory for the labels
    in `oom` and raises for those in `fail`."""

    def measure(spec: Spec, left: float) -> dict:
        clock.now += seconds.get(spec.label, 10.0)
        if spec.label in fail:
            raise RuntimeError("boom")
        row = gm.base_row(spec, "oom: 5 batches skipped out of memory" if spec.label in oom else "ok")
        row.update(target_tokens_per_s=1000.0, steps=10)
        return row

    return measure


ESTIMATES = Estimates(setup=1, warm=1, timed=6, busy=2, auto_search=5, compile_first=50, compile_again=20, startup=0)


def test_the_gpu_plan_is_a_pruned_full_matrix_in_one_order():
    assert len(gm.FULL) == 32 and len(set(gm.FULL)) == 32
    assert set(gm.GPU_PLAN) <= set(gm.FULL) and len(set(gm.GPU_PLAN)) == len(gm.GPU_PLAN)
    assert len(gm.pruned(gm.GPU_PLAN)) == 32 - len(gm.GPU_PLAN)
    # every budget of bf16 eager for both models; each model and precision, compiled or not, somewhere
    assert {(s.model, s.budget) for s in gm.GPU_PLAN if s.precision == "bf16" and not s.compiled} == {
        (m, b) for m in gm.MODELS for b in gm.BUDGETS
    }
    assert {(s.model, s.precision, s.compiled) for s in gm.GPU_PLAN} >= {
        ("base", "fp32", False),
        ("big", "fp32", False),
        ("base", "bf16", True),
        ("big", "bf16", True),
    }
    total, cut = gm.predicted_schedule(gm.GPU_PLAN, 10_000, Estimates())
    assert cut == [] and total < 8.5 * 60  # the "about 8 minutes"


def test_estimates_count_a_models_first_compile_once():
    compiled = Spec("base", "bf16", True, 4096)
    assert ESTIMATES.row(compiled, set()) == 10 + 50
    assert ESTIMATES.row(compiled, {"base"}) == 10 + 20
    assert ESTIMATES.row(Spec("big", "bf16", True, 4096), {"base"}) == 10 + 50
    assert ESTIMATES.row(Spec("base", "bf16", False, "auto"), set()) == 10 + 5


def test_rows_that_do_not_fit_the_time_left_are_skipped_and_later_cheaper_ones_run():
    plan = [
        Spec("base", "bf16", False, 4096),
        Spec("base", "bf16", True, 4096),  # estimate 60: does not fit in the 35 s left
        Spec("big", "bf16", False, 4096),  # estimate 10: fits
    ]
    clock = FakeClock()
    written = []
    rows = gm.run_plan(plan, fake_measure(clock, {}), 45, ESTIMATES, clock, on_row=lambda r: written.append(len(r)))
    assert [row["status"] for row in rows] == ["ok", "skipped: time (estimate 60 s, 35 s left)", "ok"]
    assert rows[0]["seconds"] == 10 and rows[0]["estimate_seconds"] == 10
    assert written == [1, 2, 3]  # the file is rewritten after every row


def test_an_out_of_memory_skips_the_same_model_and_precision_at_larger_budgets_only():
    plan = [
        Spec("big", "fp32", False, 16384),
        Spec("big", "fp32", False, 32768),  # skipped
        Spec("big", "fp32", True, 32768),  # skipped: compiling does not shrink the activations
        Spec("big", "fp32", False, 4096),  # smaller: runs
        Spec("big", "bf16", False, 32768),  # another precision: runs
        Spec("big", "fp32", False, "auto"),  # sized to fit: runs
    ]
    clock = FakeClock()
    rows = gm.run_plan(plan, fake_measure(clock, {}, oom={"big/fp32/eager/16384"}), 1000, ESTIMATES, clock)
    assert [row["status"].split(":")[0] for row in rows] == ["oom", "skipped", "skipped", "ok", "ok", "ok"]
    assert rows[1]["status"] == "skipped: out of memory at big/fp32/eager/16384"


def test_a_row_that_raises_becomes_its_status_and_the_next_rows_run():
    plan = [Spec("base", "bf16", False, 4096), Spec("base", "bf16", False, 16384)]
    clock = FakeClock()
    rows = gm.run_plan(plan, fake_measure(clock, {}, fail={"base/bf16/eager/4096"}), 1000, ESTIMATES, clock)
    assert rows[0]["status"] == "error: RuntimeError: boom" and rows[0]["target_tokens_per_s"] is None
    assert rows[1]["status"] == "ok"


def test_busy_seconds_is_the_union_of_device_work():
    events = [
        {"ph": "X", "cat": "kernel", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "ts": 5, "dur": 10},  # overlaps the first (another stream): 0-15
        {"ph": "X", "cat": "gpu_memcpy", "ts": 20, "dur": 5},
        {"ph": "X", "cat": "gpu_memset", "ts": 21, "dur": 1},  # inside the copy
        {"ph": "X", "cat": "Kernel", "ts": 30, "dur": 2},
        {"ph": "X", "cat": "cuda_runtime", "ts": 0, "dur": 100},  # host side: not device work
        {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 100},
        {"ph": "s", "cat": "kernel", "ts": 50},  # a flow event
    ]
    assert gm.busy_seconds(events) == pytest.approx((15 + 5 + 2) / 1e6)
    assert gm.busy_seconds([]) == 0


def test_matrix_and_opennmt_rows_share_one_file(tmp_path):
    paths = gm.result_paths(tmp_path / "docs", tmp_path / "out", "2026-12-07", "NVIDIA H100 80GB HBM3")
    assert [p.name for p in paths] == ["2026-12-07-nvidia-h100-80gb-hbm3.json"] * 2
    ours = gm.base_row(Spec("base", "bf16", False, 32768), "ok")
    gm.write_results(paths, {"device": "NVIDIA H100 80GB HBM3", "plan": {"seconds": 400}}, [ours])
    onmt = gpu_onmt.onmt_row(LOG, 32768, skip=60, precision="fp16")
    gm.write_results(paths, {"device": "NVIDIA H100 80GB HBM3", "opennmt": {"version": "3.5.1"}}, [onmt])
    again = dict(ours, status="ok, again")
    gm.write_results(paths, {"device": "NVIDIA H100 80GB HBM3"}, [again])
    for path in paths:
        document = json.loads(path.read_text())
        assert document["plan"] == {"seconds": 400} and document["opennmt"] == {"version": "3.5.1"}
        assert [(r["model"], r["status"]) for r in document["rows"]] == [
            ("base", "ok, again"),
            ("opennmt-py base", "ok"),
        ]
    table = gm.table({"device": "d", "torch": "t", "date": "x"}, document["rows"])
    assert "opennmt-py base" in table and "32768" in table


LOG = """[2026-12-07 06:57:32,336 INFO] Weighted corpora loaded so far:
[2026-12-07 06:57:49,348 INFO] Step 20/  200; acc: 0.0; ppl: 8350.4; xent: 9.0; lr: 0.00000; sents:     685; \
bsz: 1563/1903/137; 293/357 tok/s;     27 sec;
[2026-12-07 06:57:55,086 INFO] Step 40/  200; acc: 0.1; ppl: 8120.5; xent: 9.0; lr: 0.00001; sents:     578; \
bsz: 1837/1899/116; 1601/1655 tok/s;     32 sec;
[2026-12-07 06:58:00,791 INFO] Step 60/  200; acc: 0.1; ppl: 7950.8; xent: 9.0; lr: 0.00001; sents:     716; \
bsz: 1661/1893/143; 1456/1660 tok/s;     38 sec;
[2026-12-07 06:58:06,533 INFO] Step 80/  200; acc: 0.0; ppl: 7508.8; xent: 8.9; lr: 0.00001; sents:     617; \
bsz: 1662/1884/123; 150000/170000 tok/s;     44 sec;
[2026-12-07 06:58:06,533 INFO] Step 100/  200; acc: 0.0; ppl: 7508.8; xent: 8.9; lr: 0.00001; sents:     617; \
bsz: 1662/1884/123; 150000/160000 tok/s;     44 sec;
[2026-12-07 06:58:06,533 INFO] Step 120/  200; acc: 0.0; ppl: 7508.8; xent: 8.9; lr: 0.00001; sents:     617; \
bsz: 1662/1884/123; 150000/190000 tok/s;     44 sec;
"""


def test_opennmt_rows_are_the_median_target_rate_after_the_skipped_steps():
    assert gpu_onmt.windows(LOG)[0] == (20, 293.0, 357.0)
    row = gpu_onmt.onmt_row(LOG, 32768, skip=60, precision="fp16")
    assert row["model"] == "opennmt-py base" and row["batch_tokens"] == 32768 and row["precision"] == "fp16"
    assert row["target_tokens_per_s"] == 170000 and row["steps"] == 60 and row["windows"] == 3
    assert row["status"] == "ok"
    stopped = gpu_onmt.onmt_row(LOG, 32768, skip=60, precision="fp16", rc=124)  # `timeout` ended it
    assert stopped["target_tokens_per_s"] == 170000 and "stopped by its time limit after step 120" in stopped["status"]
    failed = gpu_onmt.onmt_row("Traceback ...\nImportError: no module named spacy\n", 4096, 60, "fp16", rc=1)
    assert failed["status"].startswith("error: rc 1, 0 report lines") and "spacy" in failed["status"]


def test_opennmt_installs_its_wheel_and_only_the_missing_needs(tmp_path):
    for name in ("OpenNMT_py-3.5.1-py3-none-any", "configargparse-1.7.1-py3-none-any", "PyYAML-6.0.2-cp312-x"):
        (tmp_path / f"{name}.whl").write_text("")
    for dist, _ in gpu_onmt.NEEDS[2:]:
        (tmp_path / f"{dist}-1.0-py3-none-any.whl").write_text("")
    chosen = gpu_onmt.wheels_to_install(tmp_path, importable=lambda module: module not in ("configargparse", "yaml"))
    assert [p.name.split("-")[0] for p in chosen] == ["OpenNMT_py", "configargparse", "PyYAML"]
    with pytest.raises(SystemExit, match="no opennmt_py wheel"):
        gpu_onmt.wheels_to_install(tmp_path / "missing")


def test_opennmt_trains_our_base_shape(tmp_path):
    text = gpu_onmt.config(tmp_path, 32768, 200, "cuda").read_text()
    for line in ("enc_layers: 6", "dec_layers: 6", "heads: 8", "hidden_size: 512", "transformer_ff: 2048"):
        assert line + "\n" in text
    assert "batch_size: 32768\n" in text and "model_dtype: fp16\n" in text and "gpu_ranks: [0]\n" in text
    assert "gpu_ranks" not in gpu_onmt.config(tmp_path, 2048, 20, "cpu", model="small").read_text()


TOY = ["data=toy", "data.embedded_pairs=2000", "data.vocab_size=200"]


@pytest.mark.slow
def test_the_matrix_runs_end_to_end_on_a_tiny_cpu_model(tmp_path, capsys):
    rc = gm.main(
        ["matrix", "--tiny", "--device", "cpu", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path)]
        + ["--seconds", "120", "--only", "/eager/1024,/eager/auto", "--override", *TOY]
    )
    assert rc == 0
    (path,) = tmp_path.glob("*-cpu.json")
    document = json.loads(path.read_text())
    assert document["device"] == "cpu" and document["torch"] and document["date"]
    rows = document["rows"]
    assert [(r["batch_tokens"], r["status"]) for r in rows] == [(1024, "ok"), ("auto", "ok")]
    assert rows[1]["batch_tokens_chosen"] == gm.AUTO_START  # on a CPU the search falls back to trainer.max_tokens
    for row in rows:
        assert row["target_tokens_per_s"] > 0 and row["steps"] >= gm.TINY_SETTINGS.min_steps and row["loss_ok"]
        assert row["mfu"] is None and row["gpu_busy_share"] is None  # no GPU
    out = capsys.readouterr().out
    assert "estimated" in out and "auto=8192" in out and (tmp_path / "matrix.txt").is_file()


@pytest.mark.slow
def test_the_busy_window_reads_a_profiler_trace(tmp_path):
    import torch
    from torch.profiler import ProfilerActivity

    from tests.helpers import compose_config
    from transformer.training.trainer import Trainer

    cfg = compose_config(FAST + ["trainer.device=cpu", "trainer.precision=fp32"], cache_dir=tmp_path / "cache")
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        result = gm.busy_window(trainer, torch.device("cpu"), 2, activities=[ProfilerActivity.CPU])
    finally:
        trainer.monitor.close()
    assert result["gpu_busy_share"] == 0 and result["busy_steps"] == 2 and result["busy_window_tokens_per_s"] > 0
    assert "cpu_op" in result["busy_trace_categories"]  # the trace was read: no device work in it
