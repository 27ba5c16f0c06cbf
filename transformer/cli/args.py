"""The flags several commands share (the model, the device, the decoding options) and the parser whose errors
are one line; no torch at import."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformer.config import (
    DECODE_OPTIONS,
    QUANTIZATIONS,
    DecodeOption,
    check_weights,
    device_name_error,
)
from transformer.errors import (
    import_torch_holding_interrupts,
)

if TYPE_CHECKING:  # imported where used: torch comes with them
    from transformer.inference.sampling import Sampling


def version_line() -> str:
    """What every command's --version prints: this package's installed version (that of the checkout's
    pyproject.toml, when it runs from a checkout that was never installed), with torch's and Python's;
    torch is not imported."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("transformer")
    except PackageNotFoundError:  # a checkout never installed: its pyproject.toml
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        found = (
            re.search(r'^version = "([^"]+)"', pyproject.read_text(encoding="utf-8"), re.M)
            if pyproject.is_file()
            else None
        )
        ours = found[1] if found else "unknown"
    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "not installed"
    return f"transformer {ours} (torch {torch}, Python {platform.python_version()})"


class _PrintVersion(argparse.Action):
    """--version: the line looked up when asked for (reading the installed packages' metadata takes a moment)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit(0)


class CommandLineParser(argparse.ArgumentParser):
    """argparse, its errors one line (`PROG: error: ...; see PROG --help`, exit code 2) without the usage;
    --version prints `version_line`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--version", action=_PrintVersion, nargs=0, help="print the version and exit")

    def error(self, message: str):
        flag = re.fullmatch(r"argument ([^/:]+)(?:/\S+)?: expected one argument", message)
        if flag:  # `--alpha -1`: argparse takes -1 for an option
            message += f" (give one; a value that starts with '-' is written {flag[1]}=VALUE)"
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def number(text: str) -> int | float:
    """A whole number as an int, any other number as a float: `check_decode_options` says what fits."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def flag_dest(option: DecodeOption) -> str:
    """The attribute of the parsed arguments that holds a decoding option's flag: --max-len-a -> max_len_a."""
    return option.flag.removeprefix("--").replace("-", "_")


def add_decoding_flags(parser: argparse.ArgumentParser, leave_out: tuple[str, ...] = ()) -> None:
    """The decoding options (config.DECODE_OPTIONS but `leave_out`) as flags, each with the type, meaning
    and default of its one definition; None when not given (`given_decoding_options`)."""
    group = parser.add_argument_group(
        "decoding options",
        "each is also a key of the config's decode section "
        "(decode.KEY) and a keyword of Translator.translate (KEY=...)",
    )
    for option in DECODE_OPTIONS:
        if option.key in leave_out:
            continue
        default = (
            f"the checkpoint's decode.{option.key}; {option.default} unless training set it"
            if option.saved
            else option.default
        )
        if option.key == "alpha":
            default = f"a multilingual model's decode.alpha_by_language for the target language, else {default}"
        group.add_argument(
            option.flag,
            type=number if option.whole else float,
            dest=flag_dest(option),
            help=f"{option.meaning}; default: {default}".replace("%", "%%"),
        )


def given_decoding_options(args: argparse.Namespace) -> dict[str, Any]:
    """The decoding options given on the command line, by config key: {"beam_size": 4}."""
    return {
        option.key: getattr(args, flag_dest(option))
        for option in DECODE_OPTIONS
        if getattr(args, flag_dest(option), None) is not None
    }


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model(s) and how they compute, as transformer-translate and transformer-evaluate take them."""
    parser.add_argument(
        "checkpoints",
        nargs="+",
        metavar="checkpoint",
        help="a .pt checkpoint written by training (best.pt, last.pt, ...), or a directory (or "
        "HuggingFace Hub id) written by transformer-export --format safetensors; several: an "
        "ensemble, the mean of their log-probabilities at every step (same vocabulary)",
    )
    parser.add_argument(
        "--weights", metavar="W,W,...", help="an ensemble's weights, one per checkpoint (default: equal)"
    )
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    parser.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        help="int8: the linear layers in int8 (CPU only; the rest in float32); fastest on CPUs without native bf16",
    )
    parser.add_argument(
        "--workers",
        type=int,
        help="batches decoded at a time on the CPU, one core each (like "
        "CTranslate2's inter_threads; default: as many as PyTorch uses threads, i.e. the cores; 1: "
        "every core on each batch)",
    )


def parse_weights(text: str | None, count: int) -> list[float] | None:
    """`--weights 0.6,0.4` -> [0.6, 0.4]; ValueError with the fix when it is not one number >= 0 per checkpoint."""
    if text is None:
        return None
    try:
        return check_weights([float(w) for w in text.split(",")], count)
    except ValueError:
        raise ValueError(
            f"--weights {text}: give {count} comma-separated numbers >= 0, one per checkpoint, "
            "not all 0 (e.g. --weights " + ",".join(["1"] * count) + ")"
        ) from None


def checked_model_arguments(args: argparse.Namespace) -> list[float] | None:
    """`add_model_arguments`' values checked (ValueError in the command line's words); the weights."""
    weights = parse_weights(args.weights, len(args.checkpoints))
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers {args.workers}: must be a whole number >= 1")
    return weights


def device_error(device: str) -> str | None:
    """Why `--device` cannot be used here (one line), or None. Imports torch (and tunes this process for
    it) when the name is one it could take."""
    if bad_name := device_name_error(device, "--device "):
        return bad_name
    import_torch_holding_interrupts()
    from transformer.runtime import inference_device_error, tune_cpu_process

    tune_cpu_process()  # before the first tensor operation (runtime.py says why)
    return inference_device_error(device, "--device ")


def parse_sampling(text: str, temperature: float, seed: int) -> Sampling:
    """`topk:K` or `topp:P` -> Sampling; ValueError with the fix otherwise."""
    kind, _, value = text.partition(":")
    top = {}  # checked here, before torch comes with transformer.inference.search
    if kind == "topk" and value.isdecimal() and int(value) >= 1:
        top = {"top_k": int(value)}
    elif kind == "topp":
        try:
            top = {"top_p": float(value)} if 0.0 < float(value) <= 1.0 else {}
        except ValueError:
            pass
    if not top:
        raise ValueError(f"--sampling {text}: write topk:K (a whole number >= 1) or topp:P (0 < P <= 1)")
    import_torch_holding_interrupts()
    from transformer.inference.sampling import Sampling

    return Sampling(**top, temperature=temperature, seed=seed)
