"""Where a run's numbers go (`trainer.loggers`): one small interface, `MetricSink`, that the `Monitor`
fans every call out to, so that each tracker gets the same tags at the same steps.

- `tensorboard`: RUN/tb (the Monitor adds text, pictures and HParams to its writer).
- `jsonl`: RUN/metrics.jsonl, one JSON object a line: {"step", "tag", "value", "time"} for every scalar,
  {"params": {...}, "time"} once per start (the flattened config), {"final": {...}, "step", "time"} at the end.
- `mlflow`: MLFLOW_TRACKING_URI if set, else a SQLite store in the run directory (sqlite:///RUN/mlflow.db);
  experiment MLFLOW_EXPERIMENT_NAME (else MLflow's default); one MLflow run per run directory.
- `wandb`: RUN/wandb; project WANDB_PROJECT (else "transformer"); offline (WANDB_MODE=offline) unless an
  API key is set (WANDB_API_KEY or `wandb login`) or WANDB_MODE says otherwise.

A resumed run (from the checkpoint of step S) continues the same record: TensorBoard hides the points of
steps > S written before the crash (SummaryWriter's purge_step), metrics.jsonl drops them from the file;
MLflow (same run id, RUN/mlflow_run_id) keeps both values of a step logged twice, W&B (same run id,
RUN/wandb_run_id) ignores, with a warning, a step below the run's last one while online.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Protocol

from transformer.errors import TrainingError
from transformer.install import install_hint

log = logging.getLogger(__name__)


class MetricSink(Protocol):
    """One tracker: a scalar at a step, the run's parameters (flattened config), its final metrics."""

    def scalar(self, tag: str, value: float, step: int) -> None: ...

    def params(self, params: dict) -> None: ...

    def final(self, metrics: dict, step: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"trainer": {"lr": 1e-3}} -> {"trainer.lr": 1e-3}; lists and None stay values."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def numbers(metrics: dict) -> dict:
    """The finite numbers among `metrics` (final metrics hold strings and None too)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


class TensorBoardSink:
    """RUN/tb. On resume from step S, the points of steps > S that a crashed process wrote are purged."""

    def __init__(self, run_dir: Path, resumed_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        purge = resumed_step + 1 if resumed_step is not None else None
        self.writer = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=purge)

    def scalar(self, tag: str, value: float, step: int) -> None:
        self.writer.add_scalar(tag, value, step)

    def params(self, params: dict) -> None:
        pass  # the Monitor writes the config as text and the HParams entry

    def final(self, metrics: dict, step: int) -> None:
        pass  # the final metrics are scalars (final/*), which the Monitor sends to every sink

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class JsonlSink:
    """RUN/metrics.jsonl (see the module's doc). A new run starts the file anew; a resumed one keeps
    the lines of steps <= the checkpoint's step (and every params line)."""

    def __init__(self, run_dir: Path, resumed_step: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        if resumed_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if _kept(line, resumed_step)]
            partial = self.path.with_suffix(".jsonl.tmp")
            partial.write_text("".join(f"{line}\n" for line in kept))
            partial.replace(self.path)
            self.file = self.path.open("a")
        else:
            self.file = self.path.open("w")

    def _write(self, record: dict) -> None:
        self.file.write(json.dumps(record, allow_nan=True) + "\n")

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._write({"step": step, "tag": tag, "value": float(value), "time": time.time()})

    def params(self, params: dict) -> None:
        self._write({"params": params, "time": time.time()})

    def final(self, metrics: dict, step: int) -> None:
        self._write({"final": metrics, "step": step, "time": time.time()})

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _kept(line: str, resumed_step: int) -> bool:
    """A metrics.jsonl line a run resumed at `resumed_step` keeps: no step (params), or a step not after it."""
    try:
        record = json.loads(line)
    except ValueError:
        return False  # a line cut short by the crash
    return isinstance(record, dict) and record.get("step", 0) <= resumed_step


def _optional(module: str, logger: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise TrainingError(
            f"trainer.loggers={logger} needs the {module} package: {install_hint(logger)}, "
            f"or drop {logger} from trainer.loggers"
        ) from None


class MlflowSink:
    """One MLflow run per run directory (its id in RUN/mlflow_run_id); metrics logged in batches."""

    def __init__(self, run_dir: Path, resumed: bool):
        _optional("mlflow", "mlflow")
        if not os.environ.get("MLFLOW_TRACKING_URI"):  # the SQLite store in the run directory needs these
            for module in ("sqlalchemy", "alembic"):
                _optional(module, "mlflow")
        from mlflow.tracking import MlflowClient

        run_dir = Path(run_dir)
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        id_file = run_dir / "mlflow_run_id"
        self.run_id = id_file.read_text().strip() if resumed and id_file.exists() else None
        if self.run_id:
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment_id = "0"  # MLflow's default experiment
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
            if name:
                experiment = self.client.get_experiment_by_name(name)
                experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
            id_file.write_text(self.run_id + "\n")
        self.pending: list = []

    def scalar(self, tag: str, value: float, step: int) -> None:
        from mlflow.entities import Metric

        self.pending.append(Metric(tag, float(value), int(time.time() * 1000), step))

    def params(self, params: dict) -> None:
        """MLflow's parameters cannot change: a resumed run adds the keys it lacks, not new values."""
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params
        new = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in logged]
        for i in range(0, len(new), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=new[i : i + 100])

    def final(self, metrics: dict, step: int) -> None:
        self.flush()
        self.client.set_tag(self.run_id, "stop_reason", str(metrics.get("stop_reason")))

    def flush(self) -> None:
        while self.pending:
            batch, self.pending = self.pending[:1000], self.pending[1000:]
            self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.flush()
        self.client.set_terminated(self.run_id)


def wandb_mode() -> str:
    """WANDB_MODE if set; else online with an API key (WANDB_API_KEY or `wandb login`'s netrc), offline without."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        import netrc

        return "online" if netrc.netrc().authenticators("api.wandb.ai") else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


class WandbSink:
    """One W&B run per run directory (its id in RUN/wandb_run_id), files under RUN/wandb."""

    def __init__(self, run_dir: Path, resumed: bool):
        wandb = _optional("wandb", "wandb")
        run_dir = Path(run_dir)
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resumed and id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "transformer"),
            name=run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            mode=wandb_mode(),
            settings=wandb.Settings(console="off", silent=True),
        )

    def scalar(self, tag: str, value: float, step: int) -> None:
        self.run.log({tag: float(value)}, step=step)

    def params(self, params: dict) -> None:
        self.run.config.update(params, allow_val_change=True)

    def final(self, metrics: dict, step: int) -> None:
        self.run.summary.update({f"final/{k}": v for k, v in metrics.items()})

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


def open_sinks(names: list[str], run_dir: Path, resumed_step: int | None = None) -> list:
    """The sinks `trainer.loggers` names, in its order; a missing package is one line (TrainingError)."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    opened = []
    try:
        for name in names:
            if name == "tensorboard":
                opened.append(TensorBoardSink(run_dir, resumed_step))
            elif name == "jsonl":
                opened.append(JsonlSink(run_dir, resumed_step))
            elif name == "mlflow":
                opened.append(MlflowSink(run_dir, resumed_step is not None))
            elif name == "wandb":
                opened.append(WandbSink(run_dir, resumed_step is not None))
            else:
                raise TrainingError(f"trainer.loggers: unknown logger {name!r}")
    except BaseException:
        for sink in opened:
            sink.close()
        raise
    return opened
