"""`Translator` (the Python API) and the `transformer-translate` command line.

    transformer-translate CKPT [--input F] [--output F] [--beam N] [--nbest N] [--alpha A] ...

Reads raw text, one sentence per line, and writes exactly one line per input line: the detokenized
translation, or with `--nbest N > 1`, N lines per input of the form `INDEX<TAB>SCORE<TAB>TEXT`.
Needs nothing but the checkpoint file.
"""

from __future__ import annotations

import argparse
import math
import numbers
import os
import queue
import re
import stat
import sys
import threading
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from transformer.batching import batches_in_order, pad_sequences
from transformer.checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint
from transformer.config import DEFAULT_BATCH_TOKENS, ConfigError
from transformer.model import eval_mode
from transformer.runtime import DTYPES, Runtime, autocast_factory, keep_freed_memory
from transformer.search import Hypothesis, Sampling, translate_ids
from transformer.special import BOS_ID, EOS_ID, PAD_ID

# Target tokens per batch when scoring references (`Translator.score`).
SCORE_BATCH_TOKENS = 2048


class Translator:
    """Text in, text out: the one path from raw sentences to translations, for the command line, the
    Python API, validation and the test at the end of training, `evaluate` and the bench.

    >>> Translator.from_checkpoint("best.pt").translate(["Ein Hund rennt."], beam_size=5)
    ['A dog is running.']

    Constructed around a model in use (training's), it leaves the model where it is and in the mode it
    was in; `from_checkpoint` / `from_pretrained` move theirs to `device` in eval mode.
    """

    def __init__(self, model, tokenizer, config, device: torch.device, precision: str = "fp32", autocast=None):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.max_length = model.cfg.max_positions - 1       # tokens of a sentence, EOS or BOS aside
        self.device = device
        self.autocast = autocast or autocast_factory(device, DTYPES[precision])

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str = "auto", precision: str = "auto") -> Translator:
        """A `.pt` checkpoint written by training."""
        runtime = Runtime.for_inference(device, precision)
        model, tokenizer, config = model_from_checkpoint(load_checkpoint(path, mmap=True), path)
        return cls(model.to(runtime.device).eval(), tokenizer, config, runtime.device, runtime.precision)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "auto", precision: str = "auto") -> Translator:
        """A directory written by `transformer-export --format safetensors`, or a HuggingFace Hub id holding one
        (`owner/name`, downloaded and cached by huggingface_hub)."""
        from transformer.export import load_pretrained

        runtime = Runtime.for_inference(device, precision)
        model, tokenizer, config = load_pretrained(path)
        return cls(model.to(runtime.device).eval(), tokenizer, config, runtime.device, runtime.precision)

    @classmethod
    def load(cls, path: str | Path, device: str = "auto", precision: str = "auto") -> Translator:
        """A checkpoint file, an exported directory, or a hub id (`owner/name`, nothing of that name on
        disk): what the command lines accept."""
        from transformer.export import looks_like_hub_id

        if Path(path).is_dir() or looks_like_hub_id(path):
            return cls.from_pretrained(path, device, precision)
        return cls.from_checkpoint(path, device, precision)

    def encode_sources(self, sentences: list[str]) -> list[list[int]]:
        """Source token ids, each cut to the model's positions (with one warning for all that were)."""
        limit = self.max_length
        sources = self.tokenizer.encode_src([s.strip() for s in sentences])
        truncated = sum(len(s) > limit for s in sources)
        if truncated:
            warnings.warn(f"{truncated} source sentence(s) longer than {limit} tokens were truncated "
                          "to the model's maximum length", stacklevel=3)
        return [s[:limit] for s in sources]

    def translate_hypotheses(self, sentences: list[str], **options) -> list[list[tuple[str, float]]]:
        """n-best (text, score) lists, best first; the options of `hypotheses`."""
        return [[(h.text, h.score) for h in hyps] for hyps in self.hypotheses(sentences, **options)]

    def hypotheses(self, sentences: list[str], *, beam_size: int | None = None, alpha: float | None = None,
                   nbest: int = 1, max_len_a: float | None = None, max_len_b: int | None = None,
                   batch_tokens: int | None = None, progress: bool | None = False, desc: str = "translate",
                   sampling: Sampling | None = None, stop=None, use_cache: bool = True) -> list[list[Hypothesis]]:
        """n-best `Hypothesis` lists (text, score, tokens, ...), best first. Options left out come from the
        config's decode section. Empty sentences translate to ''. With `sampling` (`search.Sampling`), one
        sampled translation per sentence instead of a search. `progress`: a tqdm bar (None: when stderr
        is a terminal); `stop()`, asked between batches, may raise `search.Interrupted`; `use_cache=False`
        recomputes every prefix (the bench's reference)."""
        sentences = list_of_str(sentences, "sentences", "translate([text])")
        decode = self.config.decode
        beam_size = decode.beam_size if beam_size is None else beam_size
        alpha = decode.alpha if alpha is None else alpha
        max_len_a = decode.max_len_a if max_len_a is None else max_len_a
        max_len_b = decode.max_len_b if max_len_b is None else max_len_b
        batch_tokens = DEFAULT_BATCH_TOKENS if batch_tokens is None else batch_tokens
        check_options(beam_size=beam_size, nbest=nbest, alpha=alpha, max_len_a=max_len_a, max_len_b=max_len_b,
                      batch_tokens=batch_tokens)
        sources = self.encode_sources(sentences)
        wanted = [i for i, s in enumerate(sources) if s]
        results: list[list[Hypothesis]] = [[] for _ in sources]
        with tqdm(total=len(wanted), desc=desc, unit="sent", leave=False,
                  disable=None if progress is None else not progress) as bar:
            decoded = translate_ids(
                self.model, [sources[i] for i in wanted], beam_size=beam_size, alpha=alpha, nbest=nbest,
                max_len_a=max_len_a, max_len_b=max_len_b, batch_tokens=batch_tokens, device=self.device,
                progress=bar, autocast=self.autocast, sampling=sampling, stop=stop, use_cache=use_cache)
        for index, hyps in zip(wanted, decoded):
            results[index] = hyps
        flat = [h for hyps in results for h in hyps]
        for hyp, text in zip(flat, self.tokenizer.decode_tgt([h.tokens for h in flat])):
            hyp.text = text
        return [hyps or [Hypothesis([], 0.0, 0.0) for _ in range(nbest)] for hyps in results]

    @torch.inference_mode()
    def score(self, sentences: list[str], references: list[str], batch_tokens: int | None = None) -> list[float]:
        """Log-probability of each reference translation given its source under the model (forced
        decoding): the sum over its tokens and the final EOS, as sentence scores for filtering corpora.
        Sources and references longer than the model's positions are truncated."""
        sentences = list_of_str(sentences, "sentences", "score([source], [reference])")
        references = list_of_str(references, "references", "score([source], [reference])")
        if len(sentences) != len(references):
            raise ValueError(f"{len(sentences)} sources but {len(references)} references: give one reference "
                             "per source")
        if batch_tokens is not None:
            check_whole("batch_tokens", batch_tokens, 1)
        sources = self.encode_sources(sentences)
        targets = [ids[:self.max_length] for ids in self.tokenizer.encode_tgt([r.strip() for r in references])]
        widths = [max(len(a), len(b)) for a, b in zip(sources, targets)]
        scores = [0.0] * len(sources)
        # The (B, T, V) float32 log-probabilities bound the batch: 2048 tokens x 32k pieces = 256 MB.
        for indices in batches_in_order(widths, batch_tokens or SCORE_BATCH_TOKENS):
            src = pad_sequences([sources[i] for i in indices], suffix=[EOS_ID]).to(self.device)      # (B, S)
            tgt = [targets[i] for i in indices]
            tgt_in = pad_sequences(tgt, prefix=[BOS_ID]).to(self.device)                           # (B, T)
            tgt_out = pad_sequences(tgt, suffix=[EOS_ID]).to(self.device)                          # (B, T)
            with self.autocast(), eval_mode(self.model):
                logits = self.model(src, tgt_in)                                                   # (B, T, V)
            logprobs = torch.log_softmax(logits.float(), dim=-1).gather(2, tgt_out[:, :, None]).squeeze(2)
            sums = logprobs.masked_fill(tgt_out == PAD_ID, 0.0).sum(dim=1)                         # (B,)
            for index, value in zip(indices, sums.tolist()):
                scores[index] = value
        return scores

    def translate(self, sentences: list[str], beam_size: int | None = None, **options) -> list[str]:
        """One translation per sentence (the best hypothesis)."""
        return [hyps[0][0] for hyps in self.translate_hypotheses(sentences, beam_size=beam_size, **options)]


def list_of_str(sentences, name: str, example: str) -> list[str]:
    """`sentences` (a list or any iterable of str, consumed once) as a list; a TypeError naming the
    argument otherwise (a str alone would be taken as one sentence per character)."""
    items = None
    if not isinstance(sentences, (str, bytes)):
        try:
            items = list(sentences)
        except TypeError:                                # not iterable
            pass
    kind = type(sentences).__name__ if items is None else \
        next((type(s).__name__ for s in items if not isinstance(s, str)), None)
    if kind is not None:
        raise TypeError(f"{name} must be a list of str (got {kind}); for one sentence write {example}")
    return items


def check_whole(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name}={value!r}: must be a whole number >= {low}")


def check_options(*, beam_size, nbest, alpha, max_len_a, max_len_b, batch_tokens) -> None:
    """Decoding options, checked the same way for the API and the CLIs: ValueError naming the option."""
    check_whole("beam_size", beam_size, 1)
    check_whole("batch_tokens", batch_tokens, 1)
    check_whole("max_len_b", max_len_b, 0)
    check_whole("nbest", nbest, 1)
    if nbest > beam_size:
        raise ValueError(f"nbest={nbest}: must be between 1 and the beam size ({beam_size})")
    for name, value in (("alpha", alpha), ("max_len_a", max_len_a)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}={value!r}: must be a finite number >= 0")


def option_message(error: ValueError) -> str:
    """`check_options`'s message in the command lines' words: `beam_size=0: ...` -> `--beam 0: ...`."""
    option, _, rest = str(error).partition("=")
    return f"--{option.replace('_size', '').replace('_', '-')} {rest}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="transformer-translate",
        description="Translate text with a trained checkpoint: one output line per input line.")
    parser.add_argument("checkpoint", help="a .pt checkpoint written by training (best.pt, last.pt, ...), or a "
                        "directory (or HuggingFace Hub id) written by transformer-export --format safetensors")
    parser.add_argument("--input", "-i", help="source text file (default: stdin)")
    parser.add_argument("--output", "-o", help="where to write translations (default: stdout)")
    parser.add_argument("--beam", type=int, help="beam size; 1 = greedy (default: the checkpoint's decode "
                        "config, 5 unless it was trained with decode=greedy)")
    parser.add_argument("--nbest", type=int,
                        help="hypotheses per input; >1 writes INDEX<TAB>SCORE<TAB>TEXT lines (default 1)")
    parser.add_argument("--alpha", type=float, help="GNMT length penalty exponent (default: the checkpoint's)")
    parser.add_argument("--max-len-a", type=float, help="output length limit a * source_len + b")
    parser.add_argument("--max-len-b", type=int)
    parser.add_argument("--batch-tokens", type=int, help=f"source tokens x beam per batch (default {DEFAULT_BATCH_TOKENS}); "
                        "smaller needs less memory")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    parser.add_argument("--sampling", metavar="topk:K|topp:P",
                        help="draw each token at random (back-translation) from the K most probable, or from "
                        "the smallest set with probability P, instead of searching")
    parser.add_argument("--temperature", type=float, help="with --sampling: divides the "
                        "log-probabilities (default 1; lower is closer to greedy)")
    parser.add_argument("--seed", type=int, help="with --sampling: the same seed, the same samples (default 1)")
    parser.add_argument("--score-reference", metavar="REF",
                        help="write the log-probability of each line of REF (one translation per input line) "
                        "given its source, instead of translating (forced decoding)")
    return parser


def parse_sampling(text: str, temperature: float, seed: int) -> Sampling:
    """`topk:K` or `topp:P` -> Sampling; ValueError with the fix otherwise."""
    kind, _, value = text.partition(":")
    try:
        if kind == "topk" and value.isdigit() and int(value) >= 1:
            return Sampling(top_k=int(value), temperature=temperature, seed=seed)
        if kind == "topp" and 0.0 < float(value) <= 1.0:
            return Sampling(top_p=float(value), temperature=temperature, seed=seed)
    except ValueError:
        pass
    raise ValueError(f"--sampling {text}: write topk:K (a whole number >= 1) or topp:P (0 < P <= 1)")


def _text_line(raw: bytes) -> tuple[str, bool]:
    """One input line (without its line break) as text; whether it was invalid UTF-8 (bytes replaced)."""
    raw = raw[:-1] if raw.endswith(b"\r") else raw
    try:
        line, bad = raw.decode("utf-8"), False
    except UnicodeDecodeError:
        line, bad = raw.decode("utf-8", errors="replace"), True
    # Control characters other than tab carry no meaning for translation.
    return "".join(ch if ch >= " " or ch == "\t" else " " for ch in line), bad


def read_input(stream) -> tuple[list[str], int]:
    """Lines of a binary stream decoded as UTF-8 (invalid bytes replaced); also the count of bad lines."""
    data = stream.read()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    parts = data.split(b"\n")
    if parts and parts[-1] == b"":
        parts.pop()
    decoded = [_text_line(raw) for raw in parts]
    return [line for line, _ in decoded], sum(bad for _, bad in decoded)


# At most this many lines are translated together while streaming.
STREAM_CHUNK_LINES = 256


def stream_chunks(stream, max_lines: int = STREAM_CHUNK_LINES):
    """Lines of a binary stream in chunks as they arrive: (lines, invalid UTF-8 count) per chunk.

    A reader thread queues lines as they come in; each chunk waits for one line, then takes whatever
    else has already arrived. At a terminal that is one line at a time; from a pipe fed faster than
    the model translates, chunks grow to `max_lines`, so a long-running filter keeps batching.
    """
    # Bounded: a producer far faster than the model waits instead of queueing its whole input in memory.
    arrived: queue.Queue = queue.Queue(maxsize=4 * max_lines)

    def read() -> None:
        try:
            for raw in iter(stream.readline, b""):
                arrived.put(raw)
        except OSError as error:                    # handed to the consumer: one error line, not a thread traceback
            arrived.put(error)
        finally:
            arrived.put(None)                       # end of input

    threading.Thread(target=read, name="translate-input", daemon=True).start()
    first, ended = True, False
    while not ended:
        raw = arrived.get()
        if raw is None:
            return
        if isinstance(raw, OSError):
            raise raw
        chunk = [raw]
        while len(chunk) < max_lines:
            try:
                raw = arrived.get_nowait()
            except queue.Empty:
                break
            if isinstance(raw, OSError):
                raise raw
            if raw is None:
                ended = True
                break
            chunk.append(raw)
        if first and chunk[0].startswith(b"\xef\xbb\xbf"):
            chunk[0] = chunk[0][3:]
        first = False
        decoded = [_text_line(raw[:-1] if raw.endswith(b"\n") else raw) for raw in chunk]
        yield [line for line, _ in decoded], sum(bad for _, bad in decoded)


# The decoding options: all of them unused with --score-reference (parser defaults None: given or not).
DECODING_OPTIONS = ("beam", "nbest", "alpha", "max_len_a", "max_len_b", "sampling", "temperature", "seed")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:              # Ctrl-C; while streaming, what was translated has been written
        print("transformer-translate: interrupted", file=sys.stderr)
        return 130


def _fail(message: str) -> int:
    print(f"transformer-translate: error: {message}", file=sys.stderr)
    return 2


def _run(args) -> int:
    keep_freed_memory()
    scoring = args.score_reference is not None
    given = {name for name in DECODING_OPTIONS if getattr(args, name) is not None}
    args.nbest = 1 if args.nbest is None else args.nbest
    args.temperature = 1.0 if args.temperature is None else args.temperature
    args.seed = 1 if args.seed is None else args.seed
    try:
        check_options(beam_size=args.nbest if args.beam is None else args.beam, nbest=args.nbest, alpha=0.0 if args.alpha is None else args.alpha,
                      max_len_a=0.0 if args.max_len_a is None else args.max_len_a,
                      max_len_b=0 if args.max_len_b is None else args.max_len_b,
                      batch_tokens=1 if args.batch_tokens is None else args.batch_tokens)
    except ValueError as error:
        return _fail(option_message(error))
    if not (args.temperature > 0 and math.isfinite(args.temperature)):
        return _fail(f"--temperature {args.temperature}: must be a finite number > 0")
    if args.output and Path(args.output).is_dir():
        return _fail(f"--output {args.output}: is a directory; give a file name")
    overwritten = _overwritten_input(args)
    if overwritten:
        return _fail(overwritten)
    sampling = None
    if args.sampling is not None:
        try:
            sampling = parse_sampling(args.sampling, args.temperature, args.seed)
        except ValueError as error:
            return _fail(str(error))
        if scoring:
            sampling = None
        elif args.nbest != 1 or (args.beam or 1) != 1:
            return _fail("--sampling draws one translation per line: leave out --beam and --nbest")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device):
        return _fail(f"--device {args.device}: must be auto, cpu, cuda or cuda:N")
    if args.device.startswith("cuda"):
        index = int(args.device.partition(":")[2] or 0)
        if not torch.cuda.is_available():
            return _fail(f"--device {args.device}: CUDA is not available")
        if index >= torch.cuda.device_count():
            return _fail(f"--device {args.device}: there are {torch.cuda.device_count()} CUDA device(s) (0 to "
                         f"{torch.cuda.device_count() - 1})")
    try:
        translator = Translator.load(args.checkpoint, device=args.device, precision=args.precision)
    except (CheckpointError, ConfigError) as error:
        return _fail(str(error))
    if not scoring:
        if args.beam is None:             # one draw per line, or the decode config the model was trained with
            args.beam = 1 if sampling is not None else translator.config.decode.beam_size
            if args.nbest > args.beam:
                return _fail(f"--nbest {args.nbest}: the checkpoint's beam size is {args.beam}; add --beam {args.nbest}")
    ignored = _ignored_options(given, scoring, args.beam)
    if ignored:
        print(f"transformer-translate: warning: {ignored}", file=sys.stderr)
    if not scoring and sampling is None and not args.input and _streams(sys.stdin):
        return _translate_stream(translator, args)
    try:
        if args.input:
            with open(args.input, "rb") as handle:
                lines, bad = read_input(handle)
        else:
            lines, bad = read_input(sys.stdin.buffer)
    except OSError as error:
        return _fail(f"{args.input or 'stdin'}: {error.strerror}")
    _warn_invalid(bad)
    if scoring:
        try:
            with open(args.score_reference, "rb") as handle:
                references, _ = read_input(handle)
        except OSError as error:
            return _fail(f"--score-reference {args.score_reference}: {error.strerror}")
        if len(references) != len(lines):
            return _fail(f"--score-reference {args.score_reference}: {len(references)} lines for "
                         f"{len(lines)} input lines; give one translation per input line")
        scores = translator.score(lines, references, batch_tokens=args.batch_tokens)
        return _write("".join(f"{value:.4f}\n" for value in scores), args.output)
    results = _translate_lines(translator, lines, args, sampling, progress=bool(args.output) and sys.stderr.isatty())
    return _write(_format(results, args.nbest, first_index=0), args.output)


def same_file(a: str | Path | int, b: str | Path | int) -> bool:
    """Whether `a` and `b` (paths, or open file descriptors) are one regular file on disk, however they are
    spelled: symlinks, hard links, ./ and ../ included. Never for terminals, pipes and devices
    (/dev/stdin and /dev/stdout are often one terminal, and that destroys nothing)."""
    try:
        first, second = os.stat(a), os.stat(b)
    except (OSError, ValueError, TypeError):
        return False
    return stat.S_ISREG(first.st_mode) and os.path.samestat(first, second)


def overwritten_input(output: str | Path | int, inputs: dict[str, str | Path | int | None]) -> str | None:
    """Which of `inputs` (a description -> a path or an open file descriptor; None: not in use) writing
    `output` would destroy: the same file, or a file inside an input directory (an exported model).
    None when it destroys none."""
    for name, source in inputs.items():
        if source is None:
            continue
        files = [source]
        if not isinstance(source, int) and Path(source).is_dir():
            files = list(Path(source).rglob("*"))
        if any(same_file(file, output) for file in files):
            return name
    return None


def _overwritten_input(args) -> str | None:
    """The error line when this run would write its output over one of its inputs (`--input f --output f`,
    `--output` the checkpoint, `< f > f`, ...); None when it would not. Checked before anything is written."""
    inputs = {f"the --input file {args.input}": args.input,
              f"the --score-reference file {args.score_reference}": args.score_reference,
              f"the checkpoint {args.checkpoint}": args.checkpoint,
              "the file on stdin": None if args.input else _fileno(sys.stdin)}
    if args.output:
        name = overwritten_input(args.output, inputs)
        if name:
            return f"--output {args.output}: is {name}; writing the translations there would destroy it; " \
                   "choose another file"
        return None
    stdout = _fileno(sys.stdout)
    name = None if stdout is None else overwritten_input(stdout, inputs)
    if name:
        return f"stdout is {name}; redirect the output to another file (`> FILE` empties FILE before the " \
               "command starts)"
    return None


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):       # closed, or replaced by one without a descriptor
        return None


def _ignored_options(given: set[str], scoring: bool, beam: int | None) -> str | None:
    """The warning for options given on the command line that this run does not use; None when all are used."""
    def flags(*names):
        return ", ".join(f"--{name.replace('_', '-')}" for name in names if name in given)

    if scoring:
        unused = [(flags(*DECODING_OPTIONS), "with --score-reference (it scores the given translations; "
                                             "nothing is decoded)")]
    else:
        unused = [(flags("temperature", "seed") if "sampling" not in given else "", "without --sampling"),
                  (flags("alpha") if beam == 1 else "", "by greedy search and sampling (the length penalty "
                                                        "ranks the hypotheses of a beam of 2 or more)")]
    said = [f"{names} {'are' if ',' in names else 'is'} ignored {why}" for names, why in unused if names]
    return "; ".join(said) or None


def _streams(stdin) -> bool:
    """Translate as input arrives when it comes from a pipe or a terminal; a redirected file is read whole
    (one sorted pass batches best)."""
    try:
        return not stat.S_ISREG(os.fstat(stdin.fileno()).st_mode)
    except (OSError, ValueError, AttributeError):
        return False


def _translate_lines(translator: Translator, lines: list[str], args, sampling, progress: bool = False):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = translator.translate_hypotheses(
            lines, beam_size=args.beam, alpha=args.alpha, nbest=args.nbest, max_len_a=args.max_len_a,
            max_len_b=args.max_len_b, batch_tokens=args.batch_tokens, progress=progress, sampling=sampling)
    for warning in caught:
        print(f"transformer-translate: warning: {warning.message}", file=sys.stderr)
    return results


def _format(results, nbest: int, first_index: int) -> str:
    if nbest == 1:
        return "".join(_one_line(hyps[0][0]) + "\n" for hyps in results)
    return "".join(f"{index}\t{score:.4f}\t{_one_line(text)}\n"
                   for index, hyps in enumerate(results, start=first_index) for text, score in hyps)


def _translate_stream(translator: Translator, args) -> int:
    """Input from a pipe or a terminal: translate chunk by chunk as lines arrive, each chunk's
    translations written and flushed before the next is read (one output line per input line, in
    order), so that the command serves as a long-running filter."""
    if sys.stdin.isatty():
        print("transformer-translate: translating each line as you type it; end with Ctrl-D", file=sys.stderr)
    try:
        out = open(args.output, "w", encoding="utf-8") if args.output else None
    except OSError as error:
        return _fail(f"--output {args.output}: {error.strerror}")
    # The reader thread reads its own file object on a copy of stdin's descriptor: it may still be
    # waiting for a line when the command ends (Ctrl-C, a failed write), holding that object's lock,
    # and Python's shutdown would abort on sys.stdin's.
    source = open(os.dup(sys.stdin.fileno()), "rb")
    done = 0
    try:
        for lines, bad in stream_chunks(source):
            _warn_invalid(bad)
            text = _format(_translate_lines(translator, lines, args, None), args.nbest, first_index=done)
            done += len(lines)
            stopped = _send(text, out, args.output)
            if stopped is not None:
                return stopped
    except OSError as error:                    # from stream_chunks: _send reports its own
        return _fail(f"reading the input: {error.strerror or error}")
    finally:
        _close(out)
    return 0


def _warn_invalid(bad: int) -> None:
    if bad:
        print(f"transformer-translate: warning: {bad} input line(s) were not valid UTF-8; "
              "invalid bytes were replaced", file=sys.stderr)


def _write(text: str, output: str | None) -> int:
    """All the output at once, to the --output file or stdout; the exit code."""
    try:
        out = open(output, "w", encoding="utf-8") if output else None
    except OSError as error:
        return _fail(f"--output {output}: {error.strerror}")
    try:
        return _send(text, out, output) or 0
    finally:
        _close(out)


def _send(text: str, out, output: str | None) -> int | None:
    """Write and flush `text` to the open --output file `out`, or to stdout (`out` None). None when it
    was written; otherwise the exit code: 0 when the reader went away (`| head`), 2 with one error
    line when it could not be written (a full disk, ...)."""
    try:
        if out is not None:
            out.write(text)
            out.flush()
        else:
            sys.stdout.buffer.write(text.encode("utf-8"))
            sys.stdout.flush()
        return None
    except OSError as error:
        if out is None:                         # what stdout still holds would fail again at exit, with a traceback
            _discard_stdout()
        if isinstance(error, BrokenPipeError):
            return 0
        where = f"--output {output}" if out is not None else "stdout"
        return _fail(f"{where}: cannot write the output: {error.strerror or error}")


def _discard_stdout() -> None:
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):               # no descriptor (a test's captured stdout)
        pass


def _close(out) -> None:
    if out is not None:
        try:
            out.close()
        except OSError:                         # a failed write, already reported: closing retries its flush
            pass


def _one_line(text: str) -> str:
    # A translation must never add line breaks, or the output would no longer align with the input.
    return text.replace("\r", " ").replace("\n", " ")


if __name__ == "__main__":
    sys.exit(main())
