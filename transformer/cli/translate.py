"""The `transformer-translate` command line (the Python API, `Translator`, is translator.py).

    transformer-translate CKPT [--input F] [--output F] [--beam N] [--nbest N] [--alpha A] ...

Reads raw text, one sentence per line, and writes exactly one line per input line: the detokenized
translation, or with `--nbest N > 1`, N lines per input of the form `INDEX<TAB>SCORE<TAB>TEXT`.
Needs nothing but the checkpoint file. Answers --help and refuses bad arguments before it loads torch
(about 2.5 s of every start): the modules that need it are imported where the model is loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from transformer.cli.args import (
    CommandLineParser,
    add_decoding_flags,
    add_model_arguments,
    checked_model_arguments,
    device_error,
    given_decoding_options,
    parse_sampling,
)
from transformer.cli.run import run_command
from transformer.cli.streams import (
    arrives_as_a_stream,
    close_output,
    fileno,
    format_results,
    read_input,
    send,
    stream_chunks,
    warn_invalid,
    write_output,
)
from transformer.config import (
    check_decode_options,
)
from transformer.data.lines import not_regular
from transformer.errors import (
    UsageError,
    import_torch_holding_interrupts,
    overwritten_input,
    write_problem,
)
from transformer.inference.request import DecodeRequest

if TYPE_CHECKING:  # imported where used: torch comes with them
    from transformer.inference.sampling import Sampling
    from transformer.inference.translator import Translator


def build_parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(
        prog="transformer-translate",
        description="Translate text with a trained checkpoint: one output line per input line (with --nbest N > 1, "
        "N lines INDEX<TAB>SCORE<TAB>TEXT per input line).",
    )
    add_model_arguments(parser)
    parser.add_argument("--input", "-i", help="source text file (default: stdin)")
    parser.add_argument("--output", "-o", help="where to write translations (default: stdout)")
    parser.add_argument(
        "--tgt-lang",
        metavar="LANG",
        help="the target language of a multilingual model (its "
        "<2LANG> tag starts every source sentence; a bilingual model needs none)",
    )
    parser.add_argument(
        "--prefix",
        metavar="FILE",
        help="target-language prefixes, one per input line (an empty "
        "line: none): each translation starts with its prefix and the search continues from there",
    )
    add_decoding_flags(parser)  # --beam, --nbest, --alpha, ...
    parser.add_argument(
        "--sampling",
        metavar="topk:K|topp:P",
        help="draw each token at random (back-translation) from the K most probable, or from "
        "the smallest set with probability P, instead of searching",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        help="with --sampling: divides the log-probabilities (default 1; lower is closer to greedy)",
    )
    parser.add_argument("--seed", type=int, help="with --sampling: the same seed, the same samples (default 1)")
    parser.add_argument(
        "--score-reference",
        metavar="REF",
        help="write the log-probability of each line of REF (one translation per input line) "
        "given its source, instead of translating (forced decoding)",
    )
    return parser


def load_translator(args: argparse.Namespace) -> Translator:
    """The model(s) the command line names (`add_model_arguments`): one, or an ensemble."""
    import_torch_holding_interrupts()
    from transformer.inference.translator import Translator

    weights = checked_model_arguments(args)
    try:
        return Translator.from_checkpoints(
            args.checkpoints, weights, device=args.device, precision=args.precision, quantize=args.quantize
        )
    except ValueError as error:  # the API's words for --quantize and --precision
        raise ValueError(str(error).replace("quantize=", "--quantize ").replace("precision=", "--precision ")) from None


# The decoding options: all of them unused with --score-reference (parser defaults None: given or not).
DECODING_OPTIONS = ("beam", "nbest", "alpha", "max_len_a", "max_len_b", "sampling", "temperature", "seed")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Ctrl-C; while streaming, what was translated has been written
    return run_command("transformer-translate", lambda: _translate(args))


def _translate(args) -> int:
    """Check everything the command line says before the model loads, load it, then translate."""
    sampling, given = _check(args)
    translator = _load(args, sampling, given)
    return _run(args, translator, sampling)


def _check(args) -> tuple[Sampling | None, set[str]]:
    """Refuse (UsageError) what cannot run, before torch and the model load: the decoding options, the
    files named, the streams. Returns --sampling parsed and the decoding flags given."""
    scoring = args.score_reference is not None
    given = {name for name in DECODING_OPTIONS if getattr(args, name) is not None}
    args.nbest = 1 if args.nbest is None else args.nbest
    args.temperature = 1.0 if args.temperature is None else args.temperature
    args.seed = 1 if args.seed is None else args.seed
    try:
        check_decode_options(given_decoding_options(args), "cli")
    except ValueError as error:
        raise UsageError(str(error)) from None
    sampled = args.sampling is not None  # beyond these, the scaled scores overflow or vanish
    if not math.isfinite(args.temperature) or (sampled and not 1e-6 <= args.temperature <= 1e6):
        raise UsageError(
            f"--temperature {args.temperature}: must be between 1e-6 and 1e6 (1 = the model's own distribution)"
        )
    if sampled and not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed {args.seed}: must be a whole number from 0 to 2**63 - 1")
    _check_files(args)
    sampling = None
    if args.sampling is not None:
        try:
            sampling = parse_sampling(args.sampling, args.temperature, args.seed)
        except ValueError as error:
            raise UsageError(str(error)) from None
        if scoring:
            sampling = None
        elif args.nbest != 1 or (args.beam or 1) != 1:
            raise UsageError("--sampling draws one translation per line: leave out --beam and --nbest")
    bad_device = device_error(args.device)
    if bad_device:
        raise UsageError(bad_device)
    return sampling, given


def _check_files(args) -> None:
    """The files and streams the command line names: each usable, none written over another."""
    for flag, path in (
        ("--input", args.input),
        ("--output", args.output),
        ("--score-reference", args.score_reference),
        ("--prefix", args.prefix),
    ):
        if path is not None and not path.strip():
            raise UsageError(f"{flag} is empty (an unset shell variable?); give a file name")
    for flag, path in (("--input", args.input), ("--score-reference", args.score_reference), ("--prefix", args.prefix)):
        kind = path and not_regular(Path(path))
        if kind and kind != "a FIFO":  # a pipe (`--input <(cmd)`) is read once, as stdin is
            raise UsageError(f"{flag} {path}: is {kind}; give a file of one sentence per line")
    if args.output and Path(args.output).is_dir():
        raise UsageError(f"--output {args.output}: is a directory; give a file name")
    if args.output:  # found now, not after the whole file is translated
        parent = Path(args.output).parent  # as open() will take it: no ~ expansion
        if not parent.is_dir():
            raise UsageError(f"--output {args.output}: no directory {parent}; create it first")
        problem = write_problem(args.output)
        if problem:
            raise UsageError(f"--output {args.output}: cannot be written ({problem.lower()})")
    elif sys.stdout is None:
        raise UsageError("stdout is closed; give --output FILE")
    if not args.input and sys.stdin is None:
        raise UsageError("stdin is closed; give --input FILE")
    overwritten = _overwritten_input(args)
    if overwritten:
        raise UsageError(overwritten)


def _load(args, sampling: Sampling | None, given: set[str]) -> Translator:
    """The checkpoint(s) loaded and checked against the command line: the target language, the beam."""
    scoring = args.score_reference is not None
    try:
        translator = load_translator(args)
        translator.tgt_lang = translator.target_language(args.tgt_lang, knob="--tgt-lang ")
    except ValueError as error:  # ConfigError is one; CheckpointError is the skeleton's
        raise UsageError(str(error)) from None
    if not scoring:
        if args.beam is None:  # one draw per line, or the decode config the model was trained with
            args.beam = 1 if sampling is not None else translator.config.decode.beam_size
            if args.nbest > args.beam:
                raise UsageError(
                    f"--nbest {args.nbest}: the checkpoint's beam size is {args.beam}; add --beam {args.nbest}"
                )
        if too_wide := translator.beam_error(args.beam, "--beam "):
            raise UsageError(too_wide)
    ignored = _ignored_options(given, scoring, args.beam)
    if ignored:
        print(f"transformer-translate: warning: {ignored}", file=sys.stderr)
    if args.prefix is not None and scoring:
        raise UsageError("--prefix is for translating; --score-reference scores the given translations whole")
    return translator


def _read(path: str | None, flag: str, stdin=None) -> tuple[list[str], int]:
    """The lines of `path` (`flag` names it in an error), or of `stdin`; and how many were not UTF-8."""
    where = f"{flag + ' ' if flag else ''}{path or 'stdin'}"
    try:
        if path is None:
            return read_input(stdin, where)
        with open(path, "rb") as handle:
            return read_input(handle, where)
    except OSError as error:
        raise UsageError(f"{where}: {error.strerror}") from None


def _run(args, translator: Translator, sampling: Sampling | None) -> int:
    """Translate (or score) the input and write the result."""
    scoring = args.score_reference is not None
    if not scoring and sampling is None and args.prefix is None and not args.input and arrives_as_a_stream(sys.stdin):
        return _translate_stream(translator, args)
    lines, bad = _read(args.input, "", stdin=sys.stdin.buffer)
    warn_invalid(bad)
    if scoring:
        references, _ = _read(args.score_reference, "--score-reference")
        if len(references) != len(lines):
            raise UsageError(
                f"--score-reference {args.score_reference}: {len(references)} lines for "
                f"{len(lines)} input lines; give one translation per input line"
            )
        with _warnings_as_lines():
            scores = translator.score(lines, references, batch_tokens=args.batch_tokens)
        return write_output("".join(f"{value:.4f}\n" for value in scores), args.output)
    prefixes = None
    if args.prefix is not None:
        prefixes, _ = _read(args.prefix, "--prefix")
        if len(prefixes) != len(lines):
            raise UsageError(
                f"--prefix {args.prefix}: {len(prefixes)} lines for {len(lines)} input lines; give one "
                "prefix per input line (an empty line for none)"
            )
        unknown = translator.unknown_prefix_characters(prefixes)
        if unknown:
            raise UsageError(f"--prefix {args.prefix} line {unknown[0] + 1}: {unknown[1]}")
    request = _request(args, sampling, prefixes)
    results = _translate_lines(translator, lines, request, progress=bool(args.output) and sys.stderr.isatty())
    return write_output(format_results(results, args.nbest, first_index=0), args.output)


def _overwritten_input(args) -> str | None:
    """The error line when this run would write its output over one of its inputs (`--input f --output f`,
    `--output` the checkpoint, `< f > f`, ...); None when it would not. Checked before anything is written."""
    inputs = {
        f"the --input file {args.input}": args.input,
        f"the --score-reference file {args.score_reference}": args.score_reference,
        f"the --prefix file {args.prefix}": args.prefix,
        **{f"the checkpoint {checkpoint}": checkpoint for checkpoint in args.checkpoints},
        "the file on stdin": None if args.input else fileno(sys.stdin),
    }
    if args.output:
        name = overwritten_input(args.output, inputs)
        if name:
            return (
                f"--output {args.output}: is {name}; writing the translations there would destroy it; "
                "choose another file"
            )
        return None
    stdout = fileno(sys.stdout)
    name = None if stdout is None else overwritten_input(stdout, inputs)
    if name:
        return (
            f"stdout is {name}; redirect the output to another file (`> FILE` empties FILE before the command starts)"
        )
    return None


def _ignored_options(given: set[str], scoring: bool, beam: int | None) -> str | None:
    """The warning for options given on the command line that this run does not use; None when all are used."""

    def flags(*names):
        return ", ".join(f"--{name.replace('_', '-')}" for name in names if name in given)

    if scoring:
        unused = [
            (flags(*DECODING_OPTIONS), "with --score-reference (it scores the given translations; nothing is decoded)")
        ]
    else:
        unused = [
            (flags("temperature", "seed") if "sampling" not in given else "", "without --sampling"),
            (
                flags("alpha") if beam == 1 else "",
                "by greedy search and sampling (the length penalty ranks the hypotheses of a beam of 2 or more)",
            ),
        ]
    said = [f"{names} {'are' if ',' in names else 'is'} ignored {why}" for names, why in unused if names]
    return "; ".join(said) or None


def _request(args, sampling: Sampling | None, prefixes: list[str] | None = None) -> DecodeRequest:
    """The decoding the command line asks for, as the translator takes it."""
    return DecodeRequest(
        beam_size=args.beam,
        nbest=args.nbest,
        max_len_a=args.max_len_a,
        alpha=None if sampling is not None or args.beam == 1 else args.alpha,  # its warning is said
        max_len_b=args.max_len_b,
        batch_tokens=args.batch_tokens,
        sampling=sampling,
        prefixes=prefixes,
        workers=args.workers,
    )


def _translate_lines(translator: Translator, lines: list[str], request: DecodeRequest, progress: bool = False):
    with _warnings_as_lines():
        return translator.translate_hypotheses(lines, request, progress=progress)


@contextlib.contextmanager
def _warnings_as_lines():
    """The library's warnings inside (a sentence cut to the model's length) as the CLI's one-line
    warnings on stderr, each time, not Python's two-line form with a source location."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for warning in caught:
                print(f"transformer-translate: warning: {warning.message}", file=sys.stderr)


def _translate_stream(translator: Translator, args) -> int:
    """Input from a pipe or a terminal: translate chunk by chunk as lines arrive, each chunk's
    translations written and flushed before the next is read (one output line per input line, in
    order), so that the command serves as a long-running filter."""
    if sys.stdin.isatty():
        print("transformer-translate: translating each line as you type it; end with Ctrl-D", file=sys.stderr)
    try:
        out = open(args.output, "w", encoding="utf-8") if args.output else None
    except OSError as error:
        raise UsageError(f"--output {args.output}: {error.strerror}") from None
    # The reader thread reads its own file object on a copy of stdin's descriptor: it may still be
    # waiting for a line when the command ends (Ctrl-C, a failed write), holding that object's lock,
    # and Python's shutdown would abort on sys.stdin's.
    source = open(os.dup(sys.stdin.fileno()), "rb")
    done, request = 0, _request(args, None)
    try:
        for lines, bad in stream_chunks(source):
            warn_invalid(bad)
            text = format_results(_translate_lines(translator, lines, request), args.nbest, first_index=done)
            done += len(lines)
            stopped = send(text, out, args.output)
            if stopped is not None:
                return stopped
    except OSError as error:  # from stream_chunks: send reports its own
        raise UsageError(f"reading the input: {error.strerror or error}") from None
    finally:
        close_output(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
