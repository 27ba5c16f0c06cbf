"""Training: `python -m transformer.train key=value ...` (Hydra), `torchrun -m transformer.train ...`.

`main` only turns the Hydra config into a call of `train(cfg)`, which tests call directly.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from transformer import distributed as D
from transformer.checkpoint import (
    CheckpointDirectory,
    average_checkpoints,
    load_checkpoint,
    load_model_weights,
    step_checkpoints,
)
from transformer.config import Config
from transformer.data.batching import TokenBatchSampler, UpdateSampler, update_loader
from transformer.data.mixture import MixedCorpus
from transformer.data.prepare import prepare
from transformer.data.sources import DataError, load_split_text
from transformer.data.tokenizer import Tokenizer
from transformer.errors import Interrupted
from transformer.inference.scoring import score
from transformer.inference.translator import Translator
from transformer.loss import batch_loss
from transformer.model import build_model, compile_layers
from transformer.runtime import Runtime
from transformer.training.ema import weights_swapped
from transformer.training.monitor import Monitor
from transformer.training.optim import build_optimizer
from transformer.training.progress import Progress
from transformer.training.run_dir import (
    Launch,
    RunDirectoryLock,
    TrainingError,
    attach_log_file,
    install_signal_handlers,
    resume_hint,
)
from transformer.training.state import TrainingState, starting_point
from transformer.training.step_log import TrainingBar, TrainLog, log_lines_above_bars
from transformer.training.validate import Validator, mean_metrics

log = logging.getLogger("transformer.train")

# Consecutive out-of-memory batches after which training stops (trainer.max_tokens is too large).
OOM_SKIP_LIMIT = 5


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, launch: Launch | None = None):
        self.cfg, self.run_dir, self.launch = cfg, run_dir, launch
        tc = cfg.trainer
        runtime = Runtime.for_training(tc)  # device, process group, precision: resolved once, here
        self.device, self.dist, self.precision, self.autocast = (
            runtime.device,
            runtime.dist,
            runtime.precision,
            runtime.autocast,
        )
        self.run_dir = Path(D.broadcast_object(str(run_dir), self.dist))
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.stop_signal: str | None = None

        start = starting_point(cfg, self.ckpt_dir, self.dist)
        resume_state, init_state = start.resume, start.init
        torch.manual_seed(tc.seed + self.dist.rank)
        random.seed(tc.seed + self.dist.rank)
        saved = resume_state or init_state
        tokenizer = Tokenizer.from_state_dict(saved["tokenizer"]) if saved else None
        # Every rank calls this: one prepares under a file lock (no collective is waiting meanwhile),
        # the others then memory-map the same files.
        self.data = prepare(cfg.data, tokenizer)
        tok = self.data.tokenizer
        if cfg.data.subword_sampling:
            self.data.train.enable_subword_sampling(tok, cfg.data.subword_sampling, cfg.data.subword_nbest, tc.seed)
        self.model = build_model(
            cfg.model, tok.src_vocab_size, tok.tgt_vocab_size, tok.joint, protected_ids=tok.protected_ids
        ).to(self.device)
        if init_state is not None:
            load_model_weights(self.model, init_state["model"], tc.init_from)
        self.optimizer, self.scheduler = build_optimizer(self.model, tc, self.device)
        # Validation and the test decode through the same front end as transformer-translate.
        self.translator = Translator(
            self.model, tok, cfg, self.device, autocast=self.autocast, tgt_lang=cfg.data.tgt_lang
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.state = TrainingState(
            cfg,
            self.model,
            tok,
            self.optimizer,
            self.scheduler,
            self.scaler,
            CheckpointDirectory(self.ckpt_dir, tc.keep_last, self.dist.is_main, background=True),
            self.data.train.identity,
            self.dist,
            self.device,
            bad_in_a_row=lambda: self.log.read()["bad_in_a_row"],
        )
        train = self.data.train
        self.sampler = TokenBatchSampler(
            train.src_lens,
            train.tgt_lens,
            tc.max_tokens,
            tc.seed,
            epoch_lengths=train.sampled_lengths if train.sampling else None,
            epoch_pairs=functools.partial(train.epoch_positions, tc.seed) if isinstance(train, MixedCorpus) else None,
        )
        self.updates = UpdateSampler(self.sampler, tc.update_freq, self.dist.rank, self.dist.world_size)
        if self.dist.is_main:
            self._warn_about_settings_the_run_cannot_honour()
        cuda = self.device.type == "cuda"
        workers = tc.num_workers if tc.num_workers is not None else (2 if cuda else 0)
        self.loader = update_loader(self.data.train, self.updates, workers, pin_memory=cuda)
        self.oom_skips = self.oom_in_a_row = 0
        if resume_state:
            self.state.load(resume_state)
        if tc.compile:
            compile_layers(self.model)
        self.train_model = self.model
        if self.dist.enabled:
            # No buffer changes during training (the sinusoid table is a constant): nothing to broadcast.
            self.train_model = DistributedDataParallel(
                self.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                broadcast_buffers=False,
            )
        self.monitor = Monitor(self.run_dir, enabled=self.dist.is_main)
        self.log = TrainLog(self.device, self.monitor, tc.max_bad_steps)
        if self.dist.is_main:
            self._log_banner(start.describe())
            self.monitor.start(cfg, self.precision)
        # One validator, or one per direction of a multilingual model (into its target language); the
        # attention pictures are drawn for the first.
        splits = self.data.directions or {None: (self.data.valid, self.data.sources["validation"])}
        pictures = tc.attention_heatmaps if self.dist.is_main and tc.attention_heatmaps != "off" else None
        self.validators = {
            direction: Validator(
                cfg,
                self.model,
                Translator(
                    self.model,
                    tok,
                    cfg,
                    self.device,
                    autocast=self.autocast,
                    tgt_lang=direction.split("-")[1] if direction else cfg.data.tgt_lang,
                ),
                corpus,
                source.read_all(),
                self.device,
                self.autocast,
                pictures if i == 0 else None,
            )
            for i, (direction, (corpus, source)) in enumerate(splits.items())
        }

    @property
    def progress(self) -> Progress:
        """Where the run stands (step, epoch, best score): part of the state a checkpoint holds."""
        return self.state.progress

    def _log_banner(self, start: str) -> None:
        """What the run is, at the top of its log: where it writes, how it starts, where and how it runs."""
        run_dir = self.run_dir.resolve()
        log.info(
            "run directory %s (train.log, checkpoints/); TensorBoard: %s (tensorboard --logdir %s)",
            run_dir,
            run_dir / "tb",
            run_dir.parent,
        )
        log.info("start: %s", start)
        name = f" ({torch.cuda.get_device_name(self.device)})" if self.device.type == "cuda" else ""
        parameters = sum(p.numel() for p in self.model.parameters())
        log.info(
            "device %s%s | precision %s | world size %d | model %s: %s parameters",
            self.device,
            name,
            self.precision,
            self.dist.world_size,
            self.cfg.model.name,
            f"{parameters:,}",
        )

    def _warn_about_settings_the_run_cannot_honour(self) -> None:
        """Settings the run cannot honour in full, said once: more batches per update than an epoch has
        (an update never spans two epochs), R-Drop without dropout, a warm-up longer than the run (the peak lr is
        never reached)."""
        tc, world = self.cfg.trainer, self.dist.world_size
        per_update = tc.update_freq * world
        # Each batch holds at most max_tokens of padded width: a lower bound, before counting exactly.
        if per_update > -(-int(self.sampler.widths.sum()) // tc.max_tokens):
            in_epoch = len(self.sampler.batches(0))
            if per_update > in_epoch:
                log.warning(
                    "trainer.update_freq=%d%s asks for more batches per update than an epoch has (%d of at "
                    "most trainer.max_tokens=%d tokens): every update takes the whole epoch, %d batches; "
                    "lower trainer.update_freq to %d or less, or trainer.max_tokens",
                    tc.update_freq,
                    f" x {world} processes" if world > 1 else "",
                    in_epoch,
                    tc.max_tokens,
                    in_epoch,
                    max(1, in_epoch // world),
                )
        mc = self.cfg.model
        if tc.rdrop and not (mc.dropout or mc.attention_dropout or mc.src_word_dropout or mc.tgt_word_dropout):
            log.warning(
                "trainer.rdrop=%g with model.dropout=0 and model.attention_dropout=0: the two passes of each "
                "batch are the same, R-Drop adds nothing and doubles the compute; set model.dropout (e.g. "
                "0.3) or trainer.rdrop=0",
                tc.rdrop,
            )
        if tc.max_steps and tc.warmup > tc.max_steps:
            log.warning(
                "trainer.warmup=%d is longer than the run (trainer.max_steps=%d): the learning rate rises to "
                "%.0f%% of trainer.lr=%g and never reaches it; lower trainer.warmup",
                tc.warmup,
                tc.max_steps,
                100 * tc.max_steps / tc.warmup,
                tc.lr,
            )

    def leave_process_group(self, clean: bool) -> None:
        """Drop the DDP/compile wrappers and DataLoader workers, then leave the process group (after a
        barrier on a clean exit, so that no rank tears down while another is still communicating;
        without one after an error, when the other ranks may be inside a different collective).
        Whatever references the process group (DDP's reducer, in a reference cycle with the model, say)
        must go while the interpreter is whole: gloo work objects freed during interpreter finalisation
        abort the process ("terminate called without an active exception"). Idempotent."""
        if self.train_model is None:
            return
        self.loader = self.updates = None
        self.train_model = None
        gc.collect()
        D.shutdown(self.dist, barrier=clean)

    # ------------------------------------------------------------------------------------------------
    # The loop

    def train_step(self, micro_batches) -> dict:
        """One optimizer update over `micro_batches` ((batch, weight) pairs).

        Reads no tensor value on the host, so a GPU never waits for Python: the summed loss and NLL,
        the gradient norm and whether the step was finite come back as device tensors, read only at
        log steps (`TrainLog.write`). A non-finite step is skipped on the device: the fused AdamW takes a
        `found_inf` flag (the fp16 GradScaler sets the same flag) and leaves weights and moments alone.
        """
        tc = self.cfg.trainer
        passes = 2 if tc.rdrop else 1  # R-Drop: every batch twice
        tokens = passes * sum(b.num_tgt_tokens * w for b, w in micro_batches)  # host ints counted by collate
        # The normaliser: every rank's target tokens. Under DDP an all-reduce on the device, not read back.
        # torch.full fills on the device; torch.tensor(x, device="cuda") would copy from the host and sync.
        global_tokens = (
            D.all_reduce_tensor(torch.full((), float(tokens), device=self.device), self.dist)
            if self.dist.enabled
            else float(tokens)
        )
        loss_sum = nll_sum = correct_sum = torch.zeros((), device=self.device)
        for i, (batch, weight) in enumerate(micro_batches):
            batch = batch.to(self.device, non_blocking=True)
            if tc.rdrop:
                batch = batch.twice()
            last = i == len(micro_batches) - 1
            sync = self.train_model.no_sync() if self.dist.enabled and not last else contextlib.nullcontext()
            try:
                with sync:
                    with self.autocast():
                        loss, nll, correct = batch_loss(self.train_model, batch, tc.label_smoothing, tc.rdrop)
                    # DDP averages gradients over ranks; scale by world size so the update is
                    # sum(loss over all ranks' tokens) / global target tokens.
                    scaled = loss * (weight * self.dist.world_size / global_tokens)
                    self.scaler.scale(scaled).backward()
                out_of_memory = False
            except torch.cuda.OutOfMemoryError:
                # Under DDP the other ranks are already waiting in the all-reduce: skipping here
                # would hang them, so the error stops the job instead.
                if self.dist.enabled:
                    raise
                out_of_memory = True
            if out_of_memory:
                # Outside the `except` block: its traceback, which held the forward's activations, is gone.
                return self._skip_out_of_memory(batch)
            loss_sum = loss_sum + loss.detach() * weight
            nll_sum = nll_sum + nll * weight
            correct_sum = correct_sum + correct * weight
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.clip_norm or float("inf"))
        finite = torch.isfinite(grad_norm) & torch.isfinite(loss_sum)  # () bool
        if self.scaler.is_enabled():
            self.scaler.step(self.optimizer)  # passes its own found_inf to the fused AdamW
            self.scaler.update()
        else:
            self.optimizer.found_inf = (~finite).float()
            self.optimizer.step()
            del self.optimizer.found_inf
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.stack([loss_sum, nll_sum, correct_sum])
        if self.dist.enabled:
            sums = D.all_reduce_tensor(sums, self.dist)
        return {"sums": sums, "grad_norm": grad_norm.detach(), "finite": finite, "tokens": global_tokens}

    def _skip_out_of_memory(self, batch) -> dict:
        """Drop the update whose batch ran out of GPU memory; after OOM_SKIP_LIMIT in a row, stop."""
        self.oom_skips += 1
        self.oom_in_a_row += 1
        shape = (
            f"{batch.src.size(0)} sentences, source {batch.src.size(1)} and target "
            f"{batch.tgt_in.size(1)} tokens wide"
            + (" (the batch twice, for trainer.rdrop)" if self.cfg.trainer.rdrop else "")
        )
        del batch
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.oom_in_a_row >= OOM_SKIP_LIMIT:
            raise TrainingError(
                f"out of memory on {self.oom_in_a_row} batches in a row (the last: {shape}): "
                f"trainer.max_tokens={self.cfg.trainer.max_tokens} is too large for this device; lower it "
                f"(e.g. trainer.max_tokens={self.cfg.trainer.max_tokens // 2}) and raise trainer.update_freq "
                "to keep the batch size"
            )
        log.warning(
            "out of memory on a batch of %s: skipped; lower trainer.max_tokens or data.max_len if this repeats", shape
        )
        return {"oom": True}

    def _stop_reason(self, started: float, agree: bool = True) -> str | None:
        """Why training stops now, or None. Step, epoch and patience limits are the same on every rank;
        the clock and signals are not, so under DDP the ranks agree on those (a collective whose result
        is read on the host) only where `agree` is true: at log steps and epoch ends."""
        tc, progress = self.cfg.trainer, self.progress
        if tc.max_steps and progress.step >= tc.max_steps:
            return f"reached trainer.max_steps={tc.max_steps}"
        if tc.max_epochs and progress.epoch >= tc.max_epochs:
            return f"reached trainer.max_epochs={tc.max_epochs}"
        if tc.patience and progress.bad_validations >= tc.patience:
            return f"no BLEU improvement in trainer.patience={tc.patience} validations"
        reason = self._signal_reason()
        if reason is None and tc.max_minutes and (time.monotonic() - started) / 60 >= tc.max_minutes:
            reason = f"reached trainer.max_minutes={tc.max_minutes}"
        if not self.dist.enabled:
            return reason
        if agree and D.any_rank(reason is not None, self.dist, self.device):
            # Ctrl-C reaches every rank, but this one's handler may run only once the collective returns.
            return reason or self._signal_reason() or "stopped on another rank"
        return None

    def _signal_reason(self) -> str | None:
        return f"stopped by {self.stop_signal}" if self.stop_signal else None

    def fit(self) -> dict:
        """The loop: updates until a stop reason, then a last validation and last.pt; returns the metrics."""
        tc, progress = self.cfg.trainer, self.progress
        started = time.monotonic()
        bar = TrainingBar(progress.step, tc.max_steps, tc.max_minutes, started, show=self.dist.is_main)
        reason = self._stop_reason(started)
        while reason is None:
            self.updates.start(progress.epoch, progress.position)
            for micro, consumed in self.loader:  # one optimizer update per item
                reason = self._update(micro, consumed, bar, started)
                if reason is not None:
                    break
            else:
                progress.epoch, progress.position = progress.epoch + 1, 0
                reason = self._stop_reason(started)
        bar.close(finished=self.stop_signal is None)
        self.log.check_finite(self.precision == "fp16")
        log.info("%s at step %d (epoch %d)", reason, progress.step, progress.epoch)
        # A signal may have reached only some ranks: agree, or they would enter different collectives.
        by_signal = D.any_rank(self.stop_signal is not None, self.dist, self.device)
        if progress.step % tc.validate_every != 0 and not by_signal:
            self.validate()
        if tc.average_last and not by_signal:
            self.average_last()  # before last.pt, so that its metrics (best score, patience) count it
        # Not twice at one step: unless a validation since the periodic save changed the metrics.
        if D.any_rank(not self.state.last_is_current(), self.dist, self.device):
            self.state.save("last.pt")  # non-finite updates were skipped: the weights are finite
        self.state.flush()  # the test reads best.pt; the hint names last.pt
        if self.dist.is_main:
            log.info("%s", resume_hint(self.run_dir, self.launch, reason))
        progress.stop_reason = reason
        return progress.metrics()

    def _update(self, micro, consumed: int, bar, started: float) -> str | None:
        """One optimizer update with its logging, validation and checkpoints; the stop reason, if any."""
        tc, progress = self.cfg.trainer, self.progress
        stats = self.train_step(micro)
        progress.position += consumed
        if stats.get("oom"):
            self.monitor.skipped_out_of_memory(progress.step, self.oom_skips)
            return self._stop_reason(started)
        progress.step += 1
        self.oom_in_a_row = 0
        if self.state.ema:
            self.state.ema.update(progress.step)
        bar.advance(progress.step)
        self.log.add(stats, micro)
        log_step = progress.step % tc.log_every == 0
        if log_step:
            progress.train_tokens_per_s = self.log.write(
                progress.step,
                progress.epoch,
                self.scheduler.get_last_lr()[0],
                self.scaler.get_scale() if self.scaler.is_enabled() else 1.0,
                self.precision == "fp16",
                bar,
            )
        if progress.step % tc.validate_every == 0:
            self.validate()
        if progress.step % (tc.checkpoint_every or tc.validate_every) == 0:
            self.log.check_finite(self.precision == "fp16")
            self.state.save("last.pt", periodic=True)
        return self._stop_reason(started, agree=log_step)

    def validate(self) -> None:
        """Validation loss and BLEU on rank 0 of the raw weights and, with trainer.ema_decay, of their
        moving average; the better set counts (and goes into best.pt). The result is broadcast so every
        rank agrees."""
        result = None
        step = self.progress.step
        if self.dist.is_main:
            log.info("validating at step %d", step)
            try:
                result = self._validate_main()
                if self.state.ema:
                    with weights_swapped(self.model, self.state.ema.model_state(self.model)):
                        result = _better(result, self._validate_main("ema"))
            except Interrupted:  # a stop signal arrived: skip the rest, the run saves and exits
                log.warning("validation at step %d interrupted by %s", step, self.stop_signal)
        result = D.broadcast_object(result, self.dist)
        if self._record_validation(result):
            self.state.save("best.pt", weights=result["weights"])

    def _record_validation(self, result: dict | None) -> bool:
        """Record a validation result (None: it was interrupted); True when it is a new best to save,
        which the log says with the best before it."""
        progress = self.progress
        before = (progress.best_bleu, progress.best_step)
        if result is None or not progress.record_validation(result) or not math.isfinite(result["loss"]):
            return False
        if self.dist.is_main:
            previous = "first validation" if before[1] is None else f"previous best {before[0]:.2f} at step {before[1]}"
            log.info(
                "new best validation BLEU %.2f at step %d (%s weights; %s)",
                result["bleu"],
                progress.step,
                result["weights"],
                previous,
            )
        return True

    def average_last(self) -> None:
        """trainer.average_last, at the end of a run: rank 0 validates the average of the last N
        step_N.pt; every rank records the result; if it beats the best so far, it becomes best.pt."""
        n = self.cfg.trainer.average_last
        result = state = None
        if self.dist.is_main:
            self.state.flush()  # the newest step_N.pt may still be being written
            paths = step_checkpoints(self.run_dir)[-n:]
            if len(paths) < 2:
                log.warning(
                    "trainer.average_last=%d: %d step_N.pt file(s) in %s, nothing to average; lower "
                    "trainer.checkpoint_every to write more",
                    n,
                    len(paths),
                    self.ckpt_dir,
                )
            else:
                state = average_checkpoints(paths)
                name = f"average of {', '.join(p.stem for p in paths)}"
                log.info("validating the %s", name)
                try:
                    with weights_swapped(self.model, state["model"]):
                        result = {**self._validate_main("average"), "weights": name}
                except Interrupted:
                    log.warning("validation of the %s interrupted by %s", name, self.stop_signal)
        result = D.broadcast_object(result, self.dist)
        if self._record_validation(result) and self.dist.is_main:
            state.update(weights=result["weights"], metrics=self.progress.metrics())
            self.state.write(state, "best.pt", "averaged")

    def _stopping(self) -> bool:
        """Asked between validation batches: a stop signal abandons the validation."""
        return self.stop_signal is not None

    def _validate_main(self, weights: str = "raw") -> dict:
        """The validator's result for the weights the model holds (`weights` names them: raw, ema,
        average; TensorBoard's val/, val_ema/, ...), logged and drawn (rank 0)."""
        results = {direction: validator.run(self._stopping) for direction, validator in self.validators.items()}
        for direction, result in results.items():
            self._log_validation(result.metrics, weights, direction or "", result.signature)
            self.monitor.validation(
                self.progress.step,
                weights,
                result.metrics,
                result.samples,
                result.panels,
                result.detail,
                direction=direction,
            )
        if None in results:
            return {**results[None].metrics, "weights": weights}
        mean = mean_metrics([result.metrics for result in results.values()])  # drives best.pt and patience
        self._log_validation(mean, weights, f"mean of {len(results)} directions", "")
        self.monitor.validation(self.progress.step, weights, mean, [])
        return {**mean, **{f"bleu_{d}": r.metrics["bleu"] for d, r in results.items()}, "weights": weights}

    def _log_validation(self, m: dict, weights: str, what: str, signature: str) -> None:
        log.info(
            "validation step %d%s%s | loss %.3f | ppl %.2f | accuracy %.1f%% | BLEU %.2f | chrF %.2f | cut %.1f%%%s",
            self.progress.step,
            f" {what}" if what else "",
            "" if weights == "raw" else f" ({weights} weights)",
            m["loss"],
            m["ppl"],
            100 * m["accuracy"],
            m["bleu"],
            m["chrf"],
            100 * m["cut_at_max_len"],
            f" | {signature}" if signature else "",
        )

    def test(self) -> dict | None:
        """Translate the test split with the decode config and the best weights; print BLEU."""
        if not self.dist.is_main:
            return None
        best = self.ckpt_dir / "best.pt"
        if best.exists():
            load_model_weights(self.model, load_checkpoint(best)["model"], best)
        try:
            sources, references = load_split_text(self.cfg.data, "test")
        except DataError as error:
            log.warning("no test split to score: %s", error)
            return None
        dc = self.cfg.decode
        texts = self.translator.translate(sources, batch_tokens=dc.batch_tokens, progress=None, desc="test")
        scores = score(texts, references, self.cfg.data.tgt_lang)
        direction = f"{self.cfg.data.src_lang}-{self.cfg.data.tgt_lang}, " if self.data.directions else ""
        message = (
            f"test BLEU {scores['bleu']:.2f} | chrF {scores['chrf']:.2f} ({direction}{len(sources)} sentences, "
            f"beam {dc.beam_size}, {best if best.exists() else 'final weights'}) {scores['bleu_signature']}"
        )
        log.info(message)
        print(message, flush=True)
        self.monitor.test(self.progress.step, scores)
        return scores


def _better(raw: dict, other: dict) -> dict:
    """Of two validation results of one step, the one with the higher BLEU, with both BLEUs recorded."""
    best = other if other["bleu"] > raw["bleu"] else raw
    return {**best, f"bleu_{raw['weights']}": raw["bleu"], f"bleu_{other['weights']}": other["bleu"]}


def train(cfg, run_dir: str | Path | None = None) -> dict:
    """Train a model as configured; returns the final metrics. `cfg` is a Config, DictConfig or dict."""
    if not isinstance(cfg, Config):
        from omegaconf import OmegaConf

        raw = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else cfg
        cfg = Config.from_dict(raw)
    else:
        cfg.data.validate_for_training()
    run_dir = Path(run_dir or cfg.run_dir or "runs/default")
    cfg.run_dir = str(run_dir)
    is_main = int(os.environ.get("RANK", "0")) == 0
    lock = RunDirectoryLock.acquire(run_dir) if is_main else None  # one run per directory
    try:
        attach_log_file(run_dir, is_main=is_main)
        with log_lines_above_bars():
            return _train_in(cfg, run_dir, _launch_of_this_process())
    finally:
        if lock:
            lock.release()


def _launch_of_this_process() -> Launch | None:
    """How this process was started, when Hydra started it (the command that continues the run takes
    the same form); None when `train` is called as a library function."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return Launch.detect(sys.argv, os.environ, list(HydraConfig.get().overrides.task))


def _train_in(cfg: Config, run_dir: Path, launch: Launch | None) -> dict:
    """`train` once the run directory is locked and logged to."""
    trainer = Trainer(cfg, run_dir, launch)
    if cfg.trainer.test_at_end and cfg.data.path and trainer.dist.is_main:
        _check_test_split(cfg)
    handlers = install_signal_handlers(trainer)
    try:
        metrics = trainer.fit()
        trainer.leave_process_group(clean=True)  # the test below runs on rank 0 alone
        if trainer.stop_signal is None and cfg.trainer.test_at_end:
            test_scores = trainer.test()
            if test_scores:
                metrics.update(test_bleu=test_scores["bleu"], test_chrf=test_scores["chrf"])
        trainer.monitor.finish(trainer.progress.step, metrics)
        if trainer.stop_signal is not None:
            metrics["stopped_by"] = trainer.stop_signal  # a sweep stops (and says which job it was)
        return metrics
    except BaseException:
        if trainer.dist.is_main and trainer.progress.stop_reason is None and (trainer.ckpt_dir / "last.pt").is_file():
            log.info("%s", resume_hint(trainer.run_dir, launch))  # stopped by an error or a second Ctrl-C
        raise
    finally:
        for sig, previous in handlers.items():
            signal.signal(sig, previous)
        trainer.state.checkpoints.close()  # lets a write in flight finish
        trainer.monitor.close()
        trainer.leave_process_group(clean=False)  # after an error: no barrier


def _check_test_split(cfg: Config) -> None:
    """A test split the end of training could not read is said now, not after hours of training."""
    try:
        load_split_text(cfg.data, "test")
    except DataError as error:
        log.warning(
            "no test split to score at the end of this run (trainer.test_at_end): %s; it trains and "
            "validates all the same (trainer.test_at_end=false silences this)",
            error,
        )
