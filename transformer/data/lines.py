"""Files of UTF-8 lines, read in blocks: only '\n' separates lines, invalid UTF-8 stops with the file, line
and column, devices and other irregular files are refused, and a file's identity for a fingerprint
(size and mtime, or its bytes hashed) is found without reading it whole."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from transformer.errors import DataError

_BLOCK_BYTES = 8 << 20


def decode_lines(block: bytes, path: Path, first_line: int) -> list[str]:
    """Lines of a block of whole lines; only '\\n' separates lines (str.splitlines would also split
    on U+2028 and friends and mis-align a parallel corpus); a CR before the '\\n' is dropped."""
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError as error:
        line_no = first_line + block.count(b"\n", 0, error.start)
        column = error.start - (block.rfind(b"\n", 0, error.start) + 1) + 1
        utf16 = first_line == 1 and block[:2] in (b"\xff\xfe", b"\xfe\xff")  # its byte-order mark
        source = "utf-16" if utf16 else "latin1"
        raise DataError(
            f"{path}:{line_no}: invalid UTF-8 (byte 0x{block[error.start]:02x} at column {column}"
            f"{'; the file is UTF-16' if utf16 else ''}); re-encode the file as UTF-8, e.g. "
            f"`iconv -f {source} -t utf-8`"
        ) from None
    lines = text.split("\n")
    if "\r" in text:
        lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    return lines


def not_regular(path: Path) -> str | None:
    """What `path` is when it exists but is not a regular file (a directory, a FIFO, a device)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    kinds = (
        (stat.S_ISREG, None),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((kind for test, kind in kinds if test(mode)), "not a regular file")


def refuse_irregular(path: Path) -> None:
    """Text that is read more than once (fingerprint, vocabulary, encoding) must be in a regular file:
    /dev/null would read as an empty corpus, a FIFO once or never."""
    kind = not_regular(path)
    if kind:
        raise DataError(f"{path}: is not a regular file (it is {kind}); give the text in a regular file")


def open_for_reading(path: Path):
    try:
        return open(path, "rb")
    except OSError as error:
        raise DataError(f"{path}: cannot read it: {error.strerror}") from None


def _whole_line_blocks(path: Path) -> Iterator[tuple[bytes, int]]:
    """(bytes, number of the first line) of a file's blocks of about 8 MB cut after a newline (a BOM
    stripped), each without its last '\n'; a last line without a newline is the last block."""
    line_no, rest, first = 1, b"", True
    with open_for_reading(path) as handle:
        while True:
            block = handle.read(_BLOCK_BYTES)
            if first and block.startswith(b"\xef\xbb\xbf"):
                block = block[3:]
            first = False
            if not block:
                break
            block = rest + block
            cut = block.rfind(b"\n")
            if cut < 0:
                rest = block
                continue
            rest = block[cut + 1 :]
            yield block[:cut], line_no
            line_no += block.count(b"\n", 0, cut) + 1
    if rest:
        yield rest, line_no


def iter_line_blocks(path: Path) -> Iterator[list[str]]:
    """The lines of a UTF-8 file in blocks of about 8 MB (a BOM is stripped)."""
    for block, line_no in _whole_line_blocks(path):
        yield decode_lines(block, path, line_no)


def count_lines(path: Path) -> int:
    """The number of lines `iter_line_blocks` yields for the file, counted in its bytes (no decoding)."""
    count, last = 0, b"\n"
    with open_for_reading(path) as handle:
        while block := handle.read(_BLOCK_BYTES):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")  # a last line without its newline


def lines_at(path: Path, wanted: np.ndarray) -> list[str]:
    """The lines numbered `wanted` (0-based, ascending, unique) of a UTF-8 file, read in blocks and found by
    their newlines, decoding only those lines: a sample of 1M lines from a corpus of 90M in seconds."""
    found: list[str] = []
    for block, line_no in _whole_line_blocks(path):
        base = line_no - 1  # 0-based number of the block's first line
        newlines = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10)
        ends = np.append(newlines, len(block))  # (L,) where each of the block's lines ends
        low, high = np.searchsorted(wanted, [base, base + len(ends)])
        for line in wanted[low:high].tolist():
            index = line - base
            start = int(ends[index - 1]) + 1 if index else 0
            found += decode_lines(block[start : int(ends[index])], path, line + 1)
    return found


def read_lines(path: Path) -> list[str]:
    """All lines of a UTF-8 text file (for files that are decoded whole: test sets, CLI input)."""
    return [line for block in iter_line_blocks(Path(path)) for line in block]


def rechunk(blocks: Iterator[list[str]], size: int) -> Iterator[list[str]]:
    buffer: list[str] = []
    for block in blocks:
        buffer.extend(block)
        while len(buffer) >= size:
            yield buffer[:size]
            del buffer[:size]
    if buffer:
        yield buffer


def dangling_link(path: Path) -> str | None:
    """For a path that does not exist: what its symbolic link points to, if it is one (a loop, or a
    target that is gone); None for a plain missing path."""
    if not path.is_symlink():
        return None
    try:
        path.resolve(strict=True)
    except RuntimeError:  # Python before 3.13
        return "a symbolic link in a loop"
    except OSError as error:
        if error.errno == errno.ELOOP:
            return "a symbolic link in a loop"
    return f"a symbolic link to {os.readlink(path)}, which does not exist"


def file_stat(path: Path) -> tuple[int, int] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_size, info.st_mtime_ns


def hash_files(*paths: Path, memo: Path | None = None) -> str:
    """A hash of the files' bytes (each followed by a NUL byte). With `memo` (a directory), read from there
    when every file still has the identity it had when it was last hashed there: device, inode, size, and
    modification and change times in nanoseconds. The change time is the kernel's (no cp -p, rsync -a or
    touch -r sets it), so a file rewritten in any way is hashed again; a warm start skips reading 6 GB."""
    remembered = _memo_file(paths, memo)
    if remembered is not None:
        try:
            return json.loads(remembered.read_text())["hash"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
    digest = hashlib.sha256()
    for path in paths:
        with open_for_reading(path) as handle:
            while block := handle.read(_BLOCK_BYTES):
                digest.update(block)
        digest.update(b"\0")
    found = digest.hexdigest()[:16]
    if remembered is not None and _memo_file(paths, memo) == remembered:  # unchanged while it was read
        tmp = remembered.with_name(f".{remembered.name}.tmp{os.getpid()}")
        try:  # a memo: a directory that cannot take it hashes again next time
            remembered.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"files": [str(path) for path in paths], "hash": found}) + "\n")
            os.replace(tmp, remembered)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
    return found


def _memo_file(paths: tuple[Path, ...], memo: Path | None) -> Path | None:
    """Where `hash_files` keeps the hash of `paths` as they are now (their identities name the file)."""
    if memo is None:
        return None
    identities = []
    for path in paths:
        try:
            info = os.stat(path)
        except OSError:
            return None
        identities.append(
            [str(Path(path).resolve()), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]
        )
    return Path(memo) / (hashlib.sha256(json.dumps(identities).encode()).hexdigest()[:24] + ".json")
