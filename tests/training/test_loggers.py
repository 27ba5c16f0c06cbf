"""trainer.loggers (transformer/training/sinks.py): TensorBoard, metrics.jsonl, MLflow and W&B get the
same scalars at the same steps from the Monitor; a resumed run logs each step once; a missing package is
one line. No training: the Monitor is fed as a run would feed it."""

import json
import struct
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import FAST, compose_config
from transformer.errors import ConfigError, TrainingError
from transformer.training.monitor import SHOWN_HPARAMS, Monitor
from transformer.training.sinks import open_sinks

VALIDATION = {"loss": 4.5, "ppl": 90.0, "accuracy": 0.2, "bleu": 3.25, "chrf": 20.5, "cut_at_max_len": 0.0}


def feed(monitor: Monitor, cfg) -> None:
    """What a short run logs: a start, two log lines, a validation, the test and the end."""
    monitor.start(cfg, "fp32", parameters=123_456)
    for step in (3, 6):
        values = {"loss": 6.0 - step / 3, "accuracy": step / 100, "lr": step * 1e-4, "grad_norm": 1.5}
        monitor.training(step, 0, values, device=__import__("torch").device("cpu"))
    monitor.validation(6, "raw", VALIDATION, [("src", "ref", "hyp")])
    monitor.test(6, {"bleu": 2.5, "chrf": 19.0})
    monitor.finish(6, {"best_bleu": 3.25, "best_step": 6, "stop_reason": "reached trainer.max_steps=6"})
    monitor.close()


def tensorboard_scalars(run_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def jsonl_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def jsonl_scalars(run_dir: Path) -> dict:
    scalars: dict = {}
    for record in jsonl_records(run_dir):
        if "tag" in record:
            scalars.setdefault(record["tag"], []).append((record["step"], record["value"]))
    return scalars


def wandb_records(run_dir: Path) -> list:
    """The records of the offline W&B run under run_dir/wandb: its .wandb file is a LevelDB-style log
    (a 7-byte header, then 32 KiB blocks of chunks: crc32, length, type) of `Record` protobufs."""
    from wandb.proto.wandb_internal_pb2 import Record

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data, records, payload = path.read_bytes(), [], b""
    assert data[:4] == b":W&B"
    position, block = 7, 32768
    while position + 7 <= len(data):
        if block - position % block < 7:  # the rest of a block is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        payload += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            records.append(Record.FromString(payload))
            payload = b""
    return records


def wandb_scalars(records: list) -> dict:
    scalars: dict = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for tag, value in items.items():
                if not tag.startswith("_"):  # _step, _timestamp, _runtime: W&B's own
                    scalars.setdefault(tag, []).append((record.history.step.num, value))
    return scalars


def mlflow_run(run_dir: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run((run_dir / "mlflow_run_id").read_text().strip())
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)] for key in run.data.metrics
    }
    return run, history


def rounded(scalars: dict) -> dict:
    """TensorBoard stores float32: compare at that precision."""
    return {tag: sorted((step, round(float(v), 4)) for step, v in points) for tag, points in scalars.items()}


def test_every_logger_gets_the_same_scalars_at_the_same_steps_with_the_config_and_final_metrics(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose_config(FAST + ["trainer.val_beam_size=4", "decode.beam_size=5"])
    feed(Monitor(tmp_path, loggers=["tensorboard", "jsonl", "mlflow", "wandb"]), cfg)

    board = rounded(tensorboard_scalars(tmp_path))
    assert {"loss/train", "loss/valid", "bleu/valid_beam4", "bleu/test_beam5", "final/best_bleu"} <= set(board)
    assert board["bleu/valid_beam4"] == [(6, 3.25)] and board["loss/train"] == [(3, 5.0), (6, 4.0)]
    assert rounded(jsonl_scalars(tmp_path)) == board
    run, history = mlflow_run(tmp_path)
    assert rounded(history) == board
    records = wandb_records(tmp_path)
    assert rounded(wandb_scalars(records)) == board

    # the flattened config and the final metrics, in each
    params = next(r["params"] for r in jsonl_records(tmp_path) if "params" in r)
    assert params["trainer.lr"] == cfg.trainer.lr and params["model.d_model"] == 64 and params["parameters"] == 123_456
    final = [r for r in jsonl_records(tmp_path) if "final" in r]
    assert final[-1]["final"]["best_bleu"] == 3.25 and final[-1]["step"] == 6
    assert run.data.params["trainer.lr"] == str(cfg.trainer.lr) and run.data.params["trainer.seed"] == "1"
    assert run.data.metrics["final/best_bleu"] == 3.25 and run.info.status == "FINISHED"
    config = next(r.config for r in records if r.WhichOneof("record_type") == "config")
    assert json.loads({item.key: item.value_json for item in config.update}["trainer.lr"]) == cfg.trainer.lr
    summary = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            summary.update({item.key: json.loads(item.value_json) for item in record.summary.update})
    assert summary["final/best_bleu"] == 3.25


def test_validation_bleu_is_labelled_greedy_and_hparams_show_lr_warmup_seed_and_the_model_size(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import backend_context, metadata

    feed(Monitor(tmp_path), compose_config(FAST))
    assert {"bleu/valid_greedy", "bleu/test_beam5", "loss/valid", "loss/train"} <= set(tensorboard_scalars(tmp_path))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    content = events.PluginTagToContent("hparams")[metadata.EXPERIMENT_TAG]
    experiment = metadata.parse_experiment_plugin_data(content)
    names = {info.name for info in experiment.hparam_infos}
    assert {"lr", "warmup", "seed", "parameters", "d_model", "encoder_layers", "decoder_layers"} <= names
    backend_context._sort_and_reduce_to_hparams_limit(experiment, 5)  # the tab's five default columns
    assert {info.name for info in experiment.hparam_infos} == set(SHOWN_HPARAMS)


def test_a_resumed_run_logs_each_step_once(tmp_path):
    """Steps 1..10 logged, the process dies, the run resumes from the checkpoint of step 6 and logs 7..12."""
    first = Monitor(tmp_path, loggers=["tensorboard", "jsonl"])
    for step in range(1, 11):
        first.scalar("loss/train", 100.0 + step, step)
    first.flush()
    first.close()
    # A resume comes later than the crash: TensorBoard reads event files in name order, whose first part is
    # the second they were opened in; two files of one second could be read the other way round.
    time.sleep(1.1)
    resumed = Monitor(tmp_path, loggers=["tensorboard", "jsonl"], resumed_step=6)
    for step in range(7, 13):
        resumed.scalar("loss/train", 200.0 + step, step)
    resumed.close()
    expected = [(s, 100.0 + s) for s in range(1, 7)] + [(s, 200.0 + s) for s in range(7, 13)]
    assert tensorboard_scalars(tmp_path)["loss/train"] == expected
    assert jsonl_scalars(tmp_path)["loss/train"] == expected


def test_a_jsonl_line_cut_short_by_a_crash_is_dropped_on_resume(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "tag": "a", "value": 1.0, "time": 0}\n{"step": 2, "ta')
    Monitor(tmp_path, loggers=["jsonl"], resumed_step=2).close()
    assert jsonl_scalars(tmp_path) == {"a": [(1, 1.0)]}


@pytest.mark.parametrize("logger, module", [("mlflow", "mlflow"), ("mlflow", "sqlalchemy"), ("wandb", "wandb")])
def test_a_logger_whose_package_is_missing_is_one_line(tmp_path, monkeypatch, logger, module):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(TrainingError) as caught:
        open_sinks(["jsonl", logger], tmp_path)
    message = str(caught.value)
    assert "\n" not in message and f"trainer.loggers={logger}" in message and "pip install" in message


@pytest.mark.parametrize("value", ["[tensorbord]", "[jsonl,jsonl]"])
def test_an_unknown_or_repeated_logger_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"trainer\.loggers=.*tensorboard, jsonl, mlflow, wandb"):
        compose_config([f"trainer.loggers={value}"]).validate()
