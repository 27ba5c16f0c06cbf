"""Everything a run logs, in one place: scalars go to every tracker of `trainer.loggers` alike
(`transformer.training.sinks`: TensorBoard, metrics.jsonl, MLflow, W&B); text, pictures and HParams to
TensorBoard (`runs/.../tb`).

- Scalars: `train/*` (every log line), `val/*`, `val_ema/*`, `val_average/*` (each validation, by the
  weights validated), `test/bleu`, `test/chrf` (the end of the run), `memory/*`; and, train and
  validation side by side in one section each: `loss/train`, `loss/valid` (`loss/valid_ema`, ...),
  `accuracy/*`, and `bleu/valid_greedy` (`bleu/valid_beam4` with trainer.val_beam_size=4; `_ema`,
  `_average` likewise) with `bleu/test_beam5` (the test's search, decode.beam_size); drawn on one chart
  each by the Custom Scalars tab's layout. `final/*`: the run's final numbers, at its last step.
- Text: `config` (the resolved config as YAML), `val*/samples` (a few sources, references, hypotheses).
- Images: `val*/cross_attention_N`, one heatmap per image: the last decoder layer's cross-attention for
  validation sentence N (N = 1..3, the same sentences at every validation), with its tokens on the axes and a
  0-1 colour scale (`attention_figure`); `val*/cross_attention_heads_N` / `_layers_N` per head or layer.
- HParams: the run's key settings, with its best validation BLEU and test scores as metrics; written
  into the run's own event file, so that the HParams tab links them to the run's other charts. The tab
  shows five columns until more are ticked: lr, warmup, seed, parameters and d_model (`SHOWN_HPARAMS`).

matplotlib is imported when a picture is drawn, and draws with its Agg backend (no display needed).
"""

from __future__ import annotations

import logging
import resource
import sys
from pathlib import Path

import numpy as np
import torch

from transformer.data import casing
from transformer.training.sinks import TensorBoardSink, flatten, numbers, open_sinks

log = logging.getLogger(__name__)

# Validation sentences drawn as attention heatmaps: the first ones whose source has at most
# ATTENTION_MAX_TOKENS pieces (readable labels), else the shortest.
ATTENTION_SENTENCES = 3
ATTENTION_MAX_TOKENS = 30
# A heatmap's figure: FIGURE_WIDTH inches wide at FIGURE_DPI, so that TensorBoard's default image card
# (335 px wide at the least) shows its TICK_POINTS labels at 8 px or more; fewer points where the tokens
# are too many for that; the height follows the target tokens, up to MAX_FIGURE_HEIGHT.
FIGURE_WIDTH, FIGURE_DPI, TICK_POINTS, MAX_FIGURE_HEIGHT = 6.4, 100, 11.5, 9.6
SAMPLES = 4  # validation sentences shown as text

# The HParams tab's metrics: scalar tags written at the end of the run (`Monitor.finish`).
HPARAM_METRICS = ("val/best_bleu", "test/bleu", "test/chrf")
# The HParams columns shown before any is ticked (TensorBoard shows five: those marked as differing
# first, then by name; the others are listed to tick).
SHOWN_HPARAMS = ("lr", "warmup", "seed", "parameters", "d_model")


def search_label(beam_size: int) -> str:
    """How BLEU was decoded, for tag names: greedy, or beam4."""
    return "greedy" if beam_size <= 1 else f"beam{beam_size}"


def hyperparameters(cfg, precision: str, parameters: int | None = None) -> dict:
    """The settings that tell runs apart, as the HParams tab's columns (`precision`: the one in use;
    `parameters`: the model's parameter count)."""
    m, t, d = cfg.model, cfg.trainer, cfg.data
    values = {
        "data": d.name,
        "model": m.name,
        "d_model": m.d_model,
        "n_heads": m.n_heads,
        "d_ff": m.d_ff,
        "encoder_layers": m.encoder_layers,
        "decoder_layers": m.decoder_layers,
        "dropout": m.dropout,
        "lr": t.lr,
        "warmup": t.warmup,
        "schedule": t.schedule,
        "max_tokens": t.max_tokens,
        "update_freq": t.update_freq,
        "label_smoothing": t.label_smoothing,
        "rdrop": t.rdrop,
        "precision": precision,
        "ema_decay": t.ema_decay,
        "ema_warmup": t.ema_warmup,
        "seed": t.seed,
        "val_search": search_label(t.val_beam_size),
    }
    if parameters is not None:
        values["parameters"] = parameters
    return values


def hparams_summaries(values: dict, metrics: tuple) -> tuple:
    """TensorBoard's HParams summaries (experiment, session start, session end), the SHOWN_HPARAMS
    marked as differing, so that the tab's five default columns are those."""
    from tensorboard.plugins.hparams import plugin_data_pb2
    from torch.utils.tensorboard.summary import hparams

    experiment, start, end = hparams(values, dict.fromkeys(metrics, 0))
    content = experiment.value[0].metadata.plugin_data
    data = plugin_data_pb2.HParamsPluginData.FromString(content.content)
    for info in data.experiment.hparam_infos:
        info.differs = info.name in SHOWN_HPARAMS
    content.content = data.SerializeToString()
    return experiment, start, end


def config_markdown(cfg) -> str:
    from omegaconf import OmegaConf

    return "```yaml\n" + OmegaConf.to_yaml(cfg.to_dict()) + "```"


def memory_in_use(device: torch.device) -> dict:
    """The process's peak memory so far, in GiB: CUDA's peak allocated on a GPU, else the peak RSS."""
    if device.type == "cuda":
        return {"memory/cuda_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"memory/peak_rss_gib": peak / (2**30 if sys.platform == "darwin" else 2**20)}


def weights_tag(weights: str) -> str:
    """The tag family of a validation of `weights` (raw, ema, average): val/, val_ema/, val_average/."""
    return "val" if weights == "raw" else f"val_{weights}"


def attention_sentences(sources: list[list[int]], count: int = ATTENTION_SENTENCES) -> list[int]:
    """Indices of the validation sentences drawn: the same at every validation of a run."""
    short = [i for i, ids in enumerate(sources) if 0 < len(ids) <= ATTENTION_MAX_TOKENS]
    if len(short) < count:
        short += sorted((i for i in range(len(sources)) if i not in short), key=lambda i: len(sources[i]))
    return short[:count]


def attention_figure(
    weights, source: list[str], predicted: list[str], title: str = "", scale_label: str = "attention weight"
):
    """A matplotlib Figure of one heatmap: weights (T, S), source tokens (S) along x, the token each row
    predicts (T) along y, colours on a fixed 0-1 scale with a colour bar. FIGURE_WIDTH wide (labels
    legible in TensorBoard's default card), as tall as the target tokens need, up to MAX_FIGURE_HEIGHT."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    plot_inches = FIGURE_WIDTH - 2.6  # less the y labels and the colour bar
    points = min(TICK_POINTS, 0.9 * 72 * plot_inches / max(len(source), 1))  # a label per token's width
    row_inches = min(0.3, max(points, 7.0) * 1.4 / 72)
    height = min(MAX_FIGURE_HEIGHT, max(3.5, 2.4 + row_inches * len(predicted)))
    figure = Figure(figsize=(FIGURE_WIDTH, height), dpi=FIGURE_DPI, layout="constrained")
    ax = figure.subplots()
    image = ax.imshow(
        np.nan_to_num(np.asarray(weights, dtype=np.float32)),
        cmap="viridis",
        vmin=0.0,
        vmax=1.0,
        aspect="auto",
        interpolation="nearest",
    )
    ax.set_xticks(range(len(source)), source, rotation=90, fontsize=points)
    ax.set_yticks(range(len(predicted)), predicted, fontsize=min(TICK_POINTS, 72 * row_inches / 1.3))
    ax.set_xlabel("source token (SentencePiece pieces)", fontsize=9)
    ax.set_ylabel("target token this row predicts\n(decoder input: the token before)", fontsize=9)
    figure.colorbar(image, ax=ax, label=scale_label, shrink=0.8)
    if title:
        ax.set_title(title, fontsize=10)
    return figure


def figure_pixels(figure) -> np.ndarray:
    """A Figure drawn by matplotlib's Agg backend: (H, W, 3) uint8 (no pyplot, no GUI backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[:, :, :3].copy()


# Inline casing's markers (data/casing.py, private-use characters no font draws) as the heatmaps label them
MARKER_LABELS = {casing.TITLE: "[T]", casing.UPPER: "[U]"}


def pieces(processor, ids: list[int]) -> list[str]:
    """Token ids as their SentencePiece pieces, then the end of sentence."""
    shown = [processor.id_to_piece(i) for i in ids]
    return [MARKER_LABELS.get(piece, piece) for piece in shown] + ["</s>"]


class Monitor:
    """The run's trackers (`trainer.loggers`, rank 0; on other ranks, or with none, every method does
    nothing): each scalar goes to every sink; text, pictures and HParams to TensorBoard's writer.
    `resumed_step`: the step of the checkpoint a resumed run starts from (its later points are dropped)."""

    def __init__(self, run_dir: Path, enabled: bool = True, loggers=("tensorboard",), resumed_step: int | None = None):
        self.sinks = open_sinks(list(loggers), Path(run_dir), resumed_step) if enabled else []
        boards = [sink for sink in self.sinks if isinstance(sink, TensorBoardSink)]
        self.writer = boards[0].writer if boards else None
        self.valid_search = self.test_search = "greedy"
        self._session_end = None  # HParams' end of session, made by `start`

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def scalar(self, tag: str, value: float, step: int) -> None:
        for sink in self.sinks:
            sink.scalar(tag, value, step)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def start(self, cfg, precision: str, parameters: int | None = None) -> None:
        """The config (as text in TensorBoard, flattened as every tracker's parameters), the HParams
        entry (its metrics come in `finish`), the one-chart layouts."""
        self.valid_search = search_label(cfg.trainer.val_beam_size)
        self.test_search = search_label(cfg.decode.beam_size)
        if not self:
            return
        params = flatten(cfg.to_dict())
        if parameters is not None:
            params["parameters"] = parameters
        for sink in self.sinks:
            sink.params(params)
        if self.writer is None:
            return
        self.writer.add_text("config", config_markdown(cfg))
        experiment, session_start, self._session_end = hparams_summaries(
            hyperparameters(cfg, precision, parameters), HPARAM_METRICS
        )
        for summary in (experiment, session_start):
            self.writer.file_writer.add_summary(summary)
        weights = ("valid", "valid_ema", "valid_average")
        bleu = [f"bleu/{w}_{self.valid_search}" for w in weights] + [f"bleu/test_{self.test_search}"]
        self.writer.add_custom_scalars(
            {
                "train and validation": {
                    "loss": ["Multiline", ["loss/train"] + [f"loss/{w}" for w in weights]],
                    "token accuracy": ["Multiline", ["accuracy/train"] + [f"accuracy/{w}" for w in weights]],
                    "BLEU": ["Multiline", bleu],
                }
            }
        )

    def training(self, step: int, epoch: int, values: dict, device: torch.device) -> None:
        """A log line's numbers (`TrainLog.write`): train/*, loss/train and accuracy/train (in the
        sections with validation's), the epoch and the memory."""
        if not self:
            return
        for key, value in values.items():
            self.scalar(f"train/{key}", value, step)
        self.scalar("loss/train", values["loss"], step)
        self.scalar("accuracy/train", values["accuracy"], step)
        self.scalar("train/epoch", epoch, step)
        for key, value in memory_in_use(device).items():
            self.scalar(key, value, step)
        self.flush()

    def skipped_out_of_memory(self, step: int, count: int) -> None:
        if self:
            self.scalar("train/oom_skipped_batches", count, step)

    def validation(
        self,
        step: int,
        weights: str,
        result: dict,
        samples: list[tuple[str, str, str]],
        attention=None,
        attention_detail: tuple[str, list] | None = None,
        direction: str | None = None,
    ) -> None:
        """One validation of `weights` (raw, ema, average): its numbers, samples (source, reference,
        hypothesis) and the attention heatmaps (one image per (weights, source, predicted) panel),
        under val*/; with `attention_detail` (heads or layers, and labelled panels of one sentence), also
        val*/cross_attention_heads_N or _layers_N (`trainer.attention_heatmaps`). A multilingual run's
        `direction` (de-en) goes under val*/de-en/; its mean over directions under val*/ itself."""
        if not self:
            return
        tag = weights_tag(weights) + (f"/{direction}" if direction else "")
        for key, value in result.items():
            self.scalar(f"{tag}/{key}", value, step)
        if direction is None:
            family = tag.replace("val", "valid")
            self.scalar(f"loss/{family}", result["loss"], step)
            if "accuracy" in result:
                self.scalar(f"accuracy/{family}", result["accuracy"], step)
            if "bleu" in result:
                self.scalar(f"bleu/{family}_{self.valid_search}", result["bleu"], step)
        if self.writer is not None:
            self._pictures(step, weights, tag, samples, attention, attention_detail)
        self.flush()

    def _pictures(self, step, weights, tag, samples, attention, attention_detail) -> None:
        if samples:
            self.writer.add_text(
                f"{tag}/samples",
                "\n\n".join(f"**src** {s}  \n**ref** {r}  \n**hyp** {h}" for s, r, h in samples[:SAMPLES]),
                step,
            )
        for n, (weights_tn, source, predicted) in enumerate(attention or [], 1):
            title = f"sentence {n}: last decoder layer, mean over heads, step {step} ({weights} weights)"
            figure = attention_figure(weights_tn, source, predicted, title, "attention weight (mean over heads)")
            self.writer.add_image(f"{tag}/cross_attention_{n}", figure_pixels(figure), step, dataformats="HWC")
        if attention_detail:
            kind, panels = attention_detail
            for n, (weights_tn, source, predicted, label) in enumerate(panels, 1):
                figure = attention_figure(weights_tn, source, predicted, f"sentence 1: {label}, step {step}")
                self.writer.add_image(
                    f"{tag}/cross_attention_{kind}_{n}", figure_pixels(figure), step, dataformats="HWC"
                )

    def test(self, step: int, scores: dict) -> None:
        if self:
            self.scalar("test/bleu", scores["bleu"], step)
            self.scalar("test/chrf", scores["chrf"], step)
            self.scalar(f"bleu/test_{self.test_search}", scores["bleu"], step)

    def finish(self, step: int, metrics: dict) -> None:
        """The run ended: its final numbers (final/* in every tracker, and each tracker's own record),
        the HParams tab's metrics and the end of its session."""
        if not self:
            return
        if metrics.get("best_bleu") is not None and metrics["best_bleu"] >= 0:
            self.scalar("val/best_bleu", metrics["best_bleu"], step)
        final = {k: v for k, v in metrics.items() if k != "val_history"}
        for key, value in numbers(final).items():
            self.scalar(f"final/{key}", value, step)
        for sink in self.sinks:
            sink.final(final, step)
        if self.writer is not None and self._session_end is not None:
            self.writer.file_writer.add_summary(self._session_end)
        self.flush()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks, self.writer = [], None
