"""Cached files that check themselves (the prepared corpora, the SentencePiece models).

Whoever writes a cache entry records every file's size and CRC-32 in a JSON record that carries its
own CRC-32; whoever reads the entry compares the files with the record first. A truncated, deleted or
overwritten file, or an unreadable record, is then a `CacheDamage` naming the file and what is wrong,
which the owner of the entry answers by building it again, never data read as if it were whole.
CRC-32 because zlib computes it at several GB/s (measured here: crc32 7.4, sha1 2.3, sha256 2.2,
blake2b 1.5 GB/s): checking a 4.5M-pair corpus costs a fraction of a second, and what it must catch
is damage, not an adversary.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import zlib
from pathlib import Path

from transformer.errors import CacheDamage, DataError

_BLOCK_BYTES = 16 << 20


def _crc32_of_file(path: Path) -> str:
    crc, block = 0, bytearray(_BLOCK_BYTES)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(block):
            crc = zlib.crc32(view[:count], crc)
    return f"{crc:08x}"


def file_record(path: Path) -> dict:
    """What a reader checks `path` against: its size and CRC-32."""
    return {"size": path.stat().st_size, "crc32": _crc32_of_file(path)}


def bytes_record(data: bytes) -> dict:
    return {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}


def _size_problem(size: int, expected: int) -> str | None:
    if size < expected:
        return f"truncated ({size} of {expected} bytes)"
    if size > expected:
        return f"{size} bytes where {expected} were written"
    return None


def check_file(path: Path, record: dict, checksum: bool = True) -> None:
    """Raise CacheDamage unless `path` has the recorded size (and, with `checksum`, CRC-32)."""
    try:
        mode = path.stat()
    except FileNotFoundError:
        raise CacheDamage(path, "missing") from None
    if not stat.S_ISREG(mode.st_mode):
        raise CacheDamage(path, "not a regular file")
    problem = _size_problem(mode.st_size, record["size"])
    try:
        if problem is None and checksum and _crc32_of_file(path) != record["crc32"]:
            problem = "checksum mismatch"
    except FileNotFoundError:  # moved aside meanwhile by a process repairing it under the lock
        problem = "missing"
    if problem:
        raise CacheDamage(path, problem)


def check_bytes(data: bytes, path: Path, record: dict) -> None:
    """Raise CacheDamage unless `data`, read from `path`, has the recorded size and CRC-32."""
    problem = _size_problem(len(data), record["size"])
    if problem is None and bytes_record(data)["crc32"] != record["crc32"]:
        problem = "checksum mismatch"
    if problem:
        raise CacheDamage(path, problem)


def _seal(body: dict) -> str:
    return f"{zlib.crc32(json.dumps(body, sort_keys=True).encode()):08x}"


def sealed(body: dict) -> str:
    """`body` as JSON with its own CRC-32 (so that an edited or damaged record is recognised)."""
    return json.dumps({**body, "crc32": _seal(body)}, indent=1) + "\n"


def read_cached_bytes(path: Path, unreadable: str = "unreadable") -> bytes:
    """The bytes of a cache file, or CacheDamage: missing, or `unreadable` (the OS's reason)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CacheDamage(path, "missing") from None
    except OSError as error:
        raise CacheDamage(path, f"{unreadable} ({error.strerror})") from None


def read_record(path: Path) -> dict:
    """The body of a `sealed` record, or CacheDamage (missing / unreadable metadata)."""
    text = read_cached_bytes(path, "unreadable metadata")
    try:
        record = json.loads(text)
    except ValueError:  # not UTF-8, or not JSON
        raise CacheDamage(path, "unreadable metadata (not JSON)") from None
    if not isinstance(record, dict) or "crc32" not in record:
        raise CacheDamage(path, "unreadable metadata (no checksum)")
    body = {key: value for key, value in record.items() if key != "crc32"}
    if _seal(body) != record["crc32"]:
        raise CacheDamage(path, "unreadable metadata (checksum mismatch)")
    return body


def write_failure(error: OSError, what: str, where: Path) -> DataError:
    """One line for a cache that cannot be written, with the fix for its cause: a full disk, no
    permission, a file where a directory belongs, a directory that cannot be made."""
    reason = os.strerror(error.errno) if error.errno else str(error)
    return DataError(
        f"{where}: cannot write {what}: {reason}; "
        f"{_WRITE_FIXES.get(error.errno, 'point data.cache_dir at a writable disk with room')}"
    )


_NO_ROOM = "free some space or point data.cache_dir at a disk with room"
_NOT_YOURS = "point data.cache_dir at a directory you can write to"
_FILE_IN_THE_WAY = "a file stands where the cache needs a directory: move it, or point data.cache_dir elsewhere"
_WRITE_FIXES = {  # errno of a failed cache write -> what to do
    errno.ENOSPC: _NO_ROOM,
    errno.EDQUOT: _NO_ROOM,
    errno.EACCES: _NOT_YOURS,
    errno.EPERM: _NOT_YOURS,
    errno.EROFS: "point data.cache_dir at a writable disk",
    errno.EEXIST: _FILE_IN_THE_WAY,
    errno.ENOTDIR: _FILE_IN_THE_WAY,
    errno.ENOENT: "data.cache_dir cannot be made there (a missing directory above it, or a system directory): "
    "point it elsewhere",
}
