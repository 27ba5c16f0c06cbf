"""What a run starts from: resume (the newest resumable checkpoint, or a given one), fine-tune
(trainer.init_from) or a new model; what a resumed run keeps of the checkpoint's config; and the run
directories that must be refused before anything is written into them."""

from __future__ import annotations

import dataclasses
import logging
import shlex
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from transformer import distributed as D
from transformer.checkpoint import (
    CheckpointError,
    load_checkpoint,
)
from transformer.config import DecodeConfig, TrainerConfig, refuse_interpolations
from transformer.errors import NESTED_TOO_DEEPLY, ConfigError
from transformer.training.run_dir import RESUME_REPLACES, RunDirectoryLock, TrainingError, hydra_value, override_key

if TYPE_CHECKING:
    pass

log = logging.getLogger("transformer.train")

# On resume the checkpoint fixes these, whatever the command line says: the model is rebuilt as saved,
# the tokenizer is the saved one, the optimizer restores its own hyper-parameters (lr, betas, eps, weight
# decay) and the run started from what it started from. A different value given is ignored (one warning).
# The data keys among them that make the tokenizer (a fine-tuned run keeps its checkpoint's tokenizer too).
TOKENIZER_KEYS = (
    "vocab_size",
    "tokenizer_type",
    "joint_vocab",
    "inline_case",
    "lowercase_source",
    "character_coverage",
    "tokenizer_sample",
)
FIXED_BY_CHECKPOINT = {
    "model": (
        "name",
        "d_model",
        "n_heads",
        "d_ff",
        "encoder_layers",
        "decoder_layers",
        "residual_free_layer",
        "pre_norm",
        "tie_embeddings",
    ),
    "data": (*TOKENIZER_KEYS, "language_tag"),
    "trainer": ("lr", "betas", "adam_eps", "weight_decay", "weight_decay_norm_bias", "init_from"),
}


# Honoured on resume without changing the run itself: how long it goes on, how often it logs, validates
# and saves, where and how fast it runs, how it decodes. (trainer.max_steps also ends a cosine or linear
# decay: with those schedules a new value changes the learning rates.)
HONOURED_ON_RESUME = {
    "model": ("attention", "max_positions"),
    "data": ("name", "cache_dir", "test_split"),
    "trainer": (
        "device",
        "precision",
        "max_steps",
        "max_epochs",
        "max_minutes",
        "validate_every",
        "checkpoint_every",
        "val_beam_size",
        "val_max_sentences",
        "val_augment",
        "test_at_end",
        "keep_last",
        "full_checkpoints",
        "average_last",
        "patience",
        "max_bad_steps",
        "max_tokens_auto",  # a resumed run never searches: it keeps the checkpoint's trainer.max_tokens
        "compile",
        "resume",
        "overwrite",
        "log_every",
        "log_level",
        "loggers",
        "num_threads",
        "num_workers",
    ),
    "decode": tuple(spec.name for spec in dataclasses.fields(DecodeConfig)),  # every decoding key
}


@dataclasses.dataclass
class StartingPoint:
    """What a run starts from: a checkpoint to resume (`resume`), one whose weights and tokenizer to
    fine-tune (`init`: trainer.init_from), or neither (a new model); `path` names the checkpoint."""

    resume: dict | None = None
    init: dict | None = None
    path: Path | None = None

    def describe(self) -> str:
        """The start line of the run's banner."""
        if self.resume is not None:
            return f"resuming from {self.path} (step {self.resume['step']})"
        if self.init is not None:
            return (
                f"fine-tuning from the weights of {self.path} (step {self.init['step']}, trainer.init_from); "
                "optimizer, schedule and step start afresh"
            )
        return "a new run (fresh weights)"


def starting_point(cfg, ckpt_dir: Path, dist: D.DistInfo) -> StartingPoint:
    """What a run starts from: a checkpoint to resume, one whose weights and tokenizer to fine-tune
    (trainer.init_from), or nothing (a new model). On resume, `cfg` takes the checkpoint's values of the
    keys it fixes (`adopt_resumed_config`)."""
    tc = cfg.trainer
    resumed = _resume_checkpoint(tc, ckpt_dir, dist)
    if resumed:
        state, path = resumed
        adopt_resumed_config(cfg, state, path, warn=dist.is_main)
        return StartingPoint(resume=state, path=path)
    if not tc.init_from:
        return StartingPoint()
    init_state = load_checkpoint(tc.init_from, mmap=True)
    ignored = tokenizer_settings_ignored(init_state["config"]["data"], cfg.data)
    if ignored:
        log.warning(
            "trainer.init_from: the model's tokenizer is kept; %s ignored (the model's: %s)",
            ", ".join(f"data.{key}={hydra_value(given)}" for key, _, given in ignored)
            + (" is" if len(ignored) == 1 else " are"),
            ", ".join(hydra_value(saved) for _, saved, _ in ignored),
        )
    return StartingPoint(init=init_state, path=Path(tc.init_from))


def tokenizer_settings_ignored(saved: dict, data) -> list[tuple[str, object, object]]:
    """(key, the checkpoint's value, the run's) for each data key that makes a tokenizer (`TOKENIZER_KEYS`,
    and data.usual_case) where a run fine-tuning the checkpoint (trainer.init_from) asks for another value:
    the checkpoint's tokenizer is what it trains with. A key an older checkpoint lacks counts as its default."""
    defaults = type(data)()
    ignored = []
    for key in (*TOKENIZER_KEYS, "usual_case"):
        given, was = getattr(data, key), saved.get(key, getattr(defaults, key))
        if given != was:
            ignored.append((key, was, given))
    return ignored


def adopt_resumed_config(cfg, state: dict, path: Path, warn: bool = True) -> None:
    """Compare the config of a run resumed from `state` (read from `path`) with the checkpoint's: the
    keys the checkpoint fixes take its values (so that the config saved with the run is what it runs
    with), and one warning names them; one more names the keys that change the run from here on. A fixed key
    an older checkpoint lacks counts as its default (new keys keep the old behaviour by default); other
    keys it lacks pass."""
    saved, ignored, changed = state["config"], [], []
    try:
        refuse_interpolations(saved)
    except ConfigError as error:
        raise TrainingError(f"{path}: its stored config cannot be resumed: {error}") from None
    except RecursionError:
        raise TrainingError(
            f"{path}: its stored config is {NESTED_TOO_DEEPLY}; resume from another checkpoint"
        ) from None
    saved_trainer = saved.get("trainer", {})
    if cfg.trainer.max_tokens_auto and "max_tokens" in saved_trainer:
        # The budget trainer.max_tokens_auto chose (or the one the run had) goes on: no search on resume.
        cfg.trainer.max_tokens = saved_trainer["max_tokens"]
        if warn:
            log.info("trainer.max_tokens_auto: the resumed run keeps trainer.max_tokens=%d", cfg.trainer.max_tokens)
    restoring, restoring_named = [], []  # the overrides giving changed keys their old values; lists named
    for section in ("model", "data", "trainer", "decode"):
        values, old_values = getattr(cfg, section), saved.get(section, {})
        decays = section == "trainer" and values.schedule in ("cosine", "linear")
        for spec in dataclasses.fields(values):
            key, new = spec.name, getattr(values, spec.name)
            if isinstance(new, list) and any(dataclasses.is_dataclass(x) for x in new):
                new = [dataclasses.asdict(x) for x in new]  # the checkpoint holds plain dicts
            fixed = key in FIXED_BY_CHECKPOINT.get(section, ())
            if key in old_values:
                old = old_values[key]
            elif fixed and spec.default is not dataclasses.MISSING:
                old = spec.default  # written before the key existed: its default
            else:
                continue
            if old == new:
                continue
            if fixed:
                ignored.append(f"{section}.{key}={new} (keeps {old})")
                setattr(values, key, old)
            elif key not in HONOURED_ON_RESUME.get(section, ()) or (key == "max_steps" and decays):
                if isinstance(old, list | dict):  # data.corpora: named, not spelled out
                    changed.append(f"{section}.{key} (not the checkpoint's)")
                    restoring_named.append(f"{section}.{key}")
                else:
                    changed.append(f"{section}.{key} {old} -> {new}")
                    if key != "max_steps":  # a longer decay is what the new value is for
                        restoring.append(shlex.quote(f"{section}.{key}={hydra_value(old)}"))
    if ignored:
        cfg.validate()
    if not warn:
        return
    if ignored:
        log.warning(
            "trainer.resume: %s ignored: a resumed run keeps the model, tokenizer and optimizer settings of "
            "its checkpoint; to change them start a new run from its weights with trainer.init_from=%s",
            ", ".join(ignored),
            path,
        )
    if changed:
        restore = " ".join(restoring)
        if restoring_named:
            restore += (" and " if restore else "") + ", ".join(restoring_named) + " as in the checkpoint's config"
        log.warning(
            "trainer.resume: %s differ from the checkpoint: they apply from its step %s on, so the run "
            "does not continue as the interrupted one would have (not an exact resume); to continue it as "
            "it was, add %s",
            ", ".join(changed),
            state["step"],
            restore,
        )


def find_resume_state(tc: TrainerConfig, ckpt_dir: Path, dist: D.DistInfo) -> dict | None:
    """The state to resume from: `trainer.resume` as a path, or the newest checkpoint in `ckpt_dir` with
    `trainer.resume=true`; None for a new run. A directory holding checkpoints, of another run or none
    of them resumable, is refused unless `trainer.overwrite=true`, which clears it."""
    resumed = _resume_checkpoint(tc, ckpt_dir, dist)
    return resumed[0] if resumed else None


def _resume_checkpoint(tc: TrainerConfig, ckpt_dir: Path, dist: D.DistInfo) -> tuple[dict, Path] | None:
    """`find_resume_state`, with the path of the checkpoint."""
    existing = sorted(ckpt_dir.glob("*.pt")) if ckpt_dir.exists() else []
    if isinstance(tc.resume, str) and tc.resume not in ("", "true", "false"):
        path = Path(tc.resume)
        state = _resumable(load_checkpoint(path, verify="all"), path)
        if path.resolve().parent != ckpt_dir.resolve():  # continued in a directory of its own
            _clear_for_a_new_run(tc, existing, ckpt_dir, dist)
        return state, path
    if dist.is_main and ckpt_dir.exists():
        for stale in ckpt_dir.glob(".*.pt.tmp*"):  # left by a process killed mid-write
            stale.unlink(missing_ok=True)
    if tc.resume in (True, "true"):
        # best.pt may hold averaged weights (trainer.ema_decay, average_last), never newer than last.pt.
        newest_first, unusable = _resumable_newest_first([p for p in existing if p.name != "best.pt"])
        for error in unusable.values():
            if not isinstance(error, WeightsOnly):  # step_N.pt beside last.pt: weights only, by design
                log.warning("skipping %s", error)
        for newest in newest_first:
            try:
                state = load_checkpoint(newest, verify="all")
            except CheckpointError as error:  # damaged on disk: the step before it resumes the run
                unusable[newest] = error
                log.warning("skipping %s", error)
                continue
            if tc.overwrite:
                log.warning("trainer.overwrite=true is ignored: trainer.resume=true continues the run in %s", ckpt_dir)
            return state, newest
        if not existing:
            log.warning("trainer.resume=true but %s holds no checkpoint: starting a new run", ckpt_dir)
            return None
        if not tc.overwrite:
            raise nothing_to_resume_error(ckpt_dir, existing, unusable)
    _clear_for_a_new_run(tc, existing, ckpt_dir, dist)
    return None


def _resumable_newest_first(paths: list[Path]) -> tuple[list[Path], dict[Path, Exception]]:
    """Of `paths`, the checkpoints that can resume a run, highest step first, and why each of the others
    cannot. Their bytes are not checked yet: only the one resumed from is read in full."""
    steps, unusable = {}, {}
    for path in paths:
        try:  # memory-mapped: reading the step does not read the tensors of every file
            steps[path] = _resumable(load_checkpoint(path, mmap=True, verify="none"), path)["step"]
        except (CheckpointError, TrainingError) as error:
            unusable[path] = error
    return sorted(steps, key=steps.get, reverse=True), unusable


def nothing_to_resume_error(ckpt_dir: Path, existing: list[Path], unusable: dict[Path, Exception]) -> TrainingError:
    """trainer.resume=true in a directory whose checkpoints cannot resume the run (last.pt missing or
    damaged): starting a new run there would overwrite them, best.pt included."""

    def readable(path: Path) -> bool:
        if path in unusable:
            return isinstance(unusable[path], WeightsOnly)  # weights only: readable, not resumable
        try:
            load_checkpoint(path, mmap=True)
            return True
        except CheckpointError:
            return False

    weights = sorted((p for p in existing if readable(p)), key=lambda p: p.name != "best.pt")
    found = [] if ckpt_dir / "last.pt" in existing else ["last.pt is missing"]
    found += [f"{p.name} is damaged" for p in existing if p not in weights]
    found += [f"{p.name} holds no training state" for p, error in unusable.items() if isinstance(error, WeightsOnly)]
    where = f"{ckpt_dir}: trainer.resume=true finds no checkpoint to resume from ({', '.join(found)}"
    if not weights:
        return TrainingError(
            f"{where}; nothing in it is readable); pass trainer.overwrite=true to delete these "
            "checkpoints and start a new run here, or choose another hydra.run.dir"
        )
    return TrainingError(
        f"{where}; only {', '.join(p.name for p in weights)} {'is' if len(weights) == 1 else 'are'} readable); "
        f"to fine-tune from its weights start a new run in another hydra.run.dir with "
        f"trainer.init_from={weights[0]}, or pass trainer.overwrite=true to delete these checkpoints and start "
        "a new run here"
    )


def _clear_for_a_new_run(tc: TrainerConfig, existing: list[Path], ckpt_dir: Path, dist: D.DistInfo) -> None:
    """A new run writes into `ckpt_dir`: checkpoints of another run there are refused unless
    trainer.overwrite=true, which deletes them."""
    if not existing:
        return
    if not tc.overwrite:
        raise foreign_run_error(ckpt_dir)
    D.barrier(dist)
    if dist.is_main:
        shutil.rmtree(ckpt_dir)


def foreign_run_error(ckpt_dir: Path) -> TrainingError:
    return TrainingError(
        f"{ckpt_dir} already holds checkpoints of another run; pass trainer.resume=true to "
        "continue it, trainer.overwrite=true to replace it, or choose another hydra.run.dir"
    )


def check_run_directory(run_dir: Path, overrides: list[str]) -> None:
    """Before Hydra writes `.hydra/` and `train.log` into an explicitly named run directory: take its
    lock and refuse what `find_resume_state` would refuse there (checkpoints of another run, or none
    that trainer.resume=true can resume), so that a refused run leaves the directory as it was."""
    RunDirectoryLock.acquire(run_dir)
    given = dict(o.lstrip("+").split("=", 1) for o in overrides if "=" in o)
    ckpt_dir = run_dir / "checkpoints"
    existing = sorted(ckpt_dir.glob("*.pt"))
    if not existing or _switched_on(given.get("trainer.overwrite", "false")):
        return
    resume = given.get("trainer.resume", "false")
    if resume.lower() == "true":
        newest_first, unusable = _resumable_newest_first([p for p in existing if p.name != "best.pt"])
        if not newest_first:
            raise nothing_to_resume_error(ckpt_dir, existing, unusable)
    elif not _switched_on(resume) or ("${" not in resume and Path(resume).resolve().parent != ckpt_dir.resolve()):
        raise foreign_run_error(ckpt_dir)
    elif "${" not in resume:  # this run's best.pt or step_N.pt: refused before Hydra rewrites .hydra/
        try:
            _resumable(load_checkpoint(resume, mmap=True, verify="none"), resume)
        except CheckpointError:
            pass  # damaged or missing: the run says so, reading it in full
    # resuming this run, from whichever checkpoint
    left_out = _config_flags_left_out(run_dir, overrides) + _left_out_of_resume(run_dir, overrides)
    if left_out:
        raise TrainingError(
            f"trainer.resume: {run_dir} was started with {' '.join(left_out)}, which this command leaves out (each "
            "would take its default: another corpus, model or setting); repeat them (new values are allowed), as "
            "in the command its log's last line prints"
        )


def _left_out_of_resume(run_dir: Path, overrides: list[str]) -> list[str]:
    """The overrides the run in `run_dir` was last launched with (Hydra's `.hydra/overrides.yaml`, not yet
    rewritten by this launch: train.main keeps ranks other than 0 from writing it) whose keys `overrides`
    does not name, except those a resume may drop: where the run goes and how long, how it decodes
    (`HONOURED_ON_RESUME`), what the checkpoint fixes anyway (`FIXED_BY_CHECKPOINT`), Hydra's own keys."""
    from omegaconf import OmegaConf

    record = run_dir / ".hydra" / "overrides.yaml"
    try:  # unresolved: an ${oc.env:...} in the record must not need its variable now
        previous = OmegaConf.to_container(OmegaConf.load(record), resolve=False) if record.is_file() else []
    except Exception:  # a damaged record must not stop a resume: nothing to compare with
        return []
    if not isinstance(previous, list):
        return []  # no record (hydra.output_subdir=null, a library run): nothing to compare
    droppable = {
        f"{section}.{key}"
        for table in (HONOURED_ON_RESUME, FIXED_BY_CHECKPOINT)
        for section, keys in table.items()
        for key in keys
    } | {"decode", *RESUME_REPLACES}
    named = {override_key(o) for o in overrides}
    return [
        o
        for o in previous
        if isinstance(o, str)
        and override_key(o) not in named | droppable
        and not override_key(o).startswith(("hydra.", "hydra/"))
    ]


def _config_flags_left_out(run_dir: Path, argv: list[str]) -> list[str]:
    """Hydra's `--config-name NAME` and `--config-dir DIR` of the run's launch (its `.hydra/hydra.yaml`)
    that `argv` leaves out: without them the command composes `conf/config.yaml` around the checkpoint,
    as a left-out `data=` would. A command naming another config or directory is taken at its word."""
    from omegaconf import OmegaConf

    record = run_dir / ".hydra" / "hydra.yaml"
    try:  # unresolved, as the overrides are; a damaged or missing record skips the check
        hydra = OmegaConf.to_container(OmegaConf.load(record), resolve=False)["hydra"] if record.is_file() else {}
        name = hydra.get("job", {}).get("config_name")
        sources = hydra.get("runtime", {}).get("config_sources") or []
        dirs = [s["path"] for s in sources if isinstance(s, dict) and s.get("provider") == "command-line"]
    except Exception:
        return []
    given = {arg.split("=", 1)[0] for arg in argv}
    left_out = []
    if isinstance(name, str) and name != "config" and not given & {"--config-name", "-cn"}:
        left_out.append(shlex.join(["--config-name", name]))
    if not given & {"--config-dir", "-cd"}:
        left_out += [shlex.join(["--config-dir", str(path)]) for path in dirs]
    return left_out


def _switched_on(value: str) -> bool:
    return value.lower() not in ("false", "", "null")


class WeightsOnly(TrainingError):
    """A readable checkpoint that holds no training state to resume from (a run's best.pt or step_N.pt, an
    average): expected beside last.pt, so a resume passes over it without a warning."""


def _resumable(state: dict, path) -> dict:
    """`state` (read from `path`) if it can resume a run; else WeightsOnly saying what it is and what to
    resume from or start with instead."""
    path = Path(path)
    last = path.with_name("last.pt")
    instead = f"resume from {last}" if last.is_file() and path.name != "last.pt" else "resume from last.pt of its run"
    fine_tune = f"start a new run from these weights with trainer.init_from={path}"
    if state.get("weights", "raw") != "raw":
        raise WeightsOnly(
            f"{path}: holds the {state['weights']} weights (best.pt of a run with trainer.ema_decay or "
            f"average_last), not the training state; {instead}, or {fine_tune}"
        )
    if all(key in state for key in ("optimizer", "scheduler", "scaler", "rng", "data_state")):
        return state
    metrics = state.get("metrics")
    if isinstance(metrics, dict) and "averaged_from" in metrics:
        what = "an average of checkpoints"
    elif "weights" in state:  # written by a run
        what = "best.pt and step_N.pt of a run are, unless trainer.full_checkpoints=true"
    else:
        what = "an exported checkpoint"
    raise WeightsOnly(
        f"{path}: holds weights only ({what}), not the training state, so it cannot resume a run; {instead}, "
        f"or {fine_tune}"
    )
