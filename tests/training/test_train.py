"""End-to-end training: the default recipe learns, resume is exact, signals save, bad input stops early."""

import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import FAST, ROOT, HostReads, compose_config, wait_for_log
from transformer.checkpoint import load_checkpoint
from transformer.config import ConfigError
from transformer.data.sources import DataError
from transformer.errors import TrainingError
from transformer.training.trainer import train


@pytest.mark.slow
def test_training_learns_and_writes_the_run_directory(trained_run):
    run_dir, metrics = trained_run
    history = metrics["val_history"]
    assert history[-1]["loss"] < history[0]["loss"]
    assert history[-1]["bleu"] > history[0]["bleu"]
    assert metrics["test_bleu"] >= 80, metrics
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert {"best.pt", "last.pt", "step_240.pt"} <= set(names)
    assert not [n for n in names if "tmp" in n]
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert set(state) >= {
        "model",
        "config",
        "tokenizer",
        "step",
        "optimizer",
        "scheduler",
        "scaler",
        "rng",
        "data_state",
        "metrics",
    }
    assert state["step"] == 240 and state["config"]["model"]["d_model"] == 96
    assert (run_dir / "train.log").read_text().count("validation step") == 3

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"images": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in (
        "train/loss",
        "train/nll",
        "train/ppl",
        "train/lr",
        "train/grad_norm",
        "train/loss_scale",
        "train/tokens_per_s",
        "train/padding_share",
        "val/loss",
        "val/ppl",
        "val/bleu",
        "val/chrf",
        "val/cut_at_max_len",
    ):
        assert tag in tags, tag
    assert "val/cross_attention_1" in events.Tags()["images"]
    samples = events.Tensors("val/samples/text_summary")
    text = samples[-1].tensor_proto.string_val[0].decode()
    assert text.count("**src**") == 4 and text.count("**hyp**") == 4
    assert "**ref** " in text and len(text) > 200


def _params(path: Path) -> dict:
    return load_checkpoint(path)["model"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "workers, sampling, augmented", [(0, 0.0, False), (2, 0.0, False), (2, 0.1, False), (2, 0.0, True)]
)
def test_resume_continues_exactly(tmp_path, data_cache, workers, sampling, augmented, caplog):
    """Also with subword sampling or augmentation (data.augment_*): each batch's segmentation and noise
    depend on (seed, epoch, batch) alone, whichever process collates it and wherever the run was
    interrupted."""
    common = FAST + [
        "data.embedded_pairs=800",
        "trainer.precision=fp32",
        "trainer.device=cpu",
        "trainer.update_freq=2",
        "trainer.validate_every=5",
        "trainer.val_max_sentences=8",
        "decode.beam_size=1",
        "model.dropout=0.2",
        "trainer.max_minutes=0",
        "trainer.test_at_end=false",
        "trainer.ema_decay=0.8",
        f"trainer.num_workers={workers}",
        f"data.subword_sampling={sampling}",
        "trainer.weight_decay=0.01",
        "trainer.weight_decay_norm_bias=false",
    ]  # two optimizer groups
    if augmented:
        common += [
            "data.augment_upper=0.2",
            "data.augment_typos=0.3",
            "data.augment_merge=0.2",
            "data.augment_nopunct=0.1",
        ]
    # Uninterrupted: 20 steps (two batches each: more than one epoch of the 800-pair corpus).
    import logging

    with caplog.at_level(logging.INFO):
        train(compose_config(common + ["trainer.max_steps=20"], data_cache), tmp_path / "full")
    assert ("re-segmented with SentencePiece sampling (data.subword_sampling=0.1)" in caplog.text) == bool(sampling)
    assert ("training pairs augmented (upper 0.2, typos 0.3, nopunct 0.1, merge 0.2" in caplog.text) == augmented
    # Interrupted after 7 steps, then resumed to 20.
    train(compose_config(common + ["trainer.max_steps=7"], data_cache), tmp_path / "split")
    assert load_checkpoint(tmp_path / "split/checkpoints/last.pt")["step"] == 7
    metrics = train(
        compose_config(common + ["trainer.max_steps=20", "trainer.resume=true"], data_cache), tmp_path / "split"
    )
    full, resumed = _params(tmp_path / "full/checkpoints/last.pt"), _params(tmp_path / "split/checkpoints/last.pt")
    assert load_checkpoint(tmp_path / "full/checkpoints/last.pt")["data_state"]["epoch"] >= 1
    for name in full:
        assert torch.equal(full[name], resumed[name]), name
    full_ema = load_checkpoint(tmp_path / "full/checkpoints/last.pt")["ema"]["weights"]
    resumed_ema = load_checkpoint(tmp_path / "split/checkpoints/last.pt")["ema"]["weights"]
    assert all(torch.equal(full_ema[name], resumed_ema[name]) for name in full_ema)  # the EMA resumes too
    assert metrics["stop_reason"] == "reached trainer.max_steps=20"
    if not workers:  # a resume with other batching settings continues, but says it is not exact
        with caplog.at_level(logging.WARNING):
            train(
                compose_config(
                    common + ["trainer.max_steps=21", "trainer.resume=true", "trainer.max_tokens=900"], data_cache
                ),
                tmp_path / "split",
            )
        assert (
            "trainer.resume: trainer.max_tokens 1024 -> 900 differ from the checkpoint: they apply from its "
            "step 20 on, so the run does not continue as the interrupted one would have" in caplog.text
        )
        assert "trainer.max_steps 20 -> 21" not in caplog.text  # honoured on resume: no warning
    if workers:  # batches collated in worker processes train exactly like batches collated in-process
        train(
            compose_config([c for c in common if "num_workers" not in c] + ["trainer.max_steps=20"], data_cache),
            tmp_path / "in-process",
        )
        in_process = _params(tmp_path / "in-process/checkpoints/last.pt")
        assert all(torch.equal(full[name], in_process[name]) for name in full)


@pytest.mark.slow
def test_the_trainer_hands_freed_memory_back_at_its_cadence(tmp_path, data_cache, monkeypatch):
    import transformer.training.trainer as trainer_module

    steps = []
    monkeypatch.setattr(trainer_module, "FREED_MEMORY_EVERY", 3)
    monkeypatch.setattr(trainer_module, "hand_back_freed_memory", lambda: steps.append(len(steps)))
    overrides = ["trainer.max_steps=7", "trainer.validate_every=1000", "trainer.test_at_end=false"]
    train(compose_config(FAST + overrides, data_cache), tmp_path)
    assert len(steps) == 2  # after steps 3 and 6 of 7


def test_refuses_a_run_directory_holding_another_run(untrained_checkpoint, tmp_path, data_cache):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(untrained_checkpoint, run_dir / "checkpoints" / "best.pt")
    with pytest.raises(TrainingError, match="trainer.resume=true"):
        train(compose_config(FAST + ["trainer.max_steps=1"], data_cache), run_dir)


def test_max_tokens_smaller_than_a_sentence_fails_before_training(tmp_path, data_cache):
    with pytest.raises(DataError, match="trainer.max_tokens=8 is smaller than the longest sentence"):
        train(compose_config(FAST + ["trainer.max_tokens=8"], data_cache), tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def test_a_run_refused_while_it_is_built_leaves_the_process_group_first(tmp_path, data_cache, monkeypatch):
    """Under torchrun the runtime joins the process group before the data are read: a refused corpus must
    leave it (no barrier) before the one-line error ends the process, or the rank aborts at exit (SIGABRT)."""
    from transformer.runtime import Runtime

    left = []
    monkeypatch.setattr(Runtime, "shutdown", lambda self, barrier: left.append(barrier))
    with pytest.raises(DataError, match="trainer.max_tokens=8"):
        train(compose_config(FAST + ["trainer.max_tokens=8"], data_cache), tmp_path)
    assert left == [False]


@pytest.mark.slow
def test_a_run_the_time_limit_cut_short_says_so_in_its_last_line(tmp_path, data_cache, capsys):
    cfg = compose_config(
        FAST
        + [
            "trainer.max_steps=600",
            "trainer.max_minutes=0.0001",  # 6 ms: the first step outlasts it
            "trainer.validate_every=1000",
            "trainer.val_max_sentences=4",
            "decode.beam_size=1",
        ],
        data_cache,
    )
    metrics = train(cfg, tmp_path)
    assert metrics["stop_reason"] == "reached trainer.max_minutes=0.0001"
    step = load_checkpoint(tmp_path / "checkpoints" / "last.pt")["step"]
    assert 1 <= step < 600
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("test BLEU ")  # the score, then why it falls short
    assert lines[-1] == (
        f"stopped by trainer.max_minutes=0.0001 at step {step} of trainer.max_steps=600: the result is short of "
        "the planned run; add trainer.resume=true to continue it from last.pt, or set trainer.max_minutes=0 for "
        "no time limit"
    )
    assert lines[-1] in (tmp_path / "train.log").read_text()


def test_the_time_limit_line_says_whether_the_minutes_were_the_plan():
    from transformer.config import TrainerConfig
    from transformer.training.trainer import time_limit_note

    assert time_limit_note(TrainerConfig(max_minutes=20), 3247) == (
        "stopped by trainer.max_minutes=20 at step 3247: the run's time limit"  # the schema's max_steps: a backstop
    )
    assert time_limit_note(TrainerConfig(max_minutes=4, max_steps=600), 126).startswith(
        "stopped by trainer.max_minutes=4 at step 126 of trainer.max_steps=600: the result is short of the planned run"
    )
    both = time_limit_note(TrainerConfig(max_minutes=1.5, max_steps=0, max_epochs=3), 10)
    assert both.startswith("stopped by trainer.max_minutes=1.5 at step 10 of trainer.max_epochs=3: the result is short")


def test_the_embedded_default_is_bounded_by_steps_alone():
    tc = compose_config().trainer  # make train with no arguments
    assert (tc.max_steps, tc.max_minutes, tc.max_epochs) == (600, 0, 0)


def _train_cli(args, cwd, **kwargs):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "transformer.train", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


@pytest.mark.slow
def test_cli_rejects_impossible_settings_naming_the_key(tmp_path):
    proc = _train_cli(["model.n_heads=3", f"hydra.run.dir={tmp_path}"], ROOT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert "model.d_model=128 is not divisible by model.n_heads=3" in out
    assert "Traceback" not in out
    with pytest.raises(ConfigError, match="trainer.lr"):
        compose_config(["trainer.lr=-0.1"])
    assert list(tmp_path.iterdir()) == []  # refused before Hydra writes into the directory the user named


@pytest.mark.slow
def test_a_refused_start_leaves_no_timestamped_directory_behind(tmp_path):
    (tmp_path / "runs" / "earlier").mkdir(parents=True)
    proc = _train_cli(["model.n_heads=3"], tmp_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert "model.d_model=128 is not divisible by model.n_heads=3" in out
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["earlier"]  # runs/toy/tiny/<time> all gone
    chosen = _train_cli(["model.n_heads=3", "hydra.run.dir=runs/${data.name}/mine"], tmp_path)  # nor a chosen one
    out, _ = chosen.communicate(timeout=120)
    assert chosen.returncode == 2 and "model.d_model=128 is not divisible" in out, out
    assert not (tmp_path / "runs/toy").exists()


def test_only_an_unused_run_directory_is_discarded(tmp_path):
    from transformer.training.run_dir import RunDirectoryLock, discard_unused_run_directory

    base = tmp_path / "runs" / "toy"
    for name, extra in (("with-checkpoints", "checkpoints"), ("locked", None), ("unused", None)):
        (base / name / ".hydra").mkdir(parents=True)
        (base / name / "train.log").write_text("refused\n")
        if extra:
            (base / name / extra).mkdir()
    lock = RunDirectoryLock.acquire(base / "locked")  # a run of this process
    try:
        outcomes = [discard_unused_run_directory(base / name) for name in ("with-checkpoints", "locked", "unused")]
    finally:
        lock.release()
    assert outcomes == [False, False, True]
    assert sorted(p.name for p in base.iterdir()) == ["locked", "with-checkpoints"]
    older = base / "written-before-this-start"
    (older / ".hydra").mkdir(parents=True)
    assert not discard_unused_run_directory(older, created_since=time.time() + 60) and older.is_dir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from transformer.training.run_dir import "
            f"RunDirectoryLock; RunDirectoryLock.acquire({str(base / 'locked')!r}); "
            "print('held', flush=True); time.sleep(60)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not discard_unused_run_directory(base / "locked")  # a run of another process
    finally:
        holder.kill()
        holder.wait()
    assert (base / "locked" / "train.log").exists()


@pytest.mark.slow
@pytest.mark.parametrize("sig, whole_group", [(signal.SIGTERM, False), (signal.SIGINT, True)])
def test_a_stop_signal_finishes_the_step_saves_last_and_exits_128_plus_its_number(
    tmp_path, data_cache, sig, whole_group
):
    # DataLoader workers run: Ctrl-C in a terminal signals the whole process group, workers included.
    run_dir = tmp_path / "run"
    proc = _train_cli(
        FAST
        + [
            "trainer.max_steps=100000",
            "trainer.log_every=1",
            "trainer.validate_every=100000",
            "trainer.num_workers=2",
            f"data.cache_dir={data_cache}",
            f"hydra.run.dir={run_dir}",
        ],
        ROOT,
        start_new_session=True,
    )
    wait_for_log(run_dir / "train.log", "step 5 |", 180)
    assert proc.poll() is None, proc.stdout.read()
    if whole_group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig.value, out  # 143 / 130: stopped, not finished (`&& next` stops)
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert state["step"] >= 5
    assert f"{sig.name} received" in out and "trainer.resume=true" in out
    assert "Traceback" not in out


@pytest.mark.slow
def test_nan_loss_stops_the_run_and_keeps_finite_checkpoints(tmp_path, data_cache, monkeypatch):
    import transformer.training.step as train_module

    calls = {"n": 0}
    real_batch_loss = train_module.batch_loss

    def poisoned(model, batch, smoothing, rdrop=0.0):
        calls["n"] += 1
        loss, nll, correct = real_batch_loss(model, batch, smoothing, rdrop)
        if calls["n"] > 6:  # from the 7th step on, the loss is NaN
            return loss * float("nan"), nll * float("nan"), correct
        return loss, nll, correct

    monkeypatch.setattr(train_module, "batch_loss", poisoned)
    cfg = compose_config(
        FAST
        + [
            "trainer.max_steps=50",
            "trainer.validate_every=2",
            "trainer.max_bad_steps=3",
            "trainer.val_max_sentences=4",
            "decode.beam_size=1",
            "trainer.precision=fp32",
            "trainer.test_at_end=false",
        ],
        data_cache,
    )
    # Checked where the step's numbers are read anyway (log steps, checkpoints): here at step 10.
    with pytest.raises(TrainingError, match="not finite for 4 steps in a row"):
        train(cfg, tmp_path)
    for name in ("last.pt", "best.pt"):
        state = load_checkpoint(tmp_path / "checkpoints" / name)
        assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point()), name
    # The non-finite updates were skipped on the device: step 8's weights are step 6's.
    last, sixth = (
        load_checkpoint(tmp_path / "checkpoints" / "last.pt"),
        load_checkpoint(tmp_path / "checkpoints" / "step_6.pt"),
    )
    assert last["step"] == 8 and all(torch.equal(last["model"][k], sixth["model"][k]) for k in sixth["model"])
    assert last["optimizer"]["state"][0]["step"] == 6  # nor did Adam count them


@pytest.mark.slow
def test_out_of_memory_on_one_batch_skips_it_and_training_goes_on(tmp_path, data_cache, monkeypatch, caplog):
    import logging

    import transformer.training.step as train_module

    calls = {"n": 0}
    real_batch_loss = train_module.batch_loss

    def flaky(model, batch, smoothing, rdrop=0.0):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_batch_loss(model, batch, smoothing, rdrop)

    monkeypatch.setattr(train_module, "batch_loss", flaky)
    cfg = compose_config(
        FAST
        + [
            "trainer.max_steps=6",
            "trainer.validate_every=6",
            "trainer.val_max_sentences=4",
            "decode.beam_size=1",
            "trainer.test_at_end=false",
        ],
        data_cache,
    )
    with caplog.at_level(logging.WARNING):
        train(cfg, tmp_path)
    assert "out of memory on a batch of" in caplog.text and "skipped" in caplog.text
    state = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert state["step"] == 6 and calls["n"] == 7  # 6 optimizer steps plus the skipped batch


@pytest.mark.slow
def test_a_batch_budget_too_large_for_the_device_stops_with_one_line(tmp_path, data_cache, monkeypatch):
    import transformer.training.step as train_module
    from transformer.errors import TrainingError

    calls = {"n": 0}
    real_batch_loss = train_module.batch_loss

    def no_memory_after_two(model, batch, smoothing, rdrop=0.0):
        calls["n"] += 1
        if calls["n"] > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_batch_loss(model, batch, smoothing, rdrop)

    monkeypatch.setattr(train_module, "batch_loss", no_memory_after_two)
    cfg = compose_config(FAST + ["trainer.max_steps=50", "trainer.test_at_end=false"], data_cache)
    with pytest.raises(TrainingError) as error:
        train(cfg, tmp_path)
    assert calls["n"] == 2 + train_module.OOM_SKIP_LIMIT  # not an endless loop of skips
    message = str(error.value)
    assert "\n" not in message and message.startswith(
        f"out of memory on {train_module.OOM_SKIP_LIMIT} batches in a row"
    )
    assert "trainer.max_tokens=1024 is too large for this device; lower it (e.g. trainer.max_tokens=512)" in message


@pytest.mark.slow
def test_overwrite_replaces_an_old_run(tmp_path, data_cache):
    quick = FAST + [
        "trainer.validate_every=100",
        "trainer.val_max_sentences=4",
        "decode.beam_size=1",
        "trainer.test_at_end=false",
        "trainer.checkpoint_every=3",
    ]
    train(compose_config(quick + ["trainer.max_steps=3"], data_cache), tmp_path)
    assert (tmp_path / "checkpoints" / "step_3.pt").exists()
    train(compose_config(quick + ["trainer.max_steps=2", "trainer.overwrite=true"], data_cache), tmp_path)
    assert not (tmp_path / "checkpoints" / "step_3.pt").exists()
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["step"] == 2


def test_fine_tuning_names_each_tokenizer_setting_the_checkpoints_tokenizer_overrides():
    from transformer.config import DataConfig
    from transformer.training.resume import tokenizer_settings_ignored

    saved = {"vocab_size": 8000, "joint_vocab": True, "inline_case": True}  # an older checkpoint: no newer keys
    same = DataConfig(inline_case=True, language_tag="decoder")  # the tag's place is the model's, not the tokenizer's
    assert tokenizer_settings_ignored(saved, same) == []
    wanted = DataConfig(vocab_size=123, inline_case=True, lowercase_source=True, usual_case=True)
    assert tokenizer_settings_ignored(saved, wanted) == [
        ("vocab_size", 8000, 123),
        ("lowercase_source", False, True),
        ("usual_case", False, True),
    ]


@pytest.mark.slow
def test_fine_tuning_starts_from_the_weights_with_a_fresh_optimizer(trained_run, tmp_path, data_cache, caplog):
    best = trained_run[0] / "checkpoints" / "best.pt"
    cfg = compose_config(
        FAST
        + [
            "model.d_model=96",
            "model.d_ff=256",
            "data.embedded_pairs=4000",
            "data.vocab_size=123",
            f"trainer.init_from={best}",
            "trainer.max_steps=3",
            "trainer.lr=1e-4",
            "trainer.warmup=10",
            "trainer.validate_every=3",
            "trainer.val_max_sentences=40",
            "trainer.test_at_end=false",
            "trainer.max_minutes=0",
        ],
        data_cache,
    )
    metrics = train(cfg, tmp_path)
    state, source = load_checkpoint(tmp_path / "checkpoints" / "last.pt"), load_checkpoint(best)
    assert state["step"] == 3  # a fresh step count
    assert state["tokenizer"] == source["tokenizer"]  # the checkpoint's tokenizer, reused
    assert "the model's tokenizer is kept; data.vocab_size=123 is ignored (the model's: 200)" in caplog.text
    assert state["scheduler"]["last_epoch"] == 3 and state["optimizer"]["state"][0]["step"] == 3
    assert metrics["val_history"][0]["bleu"] > 60  # it starts from the trained weights
    assert any(not torch.equal(state["model"][k], source["model"][k]) for k in source["model"])


@pytest.mark.slow
def test_a_training_step_reads_nothing_back_to_the_host(tmp_path, data_cache):
    from transformer.training.trainer import Trainer

    cfg = compose_config(FAST + ["trainer.update_freq=2", "trainer.precision=fp32"], data_cache)
    trainer = Trainer(cfg, tmp_path)
    try:
        trainer.batches.updates.start(0, 0)
        loader = iter(trainer.batches.loader)
        with HostReads() as reads:  # the detector sees a read when there is one
            float(torch.ones(()))
            torch.ones(3)[torch.ones(3) > 0]
            torch.ones(3).tolist()
        assert reads.seen == ["aten._local_scalar_dense", "aten.index", "Tensor.tolist"]
        for step in range(3):  # steps 1-3 are not log steps (log_every=10)
            micro, consumed = next(loader)
            with HostReads() as reads:
                stats = trainer.step(micro)
            assert reads.seen == [], f"step {step + 1} read tensor values on the host: {reads.seen}"
            with HostReads() as reads:
                trainer.step.log.add(stats, micro)
            assert reads.seen == []
        assert trainer.state.optimizer.state_dict()["state"][0]["step"] == 3  # the steps were real updates
        numbers = trainer.step.log.read()
        tokens = numbers["finite_tokens"]
        assert numbers["skipped"] == 0 and tokens == numbers["tokens"] > 0
        assert 0 < numbers["nll_sum"] / tokens < numbers["loss_sum"] / tokens < 10
    finally:
        trainer.leave_process_group(clean=True)
        trainer.monitor.close()


def test_progress_keeps_the_best_score_and_the_patience_count_and_resumes_them():
    from transformer.training.progress import Progress

    progress = Progress(step=100)
    assert progress.record_validation({"loss": 3.0, "bleu": 20.0})
    progress.step = 200
    assert not progress.record_validation({"loss": 2.9, "bleu": 19.5})
    progress.step, progress.epoch, progress.position = 300, 2, 17
    assert not progress.record_validation({"loss": 2.8, "bleu": 20.0})  # equal is no improvement
    assert (progress.best_bleu, progress.best_step, progress.bad_validations) == (20.0, 100, 2)
    state = {
        "step": progress.step,
        "metrics": progress.metrics(),
        "data_state": progress.data_state(world_size=1, batching={}),
    }
    assert state["metrics"]["val_bleu"] == 20.0 and len(state["metrics"]["val_history"]) == 3
    assert Progress.from_checkpoint(state) == progress


def test_the_train_log_sums_finite_steps_on_the_device_and_stops_on_a_run_of_bad_ones():
    from types import SimpleNamespace

    from transformer.errors import TrainingError
    from transformer.training.step_log import StepResult, TrainLog

    log = TrainLog(torch.device("cpu"), monitor=None, max_bad_steps=3)
    micro = [(SimpleNamespace(padding_share=0.1), 1)]

    def step(loss, tokens, correct=1.0):
        finite = torch.tensor(math.isfinite(loss))
        log.add(StepResult(torch.tensor([loss, loss / 2, correct]), torch.tensor(1.0), finite, tokens), micro)

    step(10.0, 5, correct=2.0)
    step(float("nan"), 7, correct=4.0)  # skipped: not in the loss or accuracy, counted in tokens/s
    step(6.0, 3, correct=3.0)
    numbers = log.read()
    assert numbers == {
        "loss_sum": 16.0,
        "nll_sum": 8.0,
        "correct": 5.0,
        "finite_tokens": 8.0,
        "bad_in_a_row": 0,
        "skipped": 1,
        "tokens": 15.0,
    }
    step(float("inf"), 1)
    step(float("nan"), 1)
    log.check_finite(fp16=False)  # two in a row: still below trainer.max_bad_steps=3
    log.write(step=5, epoch=0, lr=1e-3, loss_scale=1.0, fp16=False, bar=SimpleNamespace(set_postfix=lambda **_: None))
    step(float("nan"), 1)  # the run carries over into the next window
    with pytest.raises(TrainingError, match="not finite for 3 steps in a row"):
        log.check_finite(fp16=False)
    log.check_finite(fp16=True)  # fp16 allows ten times as many


@pytest.mark.parametrize("device_name", [None, "NVIDIA H200", "Tesla T4"])
def test_the_log_line_and_tensorboard_give_mfu_on_a_gpu_whose_peak_is_known(device_name, caplog):
    """On CUDA (a device whose .type is "cuda", no GPU needed: the name is given) the line and
    TensorBoard's train/mfu give the window's FLOPs / seconds / the H200's 989 TFLOP/s; on a CPU (None) or
    a GPU of unknown peak the line is as it always was."""
    import logging
    from types import SimpleNamespace

    from transformer.data.batching import Batch
    from transformer.flops import mfu_meter, train_flops
    from transformer.training.step_log import StepResult, TrainLog

    cfg = compose_config(["model=tiny"]).model
    device = SimpleNamespace(type="cuda") if device_name else torch.device("cpu")
    meter = mfu_meter(device, cfg, 100, device_name=device_name) if device_name else None
    seen = []
    monitor = SimpleNamespace(training=lambda step, epoch, values, device: seen.append(values))
    log = TrainLog(torch.device("cpu"), monitor, max_bad_steps=3, mfu=meter)
    src = torch.tensor([[5, 6, 7, 3], [5, 3, 0, 0]])  # (2, 4)
    tgt = torch.tensor([[2, 8, 9], [2, 8, 0]])
    batch = Batch(src, tgt, tgt, num_tgt_tokens=5, padding_share=0.25)
    for _ in range(3):
        log.add(StepResult(torch.tensor([10.0, 5.0, 2.0]), torch.tensor(1.5), torch.tensor(True), 5.0), [(batch, 1)])
    log.started -= 2.0  # the window took (at least) two seconds
    with caplog.at_level(logging.INFO, logger="transformer.train"):
        log.write(
            step=3, epoch=0, lr=1e-3, loss_scale=1.0, fp16=False, bar=SimpleNamespace(set_postfix=lambda **_: None)
        )
    line = caplog.records[-1].getMessage()
    prefix = "step 3 | epoch 0 | loss 2.000 | nll 1.000 | ppl 2.72 | accuracy 40.0% | lr 0.001 | gnorm 1.50 | tok/s "
    assert line.startswith(prefix)
    if device_name == "NVIDIA H200":
        expected = 3 * train_flops(cfg, batch, 100) / 2.0 / 989e12
        assert seen[0]["mfu"] == pytest.approx(expected, rel=0.05)
        mfu_shown = line.split("tok/s ")[1].split(" | ")[1]
        assert mfu_shown == f"mfu {100 * seen[0]['mfu']:.1f}%" and line.endswith(" | pad 25.0%")
    else:
        assert "mfu" not in seen[0] and "mfu" not in line
        assert line.removeprefix(prefix).split(" | ")[1:] == ["pad 25.0%"]


def test_resuming_into_fp16_starts_the_loss_scaler_afresh_from_a_bf16_or_fp32_checkpoint(caplog):
    from transformer.training.state import load_scaler_state

    written_in_bf16 = torch.amp.GradScaler("cpu", enabled=False).state_dict()
    assert written_in_bf16 == {}
    fp16 = torch.amp.GradScaler("cpu", enabled=True, init_scale=1024.0)
    with caplog.at_level("INFO", logger="transformer.train"):
        load_scaler_state(fp16, written_in_bf16)  # GradScaler itself raises on an empty state
    assert fp16.get_scale() == 1024.0 and "starts at 1024" in caplog.text

    written_in_fp16 = torch.amp.GradScaler("cpu", enabled=True, init_scale=8.0, growth_interval=7).state_dict()
    load_scaler_state(fp16, written_in_fp16)
    assert fp16.get_scale() == 8.0 and fp16.state_dict()["growth_interval"] == 7
    load_scaler_state(torch.amp.GradScaler("cpu", enabled=False), written_in_fp16)  # fp16 -> bf16: ignored


@pytest.mark.slow
def test_rdrop_without_dropout_makes_the_plain_update_and_with_dropout_a_different_one(tmp_path, data_cache, caplog):
    """R-Drop's two passes agree when nothing is dropped: the KL term is 0 and the doubled batch, divided
    by twice the tokens, gives the plain step's update. With dropout the passes differ and so does it."""
    from transformer.training.trainer import Trainer

    def one_step(run, *overrides):
        cfg = compose_config(FAST + ["trainer.precision=fp32", *overrides], data_cache)
        trainer = Trainer(cfg, tmp_path / run)
        try:
            trainer.batches.updates.start(0, 0)
            micro, _ = next(iter(trainer.batches.loader))
            gradients, optimizer_step = {}, trainer.state.optimizer.step

            def step_recording_the_gradients(*args, **kwargs):
                gradients.update({k: p.grad.clone() for k, p in trainer.model.named_parameters()})
                return optimizer_step(*args, **kwargs)

            trainer.state.optimizer.step = step_recording_the_gradients
            torch.manual_seed(3)
            stats = trainer.step(micro)
            return gradients, stats
        finally:
            trainer.leave_process_group(clean=True)
            trainer.monitor.close()

    plain, plain_stats = one_step("plain", "model.dropout=0")
    rdrop, rdrop_stats = one_step("rdrop", "model.dropout=0", "trainer.rdrop=5")
    assert "R-Drop adds nothing and doubles the compute" in caplog.text  # said once, at the start
    assert rdrop_stats.tokens == 2 * plain_stats.tokens
    assert torch.allclose(rdrop_stats.sums / 2, plain_stats.sums, rtol=1e-5)
    assert torch.allclose(rdrop_stats.grad_norm, plain_stats.grad_norm, rtol=1e-5)  # the gradient's scale
    # Every parameter's gradient, not the update: Adam's first step blows the rounding noise of the
    # exactly-zero gradient of the key biases up to a step of the learning rate's size.
    assert plain.keys() == rdrop.keys() and len(plain) > 10
    assert all(torch.allclose(rdrop[k], plain[k], rtol=1e-4, atol=1e-7) for k in plain)
    # With dropout and no label smoothing the summed loss minus the summed NLL is the KL term alone.
    _, dropped = one_step("dropped", "model.dropout=0.3", "trainer.label_smoothing=0")
    _, dropped_rdrop = one_step("dropped-rdrop", "model.dropout=0.3", "trainer.label_smoothing=0", "trainer.rdrop=5")
    assert dropped.sums[0] == pytest.approx(dropped.sums[1].item(), rel=1e-6)
    kl_per_token = (dropped_rdrop.sums[0] - dropped_rdrop.sums[1]) / dropped_rdrop.tokens
    assert kl_per_token > 0.05  # the two dropout passes disagree: the KL term counts
