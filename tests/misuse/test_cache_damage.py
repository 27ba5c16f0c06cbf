"""Damage to what `make prepare` wrote is found when it is opened: every prepared file and every cached
SentencePiece model, truncated, overwritten with plausible data, deleted, or with its metadata damaged,
is built again with one warning that names the file and what was wrong (the rebuilt cache equals the
original byte for byte), or refused with one line where it cannot be. Then what may go wrong while
preparing: a full disk, Ctrl-C, another process repairing the same cache."""

import errno
import logging
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import transformer.data.corpus as corpus_module
from tests.helpers import INTERRUPTIBLE, ROOT
from transformer.cli.prepare import main as prepare_command
from transformer.config import DataConfig
from transformer.data.corpus import DATA_FILES
from transformer.data.prepare import prepare
from transformer.data.sources import DataError, InMemory

SETTINGS = dict(name="unit", embedded=True, embedded_pairs=300, vocab_size=80)
OVERRIDES = ["data=toy", "data.embedded_pairs=300", "data.vocab_size=80"]  # the same, for the CLI


def _prepare(cache: Path):
    return prepare(DataConfig(**SETTINGS, cache_dir=str(cache)))


def _contents(cache: Path) -> dict[str, bytes]:
    """Every file of the cache (lock files aside: taking a lock is not a change)."""
    return {
        str(p.relative_to(cache)): p.read_bytes()
        for p in sorted(cache.rglob("*"))
        if p.is_file() and not p.name.endswith(".lock")
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("pristine")
    _prepare(cache)
    return cache


@pytest.fixture
def cache(tmp_path, pristine) -> Path:
    shutil.copytree(pristine, tmp_path / "cache")
    return tmp_path / "cache"


def _train_dir(cache: Path) -> Path:
    (directory,) = (cache / "corpus").glob("unit.train.*")
    return directory


def _same_size_other_content(path: Path) -> None:
    """Overwrite `path` with data of the same size that reads as valid (in-range ids, rising offsets,
    known flags, well-formed JSON) but is not what was prepared: only a checksum can tell."""
    if path.suffix == ".ids":
        np.roll(np.fromfile(path, dtype=np.uint16), 1).tofile(path)
    elif path.name.endswith("offsets.npy"):
        offsets = np.load(path)
        offsets[1] += 1  # pair 0 one id longer, pair 1 one shorter
        np.save(path, offsets)
    elif path.name == "flags.npy":
        flags = np.load(path)
        flags[0] ^= corpus_module.FLAG_BLANK
        np.save(path, flags)
    else:  # meta.json, or a SentencePiece model's record
        text = path.read_text()
        edited = text.replace('"dtype": "uint16"', '"dtype": "uint32"').replace('"vocab_size": 80', '"vocab_size": 81')
        assert len(edited) == len(text) and edited != text
        path.write_text(edited)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGES = {
    "truncated": _truncate,
    "other content": _same_size_other_content,
    "deleted": Path.unlink,
    "garbage": lambda path: path.write_bytes(b"\x00\xff not what was written {"),
    "empty": lambda path: path.write_bytes(b""),
}
EXPECTED = {  # damage -> what the warning says, for a data file / for a metadata file
    "truncated": (r"truncated \(\d+ of \d+ bytes\)", r"unreadable metadata \(not JSON\)"),
    "other content": (r"checksum mismatch", r"unreadable metadata \(checksum mismatch\)"),
    "deleted": (r"missing", r"missing"),
    "garbage": (r"truncated \(\d+ of \d+ bytes\)", r"unreadable metadata \(not JSON\)"),
    "empty": (r"truncated \(0 of \d+ bytes\)", r"unreadable metadata \(not JSON\)"),
}


def _one_warning(caplog, path: Path, problem: str) -> str:
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert re.fullmatch(rf"{re.escape(str(path))}: {problem}; .* again", warnings[0]), warnings[0]
    return warnings[0]


def test_the_pristine_cache_is_prepared_without_warnings(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        _prepare(tmp_path)
        _prepare(tmp_path)  # the second run reads and checks it
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert caplog.text.count("prepared corpus") == 2


@pytest.mark.parametrize("damage", ["truncated", "other content", "deleted", "empty"])
@pytest.mark.parametrize("name", [*DATA_FILES, "meta.json"])
def test_a_damaged_prepared_file_is_rebuilt_with_one_warning(cache, pristine, caplog, name, damage):
    path = _train_dir(cache) / name
    DAMAGES[damage](path)
    with caplog.at_level(logging.INFO):
        prepared = _prepare(cache)
    _one_warning(caplog, path, EXPECTED[damage][name == "meta.json"])
    assert _contents(cache) == _contents(pristine)  # the same files, and nothing moved aside left over
    expected = prepare(DataConfig(**SETTINGS, cache_dir=str(pristine))).train
    assert [prepared.train.ids(i) for i in range(len(expected))] == [expected.ids(i) for i in range(len(expected))]


GERMAN = ["Ein Mann in einem blauen Hemd steht auf einer Leiter.", "Zwei junge Mädchen spielen am Strand im Sand."]
ENGLISH = ["A man in a blue shirt is standing on a ladder.", "Two young girls are playing in the sand at the beach."]
FRENCH = ["Un homme en chemise bleue est debout sur une échelle.", "Deux jeunes filles jouent dans le sable."]


def _prepare_with_langid(cache: Path):
    """data.langid=true over pairs of which a third have a French target: 20 of 60 are dropped."""
    src, tgt = (GERMAN * 3) * 10, (ENGLISH + ENGLISH + FRENCH) * 10
    sources = {"train": InMemory(src, tgt, "unit"), "validation": InMemory(GERMAN, ENGLISH[::-1], "unit")}
    config = DataConfig(**SETTINGS, cache_dir=str(cache), langid=True, drop_duplicates=False)
    return prepare(config, sources=sources)


@pytest.fixture(scope="module")
def pristine_langid(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("pristine-langid")
    assert len(_prepare_with_langid(cache).train) == 40
    return cache


def _zeroed(path: Path) -> None:
    flags = np.load(path)
    np.save(path, np.zeros_like(flags))  # same size, flags that keep every pair


@pytest.mark.parametrize(
    "name, damage, problem",
    [
        ("langid.de-en.npy", _zeroed, r"checksum mismatch"),
        ("langid.de-en.npy", _truncate, r"truncated \(\d+ of \d+ bytes\)"),
        ("langid.de-en.json", DAMAGES["garbage"], r"unreadable metadata \(not JSON\)"),
        ("langid.de-en.json", Path.unlink, r"missing"),
    ],
)
def test_damaged_language_flags_are_identified_again_with_one_warning(
    tmp_path, pristine_langid, caplog, name, damage, problem
):
    """The language flags of data.langid were outside the checksums: zeroed, they dropped no pair, silently."""
    cache = tmp_path / "cache"
    shutil.copytree(pristine_langid, cache)
    damage(_train_dir(cache) / name)
    with caplog.at_level(logging.INFO):
        prepared = _prepare_with_langid(cache)
    warning = _one_warning(caplog, _train_dir(cache) / name, problem)
    assert warning.endswith("; data.langid: identifying the languages again")
    assert len(prepared.train) == 40
    assert _contents(cache) == _contents(pristine_langid)


def test_unreadable_metadata_is_rebuilt_with_one_warning(cache, pristine, caplog):
    path = _train_dir(cache) / "meta.json"
    DAMAGES["garbage"](path)
    with caplog.at_level(logging.INFO):
        _prepare(cache)
    _one_warning(caplog, path, r"unreadable metadata \(not JSON\)")
    assert _contents(cache) == _contents(pristine)


@pytest.mark.parametrize("damage", ["garbage", "empty", "truncated", "deleted", "other content"])
@pytest.mark.parametrize("which", ["model", "record"])
def test_a_damaged_sentencepiece_model_is_trained_again_with_one_warning(cache, pristine, caplog, which, damage):
    (model,) = (cache / "spm").glob("*.model")
    path = model if which == "model" else model.with_name(model.name.split(".")[0] + ".json")
    if damage == "other content" and which == "model":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF  # one byte flipped inside the model
        path.write_bytes(bytes(data))
    else:
        DAMAGES[damage](path)
    expected = EXPECTED[damage]
    with caplog.at_level(logging.INFO):
        _prepare(cache)
    _one_warning(caplog, path, expected[which == "record"])
    assert "training SentencePiece again" in caplog.text
    assert _contents(cache) == _contents(pristine)  # the same model again, the corpus still valid


def test_a_split_that_cannot_be_moved_aside_is_refused_with_one_line(cache, monkeypatch):
    path = _train_dir(cache) / "src.ids"
    _truncate(path)

    def refuse(*args):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(corpus_module.os, "rename", refuse)
    with pytest.raises(DataError) as error:
        _prepare(cache)
    message = str(error.value)
    assert "\n" not in message
    assert re.fullmatch(
        rf"{re.escape(str(path))}: truncated \(\d+ of \d+ bytes\), and {re.escape(str(path.parent))} "
        r"cannot be moved aside to prepare it again \(Permission denied\); delete it",
        message,
    )


def test_damage_after_the_check_is_refused_where_it_cannot_be_repaired(cache):
    train = _prepare(cache).train
    _truncate(_train_dir(cache) / "tgt.ids")
    with pytest.raises(
        DataError,
        match=r"tgt.ids: truncated \(\d+ of \d+ bytes\): the prepared corpus was damaged "
        r"after it was checked; run `make prepare` again",
    ):
        pickle.loads(pickle.dumps(train))  # what a DataLoader worker does


REPAIR = """
import logging, sys
from transformer.config import DataConfig
from transformer.data.prepare import prepare
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
print("pairs", len(prepare(DataConfig(**eval(sys.argv[2]), cache_dir=sys.argv[1])).train))
"""


def test_concurrent_processes_repair_a_damaged_split_once(cache, pristine):
    _same_size_other_content(_train_dir(cache) / "src.ids")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", REPAIR, str(cache), repr(SETTINGS)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert all("pairs 300" in out for out in outputs)
    assert sum(out.count("WARNING") for out in outputs) == 1, outputs
    assert sum(out.count("checksum mismatch; preparing unit.train again") for out in outputs) == 1
    assert _contents(cache) == _contents(pristine)


def _prepare_cli(capsys, cache: Path) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        prepare_command([*OVERRIDES, f"data.cache_dir={cache}"])
    return exit_.value.code, capsys.readouterr().err


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_encoding_is_one_line_and_leaves_nothing_half_written(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"

    def save_part_then_fail(path, array):
        Path(path).write_bytes(b"\x93NUMPY part")  # what a write that runs out of room leaves
        _no_space()

    monkeypatch.setattr(corpus_module.np, "save", save_part_then_fail)
    code, err = _prepare_cli(capsys, cache)
    assert code == 2 and "Traceback" not in err
    assert re.fullmatch(
        rf"error: {re.escape(str(cache))}/corpus/toy.train.\w+: cannot write the prepared corpus: "
        r"No space left on device; free some space or point data.cache_dir at a disk with room\n",
        err,
    ), err
    assert list((cache / "corpus").iterdir()) == []  # no temporary directory left
    assert len(list((cache / "spm").iterdir())) == 2  # the SentencePiece model and its record are whole


def test_a_full_disk_while_saving_the_sentencepiece_model_is_one_line(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    real_write = Path.write_bytes

    def write_part_then_fail(path, data):
        real_write(path, data[:100])
        _no_space()

    monkeypatch.setattr(Path, "write_bytes", write_part_then_fail)
    code, err = _prepare_cli(capsys, cache)
    assert code == 2 and "Traceback" not in err
    assert re.fullmatch(
        rf"error: {re.escape(str(cache))}/spm: cannot write the SentencePiece model: No space left "
        r"on device; .*\n",
        err,
    ), err
    assert list((cache / "spm").iterdir()) == []


INTERRUPTED = """
import sys, time
import transformer.data.corpus as corpus
def slow(tmp, *args):
    (tmp / "src.ids").write_bytes(b"part of the ids")
    print("encoding", flush=True)
    time.sleep(60)
corpus._write_split = slow
from transformer.cli.prepare import main
main(sys.argv[1:])
"""


def test_ctrl_c_while_preparing_is_one_line_exit_130_and_leaves_nothing_half_written(tmp_path):
    cache = tmp_path / "cache"
    proc = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED, *OVERRIDES, f"data.cache_dir={cache}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **INTERRUPTIBLE,
    )
    for line in proc.stdout:
        if line.strip() == "encoding":
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err
    assert re.fullmatch(
        r"interrupted: preparation stopped; what was finished is kept, nothing half-written is left "
        r"\(run it again to finish\)\n",
        err,
    ), err
    assert list((cache / "corpus").iterdir()) == []
    assert len(list((cache / "spm").iterdir())) == 2


@pytest.mark.parametrize(
    "cache_dir, words",
    [
        ("a_file", "a file stands where the cache needs a directory: move it, or point data.cache_dir elsewhere"),
        ("a_file/below", "a file stands where the cache needs a directory"),
        ("read_only/cache", "point data.cache_dir at a directory you can write to"),
    ],
)
def test_a_cache_directory_that_cannot_be_made_gets_the_fix_for_its_cause(tmp_path, capsys, cache_dir, words):
    """Every write failure advised "free some space", also for a file in the way or no permission."""
    (tmp_path / "a_file").write_text("x\n")
    (tmp_path / "read_only").mkdir()
    (tmp_path / "read_only").chmod(0o500)
    try:
        if os.access(tmp_path / "read_only", os.W_OK) and cache_dir.startswith("read_only"):
            pytest.skip("running as a user who may write anywhere")
        code, err = _prepare_cli(capsys, tmp_path / cache_dir)
    finally:
        (tmp_path / "read_only").chmod(0o700)
    assert code == 2 and words in err and "free some space" not in err and err.count("\n") == 1, err
