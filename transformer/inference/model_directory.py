"""An exported model directory, either format: written in a staging directory and moved into place, its
manifest (the files it holds and their SHA-256 digests), and the `--force` rule (only a previous export is
replaced)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from transformer.data.tokenizer import Tokenizer
from transformer.errors import (
    SYMLINK_LOOP,
    CheckpointError,
    os_error_in,
    symlink_loop,
)

if TYPE_CHECKING:
    pass


FORMAT_NAME = "transformer-nmt"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
CARD_FILE = "README.md"
MANIFEST_FILE = "export-manifest.json"


TITLES_FILE = "titles.txt"  # inline casing's table of usual titles (data.usual_case), where the model has one
# The tokenizer files an export lists (config.json's "tokenizer"), sorted: the table comes last.
TOKENIZER_LAYOUTS = tuple(
    models + extra for models in (["spm.model"], ["src.spm.model", "tgt.spm.model"]) for extra in ([], [TITLES_FILE])
)


def tokenizer_files(tokenizer: Tokenizer) -> dict[str, bytes]:
    """File name -> SentencePiece model bytes (and inline casing's table), as both export formats lay them out."""
    if tokenizer.joint:
        files = {"spm.model": tokenizer.src_model_bytes}
    else:
        files = {"src.spm.model": tokenizer.src_model_bytes, "tgt.spm.model": tokenizer.tgt_model_bytes}
    return {**files, TITLES_FILE: tokenizer.titles_bytes} if tokenizer.titles_bytes else files


def output_directory(out: str | Path) -> Path:
    """The export's directory `out`, resolved; FileExistsError where it lies in a loop of symbolic links
    (which Path.resolve cannot follow)."""
    if symlink_loop(out):
        raise FileExistsError(f"{out}: is {SYMLINK_LOOP}; remove the link or choose another directory for the export")
    return Path(out).resolve()


def check_output_directory(out: Path, overwrite: bool) -> None:
    """Refuse an existing `out` unless `overwrite` (--force) and it holds a previous export's files and
    nothing else, and is not the directory this process runs in (or one above it)."""
    if not out.exists():
        return
    # What --force could not replace is said as such first: "pass --force" would only be refused next.
    if not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a directory; choose a new directory for the export")
    exported = _exported_files(out)
    unexpected = sorted(
        entry.name
        for entry in out.iterdir()
        if exported is None or entry.name not in exported or (entry.is_dir() and not entry.is_symlink())
    )
    if unexpected and exported is None:
        raise FileExistsError(
            f"{out}: is not an exported model (it holds {_listing(unexpected)}); --force replaces "
            "only a previous export and nothing else: choose a new directory"
        )
    if unexpected:
        raise FileExistsError(
            f"{out}: holds files the previous export did not write ({_listing(unexpected)}); "
            "--force replaces only a previous export and nothing else: move them out or choose a "
            "new directory"
        )
    here = Path.cwd().resolve()
    if out == here or out in here.parents:
        raise FileExistsError(
            f"{out}: is the current directory or holds it; run transformer-export from outside "
            "it to replace it, or choose a new directory"
        )
    if not overwrite:
        raise FileExistsError(f"{out}: already exists (an earlier export); pass --force to replace it")


def _exported_files(directory: Path) -> set[str] | None:
    """The names of the files a previous export wrote into `directory`: those its manifest lists (an hf
    export from before manifests: those its config.json names), or None when it holds no export."""
    try:
        files = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))["files"]
        return set(files) if isinstance(files, list) and all(isinstance(f, str) for f in files) else None
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # unreadable, not JSON, not a manifest
        return None
    try:
        meta = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if isinstance(meta, dict) and meta.get("format") == FORMAT_NAME and meta.get("tokenizer") in TOKENIZER_LAYOUTS:
        return {CONFIG_FILE, WEIGHTS_FILE, *meta["tokenizer"]}
    return None


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes in hex, as `sha256sum` prints it."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):  # hashlib.file_digest: Python 3.11 on
            digest.update(block)
    return digest.hexdigest()


def recorded_digests(folder: Path) -> dict:
    """The SHA-256 of each file as the export's manifest recorded it; {} for an export without digests
    (written before they were recorded) or without a readable manifest: the manifest is the export's
    record, not a file loading needs."""
    try:
        digests = json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8")).get("sha256", {})
    except (OSError, ValueError, AttributeError, RecursionError):
        return {}
    return digests if isinstance(digests, dict) else {}


def check_recorded_digest(folder: Path, name: str, digests: dict) -> None:
    """CheckpointError when `digests` (`recorded_digests`) has a SHA-256 for `name` and the file's bytes
    no longer have it (a disk, copy or transfer error)."""
    recorded = digests.get(name)
    if not isinstance(recorded, str) or not (folder / name).is_file():
        return  # a missing file is reported by whoever reads it
    if file_sha256(folder / name) != recorded.lower():
        raise CheckpointError(
            f"{folder / name}: damaged: its bytes no longer match the SHA-256 the export recorded "
            f"in {MANIFEST_FILE} (a disk, copy or transfer error); copy or download the exported "
            "directory again, or export it again from its checkpoint"
        )


def _listing(names: list[str], shown: int = 5) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def write_model_directory(
    out: str | Path, overwrite: bool, tokenizer: Tokenizer, build, export_format: str, sentencepiece: bool = True
) -> Path:
    """`build(directory)` creates a model directory (a path that does not exist yet, in a staging directory
    beside `out`); the SentencePiece model(s) (unless not `sentencepiece`: a format that writes them under
    names of its own) and the manifest are added and the whole is moved into place.
    A failed export leaves no half-written model behind and a previous export as it was; `--force`
    replaces only a previous export (check_output_directory)."""
    out = output_directory(out)
    check_output_directory(out, overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except (FileExistsError, NotADirectoryError):
        raise CheckpointError(
            f"{out}: cannot write the export: a part of {out.parent} is a file, not a directory"
        ) from None
    except OSError as error:
        raise CheckpointError(f"{out}: cannot write the export: {failure_reason(error)}") from None
    try:
        built = staging / "model"  # created by `build` with the usual permissions
        try:
            build(built)
            for name, data in (tokenizer_files(tokenizer) if sentencepiece else {}).items():
                (built / name).write_bytes(data)
            files = sorted([entry.name for entry in built.iterdir()] + [MANIFEST_FILE])
            digests = {entry.name: file_sha256(entry) for entry in sorted(built.iterdir()) if entry.is_file()}
            manifest = built / MANIFEST_FILE
            manifest.write_text(
                json.dumps({"format": export_format, "files": files, "sha256": digests}, indent=2) + "\n",
                encoding="utf-8",
            )
            for entry in built.iterdir():  # as the manifest: the umask's, not a writer's own
                shutil.copymode(manifest, entry)
        except (OSError, RuntimeError) as error:  # a full disk; CTranslate2 and safetensors wrap theirs
            raise CheckpointError(f"{out}: cannot write the export: {failure_reason(error)}") from None
        previous = staging / "previous"
        try:
            if out.exists():
                check_output_directory(out, overwrite)  # again: nothing was added while the model was built
                os.replace(out, previous)
            os.replace(built, out)
        except BaseException:
            if previous.exists() and not out.exists():
                os.replace(previous, out)
            raise
    finally:
        shutil.rmtree(staging)
    return out


def failure_reason(error: BaseException) -> str:
    """What made a write fail, in words: the OSError in its chain (a full disk is ENOSPC), the error
    code in a safetensors message, else the error's own first line."""
    cause = os_error_in(error)
    if cause is not None:
        return os.strerror(cause.errno)
    text = str(error).strip()
    code = re.search(r"\bOs \{ code: (\d+)", text)  # safetensors: IoError(Os { code: 28, ... })
    if code:
        return os.strerror(int(code.group(1)))
    return text.splitlines()[0][:200] if text else type(error).__name__
