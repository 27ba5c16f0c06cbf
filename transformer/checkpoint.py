"""Checkpoints: one self-contained file, written atomically, loaded without executing code.

Keys (DESIGN §5): model, config, tokenizer, step, optimizer, scheduler, scaler, rng, data_state,
metrics. Everything is tensors, numbers, strings, bytes, lists and dicts, so
`torch.load(path, weights_only=True)` reads it and a crafted pickle cannot run code.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import zipfile
from pathlib import Path

import torch

from transformer.config import Config, ConfigError
from transformer.model import Transformer, build_model
from transformer.tokenizer import Tokenizer

REQUIRED_KEYS = ("model", "config", "tokenizer", "step")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, unsafe or does not fit; the message names the file."""


def save_checkpoint(state: dict, path: str | Path) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over `path`.

    A crash at any moment leaves either the old file or the new one, never a half-written file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory; give a file name for the checkpoint")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as error:
        # torch reports a full disk as "RuntimeError ... unexpected pos", the OSError only chained.
        cause = next((e for e in _chain(error) if isinstance(e, OSError) and e.errno), None)
        if cause is None and isinstance(error, RuntimeError):
            raise
        reason = os.strerror(cause.errno) if cause is not None else str(error)
        raise CheckpointError(f"{path}: cannot write the checkpoint: {reason}") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class CheckpointDirectory:
    """A run's checkpoints/: `last.pt`, `best.pt` and the `step_N.pt` files, of which the newest
    `keep_last` are kept (0 keeps all). Only the main rank writes."""

    def __init__(self, directory: Path, keep_last: int, is_main: bool):
        self.directory, self.keep_last, self.is_main = Path(directory), keep_last, is_main

    def save(self, state: dict, name: str) -> None:
        """Write `name`; a failure says which checkpoint is the last good one."""
        if not self.is_main:
            return
        try:
            save_checkpoint(state, self.directory / name)
        except CheckpointError as error:
            kept = sorted(self.directory.glob("*.pt"), key=lambda p: p.stat().st_mtime)
            raise CheckpointError(f"{error}; the last good checkpoint is "
                                  f"{kept[-1] if kept else 'none (nothing was saved yet)'}") from None

    def save_periodic(self, state: dict, step: int) -> None:
        """step_N.pt and last.pt, then the step files beyond `keep_last` removed."""
        self.save(state, f"step_{step}.pt")
        self.save(state, "last.pt")
        if self.is_main and self.keep_last:
            for old in step_checkpoints(self.directory.parent)[: -self.keep_last]:
                old.unlink()


def _chain(error: BaseException):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def load_checkpoint(path: str | Path, map_location="cpu", mmap: bool = False) -> dict:
    """Load with `weights_only=True`. `mmap=True` reads tensors lazily: translating a training
    checkpoint then never reads its optimizer state from disk."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory, not a checkpoint file (e.g. {path / 'checkpoints' / 'best.pt'})")
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    if mmap and not zipfile.is_zipfile(path):
        mmap = False        # only torch's zip format can be memory-mapped; let the plain load explain
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
        raise CheckpointError(f"{path}: not a readable checkpoint (truncated or not a torch file; "
                              f"{type(error).__name__}: {detail})") from None
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED_KEYS):
        raise CheckpointError(f"{path}: not a transformer checkpoint (expected keys {', '.join(REQUIRED_KEYS)})")
    return state


def model_from_checkpoint(state: dict, path: str | Path = "checkpoint") -> tuple[Transformer, Tokenizer, Config]:
    """Rebuild the model, tokenizer and config stored in a checkpoint."""
    try:
        config = Config.from_dict(state["config"])
    except ConfigError as error:
        raise CheckpointError(f"{path}: its stored config is invalid: {error}") from None
    tokenizer = Tokenizer.from_state_dict(state["tokenizer"])
    model = build_model(config.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint)
    load_model_weights(model, state["model"], path)
    return model, tokenizer, config


def load_model_weights(model: torch.nn.Module, weights: dict, path: str | Path = "checkpoint") -> None:
    """load_state_dict with a message that names the mismatching parameters instead of a wall of errors."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong_shape = [f"{k}: checkpoint {tuple(weights[k].shape)} vs model {tuple(v.shape)}"
                   for k, v in expected.items() if k in weights and weights[k].shape != v.shape]
    if missing or unexpected or wrong_shape:
        details = []
        if wrong_shape:
            details.append("shape mismatch in " + "; ".join(wrong_shape[:3]))
        if missing:
            details.append(f"missing {', '.join(missing[:3])}")
        if unexpected:
            details.append(f"unexpected {', '.join(unexpected[:3])}")
        raise CheckpointError(f"{path}: weights do not fit this model (different vocabulary or model "
                              f"shape?): {' | '.join(details)}")
    model.load_state_dict(weights)


def average_checkpoints(paths: list[str | Path]) -> dict:
    """Average the model weights of several checkpoints of one run; the rest is taken from the last."""
    if not paths:
        raise CheckpointError("no checkpoints to average")
    states = [load_checkpoint(p, mmap=True) for p in paths]     # memory-mapped: weights read as summed
    reference = states[-1]["model"]
    for path, state in zip(paths, states):
        if set(state["model"]) != set(reference) or any(state["model"][k].shape != v.shape
                                                        for k, v in reference.items()):
            raise CheckpointError(f"{path}: model differs in shape from {paths[-1]}; cannot average")
    averaged = {}
    for key, value in reference.items():
        if value.is_floating_point():
            total = sum(state["model"][key].double() for state in states)
            averaged[key] = (total / len(states)).to(value.dtype)
        else:
            averaged[key] = value
    result = {k: v for k, v in states[-1].items() if k not in ("optimizer", "scheduler", "scaler")}
    result["model"] = averaged
    result["metrics"] = {**states[-1].get("metrics", {}), "averaged_from": [str(p) for p in paths]}
    return result


def step_checkpoints(run_dir: str | Path) -> list[Path]:
    """`checkpoints/step_N.pt` files of a run, oldest first."""
    folder = Path(run_dir) / "checkpoints"
    found = [p for p in folder.glob("step_*.pt") if p.stem[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.stem[5:]))


def average_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="transformer-average",
        description="Average the weights of the last N step checkpoints of a run into one checkpoint.")
    parser.add_argument("inputs", nargs="+", help="a run directory, or checkpoint files to average")
    parser.add_argument("--last", type=int, default=5, help="with a run directory: how many step_N.pt to use")
    parser.add_argument("--output", "-o", required=True, help="where to write the averaged checkpoint")
    args = parser.parse_args(argv)
    try:
        if len(args.inputs) == 1 and Path(args.inputs[0]).is_dir():
            paths = step_checkpoints(args.inputs[0])[-args.last:]
            if not paths:
                raise CheckpointError(f"{args.inputs[0]}: no checkpoints/step_N.pt files to average")
        else:
            paths = [Path(p) for p in args.inputs]
        output = Path(args.output)
        if any(output.resolve() == p.resolve() for p in paths):
            raise CheckpointError(f"-o {output}: is one of the checkpoints being averaged; write the average "
                                  "to a new file")
        if output.is_dir():
            raise CheckpointError(f"-o {output}: is a directory; give a file name such as {output / 'avg.pt'}")
        state = average_checkpoints(paths)
        save_checkpoint(state, args.output)
    except CheckpointError as error:
        print(f"transformer-average: error: {error}", file=sys.stderr)
        return 2
    print(f"averaged {len(paths)} checkpoints ({', '.join(p.name for p in paths)}) -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(average_main())
