"""Checkpoints: one self-contained file, written atomically, loaded without executing code.

Keys (DESIGN §5): model, config, tokenizer, step, optimizer, scheduler, scaler, rng, data_state,
metrics, and format_version (written by `save_checkpoint`; a file without it predates it). A weights-only
checkpoint (a run's best.pt and step_N.pt unless trainer.full_checkpoints=true, an average) leaves out the
training state (`TRAINING_STATE_KEYS`): it translates, evaluates, exports, averages and starts a new run
(trainer.init_from), but does not resume one. Everything is tensors, numbers, strings, bytes, lists and dicts, so
`torch.load(path, weights_only=True)` reads it and a crafted pickle cannot run code.
"""

from __future__ import annotations

import logging
import os
import pickle
import zipfile
import zlib
from pathlib import Path

import torch

from transformer.config import Config, ConfigError, ModelConfig
from transformer.data.tokenizer import Tokenizer
from transformer.errors import (  # their home; imported from here too
    NESTED_TOO_DEEPLY,
    SYMLINK_LOOP,
    CheckpointError,
    os_error_in,
    symlink_loop,
)
from transformer.install import upgrade_hint
from transformer.model import Transformer, build_model

log = logging.getLogger(__name__)


REQUIRED_KEYS = ("model", "config", "tokenizer", "step")
# What only resuming reads: the optimizer's moments (twice the weights), the schedule, the fp16 loss scaler,
# every rank's random streams, the position in the data and the moving average of the weights (as large as
# they). A weights-only checkpoint holds none of them.
TRAINING_STATE_KEYS = ("optimizer", "scheduler", "scaler", "rng", "data_state", "ema")


# Raised when a change to the keys or their meaning would mislead an older release reading the file: that
# release then refuses the file (load_checkpoint) instead of misreading it.
CHECKPOINT_FORMAT_VERSION = 1


def save_checkpoint(state: dict, path: str | Path) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over `path`.

    A crash at any moment leaves either the old file or the new one, never a half-written file.
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory; give a file name for the checkpoint")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise CheckpointError(
            f"{path}: cannot write the checkpoint: a part of {path.parent} is a file, not a directory"
        ) from None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot write the checkpoint: {error.strerror}") from None
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            torch.save({**state, "format_version": CHECKPOINT_FORMAT_VERSION}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as error:
        # torch reports a full disk as "RuntimeError ... unexpected pos", the OSError only chained.
        cause = os_error_in(error)
        if cause is None and isinstance(error, RuntimeError):
            raise
        reason = os.strerror(cause.errno) if cause is not None else str(error)
        raise CheckpointError(f"{path}: cannot write the checkpoint: {reason}") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_directory(path.parent)


def without_training_state(state: dict) -> dict:
    """`state` without its training state (`TRAINING_STATE_KEYS`): the weights with what rebuilds and
    describes them (config, tokenizer, step, metrics, which weights they are)."""
    return {key: value for key, value in state.items() if key not in TRAINING_STATE_KEYS}


def fsync_directory(path: Path) -> None:
    """Make a rename in `path` survive a power cut."""
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def load_checkpoint(path: str | Path, map_location="cpu", mmap: bool = False, verify: str = "model") -> dict:
    """Load with `weights_only=True`. `mmap=True` reads tensors lazily: translating a training
    checkpoint then never reads its optimizer state from disk.

    `verify` checks the bytes against the CRC-32 checksums torch.save wrote into the file (torch.load
    itself never does, so a flipped byte would load as a slightly wrong weight): "model" the model's
    weights (what translating reads), "all" every record (resuming reads the optimizer state too),
    "none" nothing (reading a step number)."""
    path = Path(path)
    if path.is_dir():
        found = next(
            (
                c
                for c in (
                    path / "best.pt",
                    path / "checkpoints" / "best.pt",
                    path / "last.pt",
                    path / "checkpoints" / "last.pt",
                )
                if c.is_file()
            ),
            None,
        )
        raise CheckpointError(
            f"{path}: is a directory, not a checkpoint file; "
            + (f"did you mean {found}?" if found else "a checkpoint is a run's checkpoints/*.pt file")
        )
    if not path.is_file():
        if symlink_loop(path):
            raise CheckpointError(f"{path}: is {SYMLINK_LOOP}, not a checkpoint file")
        raise CheckpointError(f"{path}: no such checkpoint file")
    is_zip = zipfile.is_zipfile(path)
    if mmap and not is_zip:
        mmap = False  # only torch's zip format can be memory-mapped; let the plain load explain
    if not is_zip:
        with open(path, "rb") as handle:
            head = handle.read(2)
        if head[:1] != b"\x80" and head != b"PK":  # neither torch's zip format (a truncated one is no zip
            #                                         any more: torch says so below) nor its legacy pickle
            kind = "an empty file" if not head else "text or another format"
            raise CheckpointError(
                f"{path}: not a checkpoint ({kind}, not a file torch.save wrote); a checkpoint "
                "is a run's checkpoints/*.pt"
            )
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else "unsafe content"
        raise CheckpointError(
            f"{path}: refused to load: the file holds objects other than tensors and plain data "
            f"({first[:200]}). Only load checkpoints you trust; nothing in it was executed."
        ) from None
    except Exception as error:  # torch raises many types for damaged files (RuntimeError, KeyError, EOFError...)
        detail = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        raise CheckpointError(
            f"{path}: not a readable checkpoint (truncated or not a torch file; {type(error).__name__}: {detail})"
        ) from None
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED_KEYS):
        raise CheckpointError(f"{path}: not a transformer checkpoint (expected keys {', '.join(REQUIRED_KEYS)})")
    version = state.get("format_version", 0)  # files from before the key: version 0, read as they are
    if type(version) is not int:
        raise CheckpointError(f"{path}: format_version {version!r} is not a whole number; the file is damaged")
    if version > CHECKPOINT_FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: written by a newer version of this package (checkpoint format {version}; "
            f"this one reads up to {CHECKPOINT_FORMAT_VERSION}); upgrade this package: {upgrade_hint()}"
        )
    if is_zip and verify != "none":
        damaged = _damaged_record(path) if verify == "all" else _damaged_weight(path, state["model"])
        if damaged:
            raise CheckpointError(
                f"{path}: damaged on disk: the bytes of {damaged} no longer match the checksum "
                "written with them (a disk, copy or transfer error); copy the file again or use "
                "another checkpoint of the run (checkpoints/step_*.pt)"
            )
    return state


def _damaged_record(path: Path) -> str | None:
    """What holds the first record of the checkpoint's zip file whose CRC-32 does not match its bytes."""
    with zipfile.ZipFile(path) as archive:
        bad = archive.testzip()
    if bad is None:
        return None
    return "its settings and structure (data.pkl)" if bad.endswith("data.pkl") else f"a tensor (record {bad})"


def _damaged_weight(path: Path, weights) -> str | None:
    """The first model weight whose bytes match no CRC-32 of the file, as "weight NAME"; None if all match.

    torch.save writes each tensor storage as one record of its zip file, with the record's CRC-32: a
    storage whose (size, CRC-32) pair is not among the records' was changed after the save. Reads only
    the weights' bytes (the optimizer state of a memory-mapped training checkpoint stays on disk)."""
    if not isinstance(weights, dict):
        return None  # model_from_checkpoint says what is wrong with it
    with zipfile.ZipFile(path) as archive:
        records = {
            (info.file_size, info.CRC) for info in archive.infolist() if Path(info.filename).parent.name == "data"
        }
    if not any(crc for _, crc in records):
        return None  # written without checksums (torch.serialization.set_crc32_options(False))
    checked = set()
    for name, tensor in weights.items():
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in checked:
            continue  # tied weights share one storage
        checked.add(storage.data_ptr())
        as_bytes = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()  # (nbytes,), no copy
        if (storage.nbytes(), zlib.crc32(as_bytes)) not in records:
            return f"weight {name}"
    return None


def model_from_checkpoint(state: dict, path: str | Path = "checkpoint") -> tuple[Transformer, Tokenizer, Config]:
    """Rebuild the model, tokenizer and config stored in a checkpoint; CheckpointError names the file and
    what is wrong (an invalid config, a damaged tokenizer, weights that do not fit or are not finite)."""
    try:
        config = Config.from_dict(state["config"], saved=True)
    except ConfigError as error:
        raise CheckpointError(f"{path}: its stored config is invalid: {error}") from None
    except (AttributeError, TypeError):
        raise CheckpointError(f"{path}: its stored config is not a mapping of settings; the file is damaged") from None
    except RecursionError:
        raise CheckpointError(f"{path}: its stored config is {NESTED_TOO_DEEPLY}; use another checkpoint") from None
    tokenizer = _embedded_tokenizer(state["tokenizer"], path)
    weights = state["model"]
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise CheckpointError(f"{path}: its model entry is not a set of named tensors; the file is damaged")
    bad = non_finite_tensors(weights)
    if bad:
        raise CheckpointError(
            f"{path}: weight {bad[0]} holds NaN or infinite values (the run diverged before it "
            "was saved); use an earlier checkpoint of the run"
        )
    check_config_matches_weights(config.model, tensor_shapes(weights), tokenizer, path)
    model = build_model(
        config.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint, initialize=False
    )
    load_model_weights(model, weights, path)
    return model, tokenizer, config


def tensor_shapes(weights) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors of a state dict (anything else in it left out)."""
    if not isinstance(weights, dict):
        return {}
    return {name: tuple(t.shape) for name, t in weights.items() if isinstance(t, torch.Tensor)}


def check_config_matches_weights(cfg: ModelConfig, shapes: dict, tokenizer: Tokenizer, path: str | Path) -> None:
    """Before a model is built from a stored config: the sizes it gives (model.d_model, d_ff, the layer
    counts) are those of the stored weights (`shapes`: name -> shape) and the tokenizer's vocabularies
    those of the embeddings, so that building the model allocates what the weights hold and no more.
    The one size no weight records, the position table's (model.max_positions), is bounded by the schema
    (config.MAX_POSITIONS), which every stored config passes first. CheckpointError names the file and the key."""
    damaged = "the file is damaged or was edited"
    # A safetensors file stores a tied matrix once, under one of its names (which the others' aliases in
    # its metadata say, when it was written by save_model): the model ties the output layer to the target
    # embedding (model.tie_embeddings), and to the source embedding with a joint vocabulary too.
    tied = ["tgt_embed.weight", "output.weight"] + (["src_embed.weight"] if tokenizer.joint else [])
    stored = [shapes[name] for name in tied if name in shapes] if cfg.tie_embeddings else []
    if stored:
        shapes = {**dict.fromkeys(tied, stored[0]), **shapes}
    # (name, dimension, config key or vocabulary, size expected): the sizes a built model's weights take
    embed, up = "embed.weight", "layers.0.feed_forward.up.weight"
    sizes = (
        ("tgt_" + embed, 1, "model.d_model", cfg.d_model),  # (V_tgt, D)
        ("src_" + embed, 1, "model.d_model", cfg.d_model),  # (V_src, D)
        ("encoder_" + up, 0, "model.d_ff", cfg.d_ff),  # (d_ff, D)
        ("decoder_" + up, 0, "model.d_ff", cfg.d_ff),
        ("tgt_" + embed, 0, "target", tokenizer.tgt_vocab_size),
        ("src_" + embed, 0, "source", tokenizer.src_vocab_size),
    )
    for name, dim, key, expected in sizes:
        shape = shapes.get(name)
        if shape is None or len(shape) != 2:
            raise CheckpointError(f"{path}: its weights hold no {name} matrix; the file is damaged")
        if shape[dim] == expected:
            continue
        if key.startswith("model."):
            raise CheckpointError(
                f"{path}: its config says {key}={expected} but its weights are {shape[dim]} wide "
                f"({name} is {tuple(shape)}); {damaged}"
            )
        raise CheckpointError(
            f"{path}: its tokenizer has {expected} {key} pieces but its weights embed {shape[0]} "
            f"({name} is {tuple(shape)}); {damaged}"
        )
    for stack in ("encoder", "decoder"):
        prefix = f"{stack}_layers."
        stored = {name[len(prefix) :].partition(".")[0] for name in shapes if name.startswith(prefix)}
        if len(stored) != getattr(cfg, f"{stack}_layers"):
            raise CheckpointError(
                f"{path}: its config says model.{stack}_layers={getattr(cfg, f'{stack}_layers')} but its weights "
                f"hold {len(stored)} {stack} layers; {damaged}"
            )


def _embedded_tokenizer(entry, path: str | Path) -> Tokenizer:
    """The SentencePiece model(s) a checkpoint carries, or CheckpointError: absent, empty or not a model."""
    damaged = f"{path}: its embedded tokenizer is"
    fix = "the file is damaged; use another checkpoint of the run"
    if (
        not isinstance(entry, dict)
        or not isinstance(entry.get("src"), (bytes, bytearray))
        or not isinstance(entry.get("tgt"), (bytes, bytearray, type(None)))
    ):
        raise CheckpointError(f"{damaged} missing (no SentencePiece model bytes under 'tokenizer'); {fix}")
    if not entry["src"] or entry.get("tgt") == b"":
        # An empty model is never loaded by SentencePiece, which would later print errors of its own.
        raise CheckpointError(f"{damaged} empty (0 bytes); {fix}")
    try:
        return Tokenizer.from_state_dict(entry)
    except RuntimeError as error:
        detail = str(error).strip().splitlines()[0][:120] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{damaged} not a SentencePiece model ({detail}); {fix}") from None


def non_finite_tensors(tensors: dict) -> list[str]:
    """The names of the floating-point tensors in `tensors` (a state dict) holding a NaN or an infinity,
    in order; empty when all are finite. One read on the host, whatever the device."""
    floating = [
        (name, t) for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
    ]
    if not floating:
        return []
    finite = torch.stack([torch.isfinite(t).all() for _, t in floating])
    if bool(finite.all()):
        return []
    return [name for (name, _), ok in zip(floating, finite.tolist()) if not ok]


def load_model_weights(model: torch.nn.Module, weights: dict, path: str | Path = "checkpoint") -> None:
    """load_state_dict with a message that names the mismatching parameters instead of a wall of errors."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong_shape = [
        f"{k}: checkpoint {tuple(weights[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in weights and weights[k].shape != v.shape
    ]
    if missing or unexpected or wrong_shape:
        details = []
        if wrong_shape:
            details.append("shape mismatch in " + "; ".join(wrong_shape[:3]))
        if missing:
            details.append(f"missing {', '.join(missing[:3])}")
        if unexpected:
            details.append(f"unexpected {', '.join(unexpected[:3])}")
        raise CheckpointError(
            f"{path}: weights do not fit this model (different vocabulary or model shape?): {' | '.join(details)}"
        )
    model.load_state_dict(weights)


def average_checkpoints(paths: list[str | Path]) -> dict:
    """Average the model weights of several checkpoints of one run (weights-only or full ones); the config,
    tokenizer, step and metrics are taken from the last. The result is weights-only: the training state of
    the last would not fit the averaged weights."""
    if not paths:
        raise CheckpointError("no checkpoints to average")
    states = [load_checkpoint(p, mmap=True) for p in paths]  # memory-mapped: weights read as summed
    reference = states[-1]["model"]
    for path, state in zip(paths, states):
        if set(state["model"]) != set(reference) or any(
            state["model"][k].shape != v.shape for k, v in reference.items()
        ):
            raise CheckpointError(f"{path}: model differs in shape from {paths[-1]}; cannot average")
        if state["tokenizer"] != states[-1]["tokenizer"]:  # same shapes, other pieces: the average is noise
            raise CheckpointError(
                f"{path}: its SentencePiece vocabulary differs from that of {paths[-1]}; "
                "average checkpoints of one run (or of runs that share a tokenizer)"
            )
    averaged = {}
    for key, value in reference.items():
        if value.is_floating_point():
            total = sum(state["model"][key].double() for state in states)
            averaged[key] = (total / len(states)).to(value.dtype)
        else:
            averaged[key] = value
    result = without_training_state(states[-1])
    result["model"] = averaged
    result["metrics"] = {**states[-1].get("metrics", {}), "averaged_from": [str(p) for p in paths]}
    return result


def step_checkpoints(run_dir: str | Path) -> list[Path]:
    """`checkpoints/step_N.pt` files of a run, oldest first."""
    folder = Path(run_dir) / "checkpoints"
    found = [p for p in folder.glob("step_*.pt") if p.stem[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.stem[5:]))


def holds_training_state(path: Path) -> bool:
    """Whether `path` is a checkpoint with an optimizer state: one a run can resume from."""
    try:
        return "optimizer" in load_checkpoint(path, mmap=True, verify="none")
    except CheckpointError:
        return False


def written_by_average(path: Path) -> bool:
    """Whether `path` is a checkpoint that transformer-average wrote (weights without an optimizer, and
    the `averaged_from` that `average_checkpoints` records; a run's best.pt records its own metrics)."""
    try:
        state = load_checkpoint(path, mmap=True)
    except CheckpointError:
        return False
    metrics = state.get("metrics")
    return "optimizer" not in state and isinstance(metrics, dict) and "averaged_from" in metrics
