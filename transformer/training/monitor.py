"""Everything a run writes to TensorBoard (`runs/.../tb`), in one place.

- Scalars: `train/*` (every log line), `val/*`, `val_ema/*`, `val_average/*` (each validation, by the
  weights validated), `test/bleu`, `test/chrf` (the end of the run), `memory/*`; `loss/train` and
  `loss/valid` (and `accuracy/*`) are drawn on one chart each by the Custom Scalars tab's layout.
- Text: `config` (the resolved config as YAML), `val*/samples` (a few sources, references, hypotheses).
- Images: `val*/cross_attention`, heatmaps of the last decoder layer's cross-attention for a few fixed
  validation sentences, with their tokens on the axes and a 0-1 colour scale (`attention_figure`).
- HParams: the run's key settings, with its best validation BLEU and test scores as metrics; written
  into the run's own event file, so that the HParams tab links them to the run's other charts.

matplotlib is imported when a picture is drawn, and draws with its Agg backend (no display needed).
"""

from __future__ import annotations

import logging
import resource
import sys
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

# Validation sentences drawn as attention heatmaps: the first ones whose source has at most
# ATTENTION_MAX_TOKENS pieces (readable labels), else the shortest.
ATTENTION_SENTENCES = 3
ATTENTION_MAX_TOKENS = 30
# Inches per token of a heatmap, and the largest figure drawn (inches).
INCHES_PER_TOKEN = 0.32
MAX_FIGURE_INCHES = (16.0, 24.0)
SAMPLES = 4  # validation sentences shown as text

# The HParams tab's metrics: scalar tags written at the end of the run (`Monitor.finish`).
HPARAM_METRICS = ("val/best_bleu", "test/bleu", "test/chrf")


def hyperparameters(cfg, precision: str) -> dict:
    """The settings that tell runs apart, as the HParams tab's columns (`precision`: the one in use)."""
    m, t, d = cfg.model, cfg.trainer, cfg.data
    return {
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
    }


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


def attention_figure(panels: list[tuple], title: str = "", scale_label: str = "attention weight (mean over heads)"):
    """A matplotlib Figure: one heatmap per (weights (T, S), source tokens (S), predicted tokens (T)[,
    the panel's own title]), stacked, source tokens along x, the token each row predicts along y, colours
    on a fixed 0-1 scale with one colour bar. Its size follows the token counts, up to MAX_FIGURE_INCHES."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    widest = max(len(panel[1]) for panel in panels)
    rows = [len(panel[2]) for panel in panels]
    width = min(MAX_FIGURE_INCHES[0], 2.5 + INCHES_PER_TOKEN * widest)
    height = min(MAX_FIGURE_INCHES[1], 1.2 + sum(1.3 + INCHES_PER_TOKEN * r for r in rows))
    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    axes = figure.subplots(len(panels), 1, squeeze=False, height_ratios=[r + 4 for r in rows])[:, 0]
    image = None
    for ax, (weights, source, predicted, *label) in zip(axes, panels):
        image = ax.imshow(
            np.nan_to_num(np.asarray(weights, dtype=np.float32)),
            cmap="viridis",
            vmin=0.0,
            vmax=1.0,
            aspect="auto",
            interpolation="nearest",
        )
        ax.set_xticks(range(len(source)), source, rotation=90, fontsize=8)
        ax.set_yticks(range(len(predicted)), predicted, fontsize=8)
        ax.set_xlabel("source token (SentencePiece pieces)", fontsize=8)
        ax.set_ylabel("target token this row predicts\n(decoder input: the token before)", fontsize=8)
        if label:
            ax.set_title(label[0], fontsize=8)
    figure.colorbar(image, ax=list(axes), label=scale_label, shrink=0.8)
    if title:
        figure.suptitle(title, fontsize=9)
    return figure


def figure_pixels(figure) -> np.ndarray:
    """A Figure drawn by matplotlib's Agg backend: (H, W, 3) uint8 (no pyplot, no GUI backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[:, :, :3].copy()


def pieces(processor, ids: list[int]) -> list[str]:
    """Token ids as their SentencePiece pieces, then the end of sentence."""
    return [processor.id_to_piece(i) for i in ids] + ["</s>"]


class Monitor:
    """The run's TensorBoard writer (rank 0; on other ranks every method does nothing)."""

    def __init__(self, run_dir: Path, enabled: bool = True):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(Path(run_dir) / "tb")) if enabled else None

    def __bool__(self) -> bool:
        return self.writer is not None

    def start(self, cfg, precision: str) -> None:
        """The config as text, the HParams entry (its metrics come in `finish`), the one-chart layouts."""
        if not self:
            return
        from torch.utils.tensorboard.summary import hparams

        self.writer.add_text("config", config_markdown(cfg))
        experiment, session_start, self._session_end = hparams(
            hyperparameters(cfg, precision), dict.fromkeys(HPARAM_METRICS, 0)
        )
        for summary in (experiment, session_start):
            self.writer.file_writer.add_summary(summary)
        weights = ("valid", "valid_ema", "valid_average")
        self.writer.add_custom_scalars(
            {
                "train and validation": {
                    "loss": ["Multiline", ["loss/train"] + [f"loss/{w}" for w in weights]],
                    "token accuracy": ["Multiline", ["accuracy/train"] + [f"accuracy/{w}" for w in weights]],
                    "BLEU": ["Multiline", ["val/bleu", "val_ema/bleu", "val_average/bleu", "test/bleu"]],
                }
            }
        )

    def training(self, step: int, epoch: int, values: dict, device: torch.device) -> None:
        """A log line's numbers (`TrainLog.write`): train/*, loss/train and accuracy/train (on the charts
        with validation's), the epoch and the memory."""
        if not self:
            return
        for key, value in values.items():
            self.writer.add_scalar(f"train/{key}", value, step)
        self.writer.add_scalar("loss/train", values["loss"], step)
        self.writer.add_scalar("accuracy/train", values["accuracy"], step)
        self.writer.add_scalar("train/epoch", epoch, step)
        for key, value in memory_in_use(device).items():
            self.writer.add_scalar(key, value, step)

    def skipped_out_of_memory(self, step: int, count: int) -> None:
        if self:
            self.writer.add_scalar("train/oom_skipped_batches", count, step)

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
        hypothesis) and the attention heatmaps (`attention_figure`'s panels), under val*/; with
        `attention_detail` (heads or layers, and labelled panels of one sentence), also
        val*/cross_attention_heads or _layers (`trainer.attention_heatmaps`). A multilingual run's
        `direction` (de-en) goes under val*/de-en/; its mean over directions under val*/ itself."""
        if not self:
            return
        tag = weights_tag(weights) + (f"/{direction}" if direction else "")
        for key, value in result.items():
            self.writer.add_scalar(f"{tag}/{key}", value, step)
        if direction is None:
            self.writer.add_scalar(f"loss/{tag.replace('val', 'valid')}", result["loss"], step)
            if "accuracy" in result:
                self.writer.add_scalar(f"accuracy/{tag.replace('val', 'valid')}", result["accuracy"], step)
        if samples:
            self.writer.add_text(
                f"{tag}/samples",
                "\n\n".join(f"**src** {s}  \n**ref** {r}  \n**hyp** {h}" for s, r, h in samples[:SAMPLES]),
                step,
            )
        if attention:
            title = f"cross-attention, last decoder layer, step {step} ({weights} weights)"
            self.writer.add_image(
                f"{tag}/cross_attention", figure_pixels(attention_figure(attention, title)), step, dataformats="HWC"
            )
        if attention_detail:
            kind, panels = attention_detail
            title = f"cross-attention by {kind[:-1]}, step {step} ({weights} weights)"
            figure = attention_figure(panels, title, scale_label="attention weight")
            self.writer.add_image(f"{tag}/cross_attention_{kind}", figure_pixels(figure), step, dataformats="HWC")
        self.writer.flush()

    def test(self, step: int, scores: dict) -> None:
        if self:
            self.writer.add_scalar("test/bleu", scores["bleu"], step)
            self.writer.add_scalar("test/chrf", scores["chrf"], step)

    def finish(self, step: int, metrics: dict) -> None:
        """The run ended: the HParams tab's metrics and the end of its session."""
        if not self:
            return
        if metrics.get("best_bleu") is not None and metrics["best_bleu"] >= 0:
            self.writer.add_scalar("val/best_bleu", metrics["best_bleu"], step)
        self.writer.file_writer.add_summary(self._session_end)
        self.writer.flush()

    def close(self) -> None:
        if self:
            self.writer.close()
