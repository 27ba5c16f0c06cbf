"""Plain helpers for the tests (conftest.py keeps the fixtures and hooks): the repository root, the
tiny training configuration, composing the real config, a command's main(argv) run in the test's process and its
one-line refusals, an untrained checkpoint, a bit flipped in a checkpoint, and the counter of tensor
values read back to the host, a command run on a pseudo-terminal and the lines a terminal shows of it."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import termios
import time
import zipfile
import zlib
from pathlib import Path

import torch

from transformer.checkpoint import save_checkpoint
from transformer.compose import compose
from transformer.config import Config
from transformer.data.tokenizer import Tokenizer, train_sentencepiece
from transformer.data.toy import generate
from transformer.model import build_model

ROOT = Path(__file__).resolve().parents[1]

# Small enough to train in seconds; every test that trains starts from this and overrides what it needs.
# No attention pictures (drawing them took three quarters of a small test run's validations): the tests
# of the pictures ask for them (trainer.attention_heatmaps=mean or heads).
FAST = [
    "model.d_model=64",
    "model.n_heads=4",
    "model.d_ff=128",
    "model.encoder_layers=2",
    "model.decoder_layers=2",
    "data.embedded_pairs=2000",
    "data.vocab_size=200",
    "trainer.max_tokens=1024",
    "trainer.log_every=10",
    "trainer.val_max_sentences=50",
    "trainer.attention_heatmaps=off",
]


def compose_config(overrides: list[str] = (), cache_dir: Path | None = None) -> Config:
    """The real conf/ tree composed with overrides, as `make train key=value` would see it."""
    extra = [f"data.cache_dir={cache_dir}"] if cache_dir is not None else []
    return compose(list(overrides) + extra)


def run_main(main, capsys, *args) -> tuple[int, str, str]:
    """A command line's `main(argv)` run in this process with `args` (Paths and numbers as str): its exit
    code (argparse's SystemExit turned into its code) and what it wrote to stdout and stderr."""
    try:
        code = main([str(arg) for arg in args])
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    """The one line of a command's stderr `err` (a refusal, an interrupt): fails on a traceback, on no
    line, and on a second line (blank ones included)."""
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def assert_one_line_refusal(err: str, prog: str | None, pattern: str | None = None) -> str:
    """`err` is one line, `PROG: error: ...` (`error: ...` for training, prog None), without a traceback,
    and when given matches the regular expression `pattern` (re.search); returns the line."""
    line = one_line(err)
    prefix = f"{prog}: error: " if prog else "error: "
    assert line.startswith(prefix), (prefix, line)
    if pattern is not None:
        assert re.search(pattern, line), (pattern, line)
    return line


def wait_for_log(log: Path, text: str, seconds: float) -> None:
    """Until the run's log `log` holds `text` (a step reached, a stage begun), or `seconds` have passed:
    the caller then checks that the process is still running."""
    deadline = time.time() + seconds
    while time.time() < deadline and not (log.exists() and text in log.read_text()):
        time.sleep(0.1)


def write_untrained_checkpoint(path: Path) -> Path:
    """best.pt of an untrained tiny model, with the metrics a run records after one validation. Enough for
    every test that does not need sensible translations: refusals, file handling, shapes, equivalences."""
    config = compose_config(FAST)
    src, tgt = generate(400, 10, 10)["train"]
    tokenizer = Tokenizer(
        train_sentencepiece(src + tgt, vocab_size=120, model_type="bpe", character_coverage=1.0, sample=10_000)
    )
    torch.manual_seed(0)
    model = build_model(config.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint)
    metrics = {
        "val_history": [{"step": 10, "loss": 4.0, "bleu": 12.345, "chrf": 40.5, "weights": "raw"}],
        "best_bleu": 12.345,
        "best_step": 10,
    }
    save_checkpoint(
        {
            "model": model.state_dict(),
            "config": config.to_dict(),
            "tokenizer": tokenizer.state_dict(),
            "step": 10,
            "metrics": metrics,
        },
        path,
    )
    return path


def _sigint_as_at_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# Popen keyword arguments for a child the test interrupts with SIGINT (Ctrl-C): a suite started in the
# background (`make test &`) ignores SIGINT, children inherit that, and Python then never raises
# KeyboardInterrupt. The child gets the default disposition back, as at a terminal.
INTERRUPTIBLE = {"preexec_fn": _sigint_as_at_a_terminal}


# Operations that make a GPU report a value to the host (the step then waits for the device).
HOST_READS = (
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten.unique",
    "aten._unique",
    "aten.repeat_interleave",
    "aten.equal",
    "aten.is_nonzero",
)


class HostReads:
    """Counts, during a block, every tensor value read on the host: at the dispatcher (item, float,
    bool, int, `if tensor`, boolean-mask indexing, nonzero, ...) and through tolist/numpy, which
    bypass it.

    A tensor on the `meta` device has no values: there a read is answered with placeholders (False,
    0.0, and `meta_int` for integers: a loop bound, a length limit) so that code which branches on values
    (search's loops) runs on. Reads whose result size depends on the values (nonzero, boolean-mask
    indexing) still fail there."""

    def __init__(self, meta_int: int = 0):
        self.seen: list[str] = []
        self.meta_int = meta_int

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        reads = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func.overloadpacket)
                bool_index = name == "aten.index" and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
                )
                if name.startswith(HOST_READS) or bool_index:
                    reads.seen.append(name)
                    if name == "aten._local_scalar_dense" and args[0].is_meta:
                        return reads._placeholder(args[0].dtype)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.patches = [(name, getattr(torch.Tensor, name)) for name in ("tolist", "numpy")]
        for name, original in self.patches:
            setattr(torch.Tensor, name, self._counting(name, original))
        self.mode.__enter__()
        return self

    def _placeholder(self, dtype: torch.dtype):
        if dtype == torch.bool:
            return False
        if dtype.is_floating_point:
            return 0.0
        return self.meta_int

    def _counting(self, name, original):
        def wrapper(tensor, *args, **kwargs):
            self.seen.append(f"Tensor.{name}")
            if name == "tolist" and tensor.is_meta:
                return _nested_list(tuple(tensor.shape), self._placeholder(tensor.dtype))
            return original(tensor, *args, **kwargs)

        return wrapper

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        for name, original in self.patches:
            setattr(torch.Tensor, name, original)


def _nested_list(shape: tuple, value) -> list:
    return value if not shape else [_nested_list(shape[1:], value) for _ in range(shape[0])]


def flip_a_byte_of(path: Path, tensor: torch.Tensor) -> None:
    """Change one bit in the middle of the zip record that holds `tensor`'s storage in `path` (found by
    its CRC-32), as a disk or a copy would."""
    as_bytes = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).numpy()
    with zipfile.ZipFile(path) as archive:
        record = next(
            info for info in archive.infolist() if info.CRC == zlib.crc32(as_bytes) and info.file_size == as_bytes.size
        )
    data = bytearray(path.read_bytes())
    header = record.header_offset  # local header: 30 bytes, then the name and the extra field
    name_length, extra_length = struct.unpack("<HH", data[header + 26 : header + 30])
    data[header + 30 + name_length + extra_length + record.file_size // 2] ^= 0x04
    path.write_bytes(data)


def screen_lines(raw: str) -> list[str]:
    """The lines a terminal shows for `raw`: a carriage return goes back to the start of the line, whose
    characters the next ones overwrite; escape sequences are dropped."""
    raw = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw)
    lines, line, column = [], [], 0
    for char in raw:
        if char == "\n":
            lines.append("".join(line).rstrip())
            line, column = [], 0
        elif char == "\r":
            column = 0
        else:
            line[column : column + 1] = [char]
            column += 1
    return lines + ["".join(line).rstrip()]


def run_on_a_terminal(args: list[str], cwd, timeout: float = 240) -> str:
    """Run `args` with stdout and stderr on a pseudo-terminal 160 columns wide; everything it wrote."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    # Not under make (`make test` exports MAKELEVEL): the resume command then takes the python -m form.
    env = {**{k: v for k, v in os.environ.items() if k != "MAKELEVEL"}, "PYTHONUNBUFFERED": "1", "COLUMNS": "160"}
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks, deadline = [], time.time() + timeout
    try:
        while time.time() < deadline:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(master)
        proc.wait(timeout=60)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    return b"".join(chunks).decode(errors="replace")
