"""Model selection: which weights a run keeps. Validation on rank 0 of the raw weights and, with
trainer.ema_decay, of their moving average (the better set counts); the average of the last step
checkpoints at the end (trainer.average_last); best.pt, patience (through `Progress`), and the test of the
best weights at the end. Every rank gets the same result (broadcast), so that all agree on best.pt and on
stopping."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transformer.checkpoint import average_checkpoints, load_checkpoint, load_model_weights, step_checkpoints
from transformer.config import Config
from transformer.data.augment import VARIANTS
from transformer.data.corpus import PreparedData
from transformer.data.sources import DataError, load_split_text
from transformer.errors import Interrupted
from transformer.inference.request import DecodeRequest
from transformer.inference.scoring import score
from transformer.inference.test_results import write_test_results
from transformer.inference.translator import Translator
from transformer.runtime import Runtime
from transformer.training.ema import weights_swapped
from transformer.training.monitor import Monitor
from transformer.training.run_log import announce
from transformer.training.state import TrainingState
from transformer.training.validate import Validator, mean_metrics

log = logging.getLogger("transformer.train")


@dataclass
class Selected:
    """One validation as the run records it: `metrics` (loss, BLEU, ... of the weights that counted, the
    BLEU of each set and direction), `weights` (raw, ema, or which checkpoints were averaged) and whether
    it is a new best (then in best.pt). `metrics` is None when the validation was interrupted."""

    metrics: dict | None
    weights: str | None
    new_best: bool


class Selection:
    """The validators (one, or one per direction of a multilingual model) and what their results mean."""

    def __init__(
        self,
        cfg: Config,
        data: PreparedData,
        state: TrainingState,
        runtime: Runtime,
        monitor: Monitor,
        stop_signal: Callable[[], str | None],
    ):
        self.cfg, self.state, self.runtime, self.monitor, self.stop_signal = cfg, state, runtime, monitor, stop_signal
        self.has_directions = bool(data.directions)
        tc, model = cfg.trainer, state.model
        # One validator, or one per direction of a multilingual model (into its target language); the
        # attention pictures are drawn for the first.
        splits = data.directions or {None: (data.valid, data.sources["validation"])}
        # data.validate_zero_shot: the directions no corpus trains, validated beside them
        self.zero_shot = set(data.zero_shot)
        splits = {**splits, **data.zero_shot}
        pictures = tc.attention_heatmaps if runtime.is_main and tc.attention_heatmaps != "off" else None
        self.validators = {
            direction: Validator(
                cfg,
                model,
                self.translator(direction.split("-")[1] if direction else cfg.data.tgt_lang),
                corpus,
                source.read_all(),
                runtime.device,
                runtime.autocast,
                pictures if i == 0 else None,
            )
            for i, (direction, (corpus, source)) in enumerate(splits.items())
        }

    def translator(self, tgt_lang: str | None) -> Translator:
        """The model through the same front end as transformer-translate."""
        rt = self.runtime
        return Translator(
            self.state.model, self.state.tokenizer, self.cfg, rt.device, autocast=rt.autocast, tgt_lang=tgt_lang
        )

    def validate(self) -> Selected:
        """Validate the weights the model holds (and their moving average); best.pt when a new best."""
        result, step = None, self.state.progress.step
        if self.runtime.is_main:
            log.info("validating at step %d", step)
            try:
                result = self._validate_main()
                if self.state.ema:
                    with weights_swapped(self.state.model, self.state.ema.model_state(self.state.model)):
                        result = _better(result, self._validate_main("ema"))
            except Interrupted:  # a stop signal arrived: skip the rest, the run saves and exits
                log.warning("validation at step %d interrupted by %s", step, self.stop_signal())
        selected = self._record(self.runtime.broadcast(result))
        if selected.new_best:
            self.state.save("best.pt", weights=selected.weights)
        return selected

    def average_last(self) -> Selected:
        """trainer.average_last, at the end of a run: rank 0 validates the average of the last N
        step_N.pt; every rank records the result; if it beats the best so far, it becomes best.pt."""
        n, run_dir = self.cfg.trainer.average_last, self.state.checkpoints.directory.parent
        result = state = None
        if self.runtime.is_main:
            self.state.flush()  # the newest step_N.pt may still be being written
            paths = step_checkpoints(run_dir)[-n:]
            if len(paths) < 2:
                log.warning(
                    "trainer.average_last=%d: %d step_N.pt file(s) in %s, nothing to average; lower "
                    "trainer.checkpoint_every to write more",
                    n,
                    len(paths),
                    self.state.checkpoints.directory,
                )
            else:
                state = average_checkpoints(paths)
                name = f"average of {', '.join(p.stem for p in paths)}"
                log.info("validating the %s", name)
                try:
                    with weights_swapped(self.state.model, state["model"]):
                        result = {**self._validate_main("average"), "weights": name}
                except Interrupted:
                    log.warning("validation of the %s interrupted by %s", name, self.stop_signal())
        selected = self._record(self.runtime.broadcast(result))
        if selected.new_best and self.runtime.is_main:
            state.update(weights=selected.weights, metrics=self.state.progress.metrics())
            self.state.write(state, "best.pt", "averaged")
        return selected

    def _record(self, result: dict | None) -> Selected:
        """Record a validation result (None: it was interrupted) in the run's progress; a new best is
        said in the log with the best before it."""
        progress = self.state.progress
        before = (progress.best_bleu, progress.best_step)
        if result is None:
            return Selected(None, None, False)
        new_best = progress.record_validation(result) and math.isfinite(result["loss"])
        if new_best and self.runtime.is_main:
            previous = "first validation" if before[1] is None else f"previous best {before[0]:.2f} at step {before[1]}"
            log.info(
                "new best validation BLEU %.2f at step %d (%s weights; %s)",
                result["bleu"],
                progress.step,
                result["weights"],
                previous,
            )
        return Selected(result, result["weights"], new_best)

    def _validate_main(self, weights: str = "raw") -> dict:
        """The validators' result for the weights the model holds (`weights` names them: raw, ema,
        average; TensorBoard's val/, val_ema/, ...), logged and drawn (rank 0)."""
        step = self.state.progress.step
        stopping = lambda: self.stop_signal() is not None  # noqa: E731  (asked between validation batches)
        results = {direction: validator.run(stopping) for direction, validator in self.validators.items()}
        for direction, result in results.items():
            _log_validation(step, result.metrics, weights, direction or "", result.signature)
            self.monitor.validation(
                step, weights, result.metrics, result.samples, result.panels, result.detail, direction=direction
            )
        if None in results:
            return {**results[None].metrics, "weights": weights}
        trained = [r.metrics for d, r in results.items() if d not in self.zero_shot]
        untrained = [r.metrics for d, r in results.items() if d in self.zero_shot]
        if untrained:
            zero_shot = mean_metrics(untrained)
            _log_validation(step, zero_shot, weights, f"mean of {len(untrained)} zero-shot directions", "")
            self.monitor.validation(step, weights, zero_shot, [], direction="zero-shot")
        # the mean that drives best.pt and patience: the trained directions' (trainer.select_zero_shot: all)
        counted = trained + (untrained if self.cfg.trainer.select_zero_shot else [])
        mean = mean_metrics(counted)
        what = f"mean of {len(counted)} directions" + (" (zero-shot included)" if len(counted) > len(trained) else "")
        _log_validation(step, mean, weights, what, "")
        self.monitor.validation(step, weights, mean, [])
        return {**mean, **{f"bleu_{d}": r.metrics["bleu"] for d, r in results.items()}, "weights": weights}

    def test(self, run_dir: Path) -> dict | None:
        """Translate the test split with the decode config and the best weights (rank 0); print BLEU."""
        if not self.runtime.is_main:
            return None
        cfg, best = self.cfg, run_dir / "checkpoints" / "best.pt"
        best_step = None
        if best.exists():
            tested = load_checkpoint(best)
            load_model_weights(self.state.model, tested["model"], best)
            best_step = tested.get("step")
        try:
            sources, references = load_split_text(cfg.data, "test")
        except DataError as error:
            log.warning("no test split to score: %s", error)
            return None
        dc = cfg.decode
        hyps = self.translator(cfg.data.tgt_lang).hypotheses(
            sources, DecodeRequest(batch_tokens=dc.batch_tokens), progress=None, desc="test"
        )
        texts = [h[0].text for h in hyps]
        scores = score(texts, references, cfg.data.tgt_lang)
        direction = f"{cfg.data.src_lang}-{cfg.data.tgt_lang}, " if self.has_directions else ""
        message = (
            f"test BLEU {scores['bleu']:.2f} | chrF {scores['chrf']:.2f} ({direction}{len(sources)} sentences, "
            f"beam {dc.beam_size}, {best if best.exists() else 'final weights'}) {scores['bleu_signature']}"
        )
        announce(message)
        self.monitor.test(self.state.progress.step, scores)
        details = {"split": cfg.data.split_name(cfg.data.test_split), "sentences": len(sources)}
        details.update(beam=dc.beam_size, src_lang=cfg.data.src_lang, tgt_lang=cfg.data.tgt_lang)
        write_test_results(run_dir, best if best.exists() else None, best_step, details, scores)  # for model cards
        return scores


def _better(raw: dict, other: dict) -> dict:
    """Of two validation results of one step, the one with the higher BLEU, with both BLEUs recorded."""
    best = other if other["bleu"] > raw["bleu"] else raw
    return {**best, f"bleu_{raw['weights']}": raw["bleu"], f"bleu_{other['weights']}": other["bleu"]}


def _log_validation(step: int, m: dict, weights: str, what: str, signature: str) -> None:
    log.info(
        "validation step %d%s%s | loss %.3f | ppl %.2f | accuracy %.1f%% | BLEU %.2f | chrF %.2f | cut %.1f%%%s",
        step,
        f" {what}" if what else "",
        "" if weights == "raw" else f" ({weights} weights)",
        m["loss"],
        m["ppl"],
        100 * m["accuracy"],
        m["bleu"],
        m["chrf"],
        100 * m["cut_at_max_len"],
        "".join(
            f" | {key[5:]} BLEU {value:.2f}"
            for key, value in m.items()
            if key.startswith("bleu_") and key[5:] in VARIANTS
        )
        + (f" | off-target {m['off_target']:.1f}%" if "off_target" in m else "")
        + (f" | {signature}" if signature else ""),
    )
