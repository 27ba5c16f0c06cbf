"""Misuse, as a table: every hostile input ends with exit code 2, one line that names the problem (and the
fix), no traceback, and nothing on disk changed that should not be. Then the cases that need a running
process: a run directory held by another run, SIGTERM during validation, a full disk while saving."""

import errno
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import (
    FAST,
    INTERRUPTIBLE,
    ROOT,
    assert_one_line_refusal,
    compose_config,
    one_line,
    run_main,
    wait_for_log,
)
from transformer.checkpoint import load_checkpoint
from transformer.cli.average import main as average_main
from transformer.cli.evaluate import main as evaluate_main
from transformer.cli.translate import main as translate_main
from transformer.errors import TrainingError
from transformer.inference.search import beam_search
from transformer.inference.translator import Translator
from transformer.training.run_dir import RunDirectoryLock


def _snapshot(root: Path) -> dict:
    # `.lock` files are the run-directory locks a refused run may take and release: not content.
    return {
        p: (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.fixture
def workspace(tmp_path, untrained_checkpoint):
    """A run directory holding an untrained model's best.pt and last.pt (so refusals can be checked for
    leaving it untouched), an averaged checkpoint, a directory, an empty corpus and a plain file."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("best.pt", "last.pt"):
        shutil.copy(untrained_checkpoint, run / "checkpoints" / name)
    assert (
        average_main(
            [str(run / "checkpoints" / "best.pt"), str(run / "checkpoints" / "last.pt"), "-o", str(tmp_path / "avg.pt")]
        )
        == 0
    )
    (tmp_path / "folder").mkdir()
    (tmp_path / "blank").mkdir()
    for split, text in (("train", "\n  \n\n"), ("val", "Hallo\n")):
        for lang in ("de", "en"):
            (tmp_path / "blank" / f"{split}.{lang}").write_text(text)
    (tmp_path / "a_file").write_text("not a directory\n")
    (tmp_path / "in.de").write_text("Der Hund.\n")
    return tmp_path


def _train_cli(*args, timeout=180):
    proc = subprocess.run(
        [sys.executable, "-m", "transformer.train", *FAST, "trainer.max_steps=2", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout, proc.stderr


# The commands run in this process: main(argv) and the name that starts their refusals.
IN_PROCESS = {
    "translate": (translate_main, "transformer-translate"),
    "average": (average_main, "transformer-average"),
    "evaluate": (evaluate_main, "transformer-evaluate"),
}
BEST = "{ws}/run/checkpoints/best.pt"

# (id, runner, arguments with {ws} for the workspace, the one-line message expected on stderr)
CASES = [
    ("beam-0", "translate", [BEST, "--beam", "0", "--input", "{ws}/in.de"], r"--beam 0: must be a whole number >= 1"),
    (
        "nbest>beam",
        "translate",
        [BEST, "--beam", "2", "--nbest", "3", "--input", "{ws}/in.de"],
        r"--nbest 3: must be between 1",
    ),
    (
        "max-len-a<0",
        "translate",
        [BEST, "--max-len-a", "-5", "--input", "{ws}/in.de"],
        r"--max-len-a -5.0: must be a finite number >= 0",
    ),
    (
        "max-len-b<0",
        "translate",
        [BEST, "--max-len-b", "-1", "--input", "{ws}/in.de"],
        r"--max-len-b -1: must be a whole",
    ),
    (
        "alpha-nan",
        "translate",
        [BEST, "--alpha", "nan", "--input", "{ws}/in.de"],
        r"--alpha nan: must be a finite number",
    ),
    (
        "alpha-inf",
        "translate",
        [BEST, "--alpha", "inf", "--input", "{ws}/in.de"],
        r"--alpha inf: must be a finite number",
    ),
    (
        "batch-tokens-0",
        "translate",
        [BEST, "--batch-tokens", "0", "--input", "{ws}/in.de"],
        r"--batch-tokens 0: must be",
    ),
    (
        "output-is-dir",
        "translate",
        [BEST, "--input", "{ws}/in.de", "--output", "{ws}/folder"],
        r"--output .*/folder: is a directory; give a file name",
    ),
    (
        "ckpt-is-dir",
        "translate",
        ["{ws}/run", "--input", "{ws}/in.de"],
        r".*/run: is a directory, not a checkpoint file",
    ),
    ("ckpt-missing", "translate", ["{ws}/nope.pt", "--input", "{ws}/in.de"], r".*/nope.pt: no such checkpoint file"),
    ("input-missing", "translate", [BEST, "--input", "{ws}/nope.de"], r".*/nope.de: No such file or directory"),
    (
        "device-unknown",
        "translate",
        [BEST, "--device", "gpu0", "--input", "{ws}/in.de"],
        r"--device gpu0: must be auto, cpu, cuda or cuda:N",
    ),
    (
        "nbest>checkpoint-beam",
        "translate",
        [BEST, "--nbest", "7", "--input", "{ws}/in.de"],
        r"--nbest 7: the checkpoint's beam size is 5; add --beam 7",
    ),
    (
        "average-onto-input",
        "average",
        ["{ws}/run/checkpoints/best.pt", "{ws}/run/checkpoints/last.pt", "-o", "{ws}/run/checkpoints/last.pt"],
        r"-o .*last.pt: is one of the checkpoints",
    ),
    (
        "average-into-dir",
        "average",
        ["{ws}/run/checkpoints/best.pt", "-o", "{ws}/folder"],
        r"-o .*/folder: is a directory",
    ),
    ("average-nothing", "average", ["{ws}/folder", "-o", "{ws}/x.pt"], r".*/folder: no checkpoints/step_N.pt files"),
    (
        "evaluate-src-missing",
        "evaluate",
        [BEST, "--src", "{ws}/nope.de", "--ref", "{ws}/in.de"],
        r".*/nope.de: no such file",
    ),
    ("evaluate-half-pair", "evaluate", [BEST, "--src", "{ws}/in.de"], r"give both --src and --ref"),
    (
        "evaluate-src-directory",
        "evaluate",
        [BEST, "--src", "{ws}/folder", "--ref", "{ws}/in.de"],
        r"--src .*/folder: is a directory; give a file of one sentence per line",
    ),
    (
        "resume-averaged",
        "train",
        ["trainer.resume={ws}/avg.pt", "hydra.run.dir={ws}/new"],
        r".*avg.pt: holds weights only .* trainer.init_from=",
    ),
    ("run-dir-is-file", "train", ["hydra.run.dir={ws}/a_file"], r"hydra.run.dir=.*/a_file: is a file, not a directory"),
    (
        "blank-training-split",
        "train",
        ["data=multi30k_de_en", "data.path={ws}/blank", "data.cache_dir={ws}/cache", "hydra.run.dir={ws}/new"],
        r".*blank/train.de \+ train.en: no usable sentence to train the tokenizer on",
    ),
    (
        "init-from-other-shape",
        "train",
        ["model.d_model=32", "trainer.init_from=" + BEST, "hydra.run.dir={ws}/new"],
        r".*best.pt: weights do not fit this model",
    ),
    ("run-dir-of-another-run", "train", ["hydra.run.dir={ws}/run"], r".*/run/checkpoints already holds checkpoints"),
    (
        "own-corpus-with-toy",
        "train",
        ["data.path={ws}/blank", "hydra.run.dir={ws}/new"],
        r"data.path=.*/blank is set but data=toy is the embedded corpus.*make train data=custom data.path=",
    ),
    # --- issue 27: export and average (--force, damaged checkpoints, full disks: tests/misuse/test_misuse_export.py)
    (
        "average-onto-a-run-checkpoint",
        "average",
        [BEST, "-o", "{ws}/run/checkpoints/last.pt"],
        r"-o .*/last.pt: exists and is not an averaged checkpoint written by transformer-average; .* pass --force",
    ),
    (
        "average-onto-a-text-file",
        "average",
        [BEST, "-o", "{ws}/a_file"],
        r"-o .*/a_file: exists and is not an averaged checkpoint written by transformer-average",
    ),
    (
        "average-under-a-file",
        "average",
        [BEST, "-o", "{ws}/a_file/avg.pt"],
        r".*/a_file/avg.pt: cannot write the checkpoint: a part of .*/a_file is a file, not a directory",
    ),
    # --- issue 27: prepared data and caches
    (
        "data-path-is-a-device",
        "train",
        ["data=multi30k_de_en", "data.path=/dev/null", "hydra.run.dir={ws}/new"],
        r"data.path=/dev/null: is not a regular file or a directory \(it is a character device\)",
    ),
    # --- issue 27: training (values that cannot work are refused before training; non-finite weights unsaved)
    (
        "lr-inf",
        "train",
        ["trainer.lr=inf", "hydra.run.dir={ws}/new"],
        r"^error: trainer.lr=inf is not finite; give a finite number \(the default is 0.0007\)$",
    ),
    ("lr-nan", "train", ["trainer.lr=nan", "hydra.run.dir={ws}/new"], r"^error: trainer.lr=nan is not finite"),
    (
        "max-minutes-nan",
        "train",
        ["trainer.max_minutes=nan", "hydra.run.dir={ws}/new"],
        r"^error: trainer.max_minutes=nan is not finite",
    ),
    (
        "decode-alpha-nan",
        "train",
        ["decode.alpha=nan", "hydra.run.dir={ws}/new"],
        r"^error: decode.alpha=nan is not finite",
    ),
    (
        "max-positions-below-max-len",
        "train",
        ["model.max_positions=32", "hydra.run.dir={ws}/new"],
        r"model.max_positions=32 is too small for data.max_len=64: .* set model.max_positions=65 or more",
    ),
    (
        "lr-overflows-the-weights",
        "train",
        ["trainer.lr=1e300", "trainer.warmup=1", "hydra.run.dir={ws}/new"],
        r"^error: step 2: the weights are not finite \(.*\), so nothing was saved; .* no checkpoint was written before",
    ),
    # --- issue 27: translate and evaluate
    (
        "output-is-input",
        "translate",
        [BEST, "--input", "{ws}/in.de", "--output", "{ws}/in.de"],
        r"--output .*/in.de: is the --input file .*/in.de; writing the translations there would destroy it; "
        r"choose another",
    ),
    (
        "output-is-input-via-dotdot",
        "translate",
        [BEST, "--input", "{ws}/in.de", "--output", "{ws}/folder/../in.de"],
        r"--output .*/folder/../in.de: is the --input file .*/in.de; writing the translations there would destroy it",
    ),
    (
        "output-is-checkpoint",
        "translate",
        [BEST, "--input", "{ws}/in.de", "--output", BEST],
        r"--output .*/best.pt: is the checkpoint .*/best.pt; writing the translations there would destroy it",
    ),
    (
        "output-is-score-reference",
        "translate",
        [BEST, "--input", "{ws}/in.de", "--score-reference", "{ws}/a_file", "--output", "{ws}/a_file"],
        r"--output .*/a_file: is the --score-reference file",
    ),
    (
        "temperature-nan",
        "translate",
        [BEST, "--sampling", "topk:3", "--temperature", "nan", "--input", "{ws}/in.de"],
        r"--temperature nan: must be between 1e-6 and 1e6",
    ),
    (
        "temperature-inf",
        "translate",
        [BEST, "--temperature", "inf", "--input", "{ws}/in.de"],
        r"--temperature inf: must be between 1e-6 and 1e6",
    ),
    (
        "temperature-overflows",
        "translate",
        [BEST, "--sampling", "topk:2", "--temperature", "1e308", "--input", "{ws}/in.de"],
        r"--temperature 1e\+308: must be between 1e-6 and 1e6",
    ),
    (
        "seed-overflows",
        "translate",
        [BEST, "--sampling", "topk:2", "--seed", "99999999999999999999", "--input", "{ws}/in.de"],
        r"--seed 99999999999999999999: must be a whole number from 0",
    ),
    (
        "output-in-a-missing-directory",
        "translate",
        [BEST, "--input", "{ws}/in.de", "--output", "{ws}/no/such/out.txt"],
        r"--output .*/no/such/out.txt: no directory .*/no/such; create it first",
    ),
    ("empty-input-name", "translate", [BEST, "--input", ""], r"--input is empty \(an unset shell variable\?\)"),
    (
        "beam-beyond-the-vocabulary",
        "translate",
        [BEST, "--input", "{ws}/in.de", "--beam", "999"],
        r"--beam 999: the model's target vocabulary has \d+ pieces; give at most that",
    ),
    (
        "max-len-a-inf",
        "translate",
        [BEST, "--max-len-a", "inf", "--input", "{ws}/in.de"],
        r"--max-len-a inf: must be a finite number >= 0",
    ),
    (
        "evaluate-alpha-nan",
        "evaluate",
        [BEST, "--src", "{ws}/in.de", "--ref", "{ws}/in.de", "--alpha", "nan"],
        r"--alpha nan: must be a finite number >= 0",
    ),
]


# The cases that run the training command line are slow; the others refuse in a second.
@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.slow) if c[1] == "train" else c for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_hostile_input_table(case, workspace, capsys, data_cache):
    _, runner, args, pattern = case
    args = [a.format(ws=workspace) for a in args]
    before = _snapshot(workspace)
    if runner == "train":
        code, out, err = _train_cli(
            *args, f"data.cache_dir={data_cache}" if "data.cache_dir" not in " ".join(args) else "trainer.seed=1"
        )
        prog = None  # training's refusals start "error: "
    else:
        main, prog = IN_PROCESS[runner]
        code, out, err = run_main(main, capsys, *args)
    assert code == 2, (out, err)
    assert "Traceback" not in out
    assert_one_line_refusal(err, prog, pattern)
    after = _snapshot(workspace)
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    # A refused training run may leave only its own new directory behind (Hydra's log), never touch others.
    assert all(workspace / "new" in p.parents or workspace / "cache" in p.parents for p in changed), changed


@pytest.mark.slow
def test_resume_true_passes_over_a_weights_only_checkpoint(trained_run, tmp_path):
    from transformer.config import TrainerConfig
    from transformer.distributed import DistInfo
    from transformer.training.resume import find_resume_state

    checkpoints = tmp_path / "checkpoints"  # a run's checkpoints: last.pt can resume it
    shutil.copytree(trained_run[0] / "checkpoints", checkpoints)
    assert average_main([str(checkpoints / "last.pt"), "-o", str(checkpoints / "avg.pt")]) == 0  # same step
    state = find_resume_state(TrainerConfig(resume=True, max_steps=1), checkpoints, DistInfo())
    assert "optimizer" in state and state["step"] == load_checkpoint(checkpoints / "last.pt")["step"]


def test_the_table_covers_every_command_and_each_case_can_fail():
    """Every command the table runs has cases; no two cases share an id (pytest would suffix the second
    silently) or the same command line; each expected message is a regular expression that an empty or
    unrelated line does not match; and every training case runs in the workspace (hydra.run.dir), so a
    refusal that still wrote something would be seen there and not in the repository's outputs/."""
    assert {c[1] for c in CASES} == {*IN_PROCESS, "train"}
    ids = [c[0] for c in CASES]
    assert len(set(ids)) == len(ids), sorted(i for i in ids if ids.count(i) > 1)
    command_lines = [(runner, tuple(args)) for _, runner, args, _ in CASES]
    assert len(set(command_lines)) == len(command_lines)
    for case_id, runner, args, pattern in CASES:
        assert args and all(isinstance(a, str) for a in args), case_id
        assert re.compile(pattern).search("") is None, case_id
        assert re.search(pattern, "error: something else went wrong") is None, case_id
        if runner == "train":
            assert any(a.startswith("hydra.run.dir={ws}/") for a in args), case_id


def test_translator_api_refuses_what_the_cli_refuses(untrained_checkpoint):
    translator = Translator.from_checkpoint(untrained_checkpoint, device="cpu")
    assert translator.translate(iter(["Der Hund.", ""])) == translator.translate(["Der Hund.", ""])
    assert translator.translate(["Der Hund."], beam_size=np.int64(2)) == translator.translate(
        ["Der Hund."], beam_size=2
    )
    for bad in ("Der Hund.", [None], [5], [b"Der Hund."], iter(["ok", 5])):
        with pytest.raises(TypeError, match=r"sentences must be a list of str \(got \w+\)"):
            translator.translate(bad)
    for options, name in (
        ({"alpha": math.nan}, "alpha"),
        ({"max_len_a": -5}, "max_len_a"),
        ({"beam_size": 0}, "beam_size"),
        ({"batch_tokens": 0}, "batch_tokens"),
    ):
        with pytest.raises(ValueError, match=name):
            translator.translate(["Der Hund."], **options)


@pytest.mark.slow
def test_beam_sizes_up_to_and_beyond_the_vocabulary(trained_checkpoint):
    from tests.inference.test_search import A, B, TableDecoder

    best = {}
    for beam in range(1, 12):  # the table has 6 entries (4 that can be generated)
        (hyps,) = beam_search(TableDecoder(), torch.tensor([6]), beam_size=beam, nbest=1)
        assert math.isfinite(hyps[0].score)
        best[beam] = hyps[0].tokens
    assert best[1] == [A, A] and all(best[b] == [B] for b in range(2, 12))
    translator = Translator.from_checkpoint(trained_checkpoint, device="cpu")
    vocab = translator.tokenizer.tgt_vocab_size
    reference = translator.translate(["Der Hund.", "Die Katze sieht den Hund."], beam_size=5)
    assert all(reference)
    for beam in (vocab // 2 + 1, vocab):  # beyond the vocabulary: refused (the search copes: above)
        for hyps in translator.translate_hypotheses(
            ["Der Hund.", "Die Katze sieht den Hund."], beam_size=beam, nbest=3
        ):
            scores = [score for _, score in hyps]
            assert len(hyps) == 3 and all(text for text, _ in hyps)
            assert all(math.isfinite(s) for s in scores) and scores == sorted(scores, reverse=True)
    with pytest.raises(ValueError, match=f"beam_size={vocab + 7}: the model's target vocabulary has {vocab} pieces"):
        translator.translate(["Der Hund."], beam_size=vocab + 7)


@pytest.mark.slow
def test_a_second_run_into_a_busy_run_directory_is_refused_and_the_first_is_unharmed(tmp_path, data_cache):
    run_dir = tmp_path / "shared"
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "transformer.train",
            *FAST,
            "trainer.max_steps=40",
            "trainer.validate_every=20",
            "trainer.val_max_sentences=4",
            "trainer.test_at_end=false",
            f"data.cache_dir={data_cache}",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for_log(run_dir / "train.log", "training pairs", 120)  # Hydra has written .hydra/, the run started
    config_before = (run_dir / ".hydra" / "config.yaml").read_bytes()
    code, out, err = _train_cli("trainer.lr=1e-4", f"data.cache_dir={data_cache}", f"hydra.run.dir={run_dir}")
    assert code == 2 and "Traceback" not in err
    assert re.fullmatch(
        rf"error: {re.escape(str(run_dir))} is in use by another training run \(pid {first.pid} on "
        r"\S+ since [\d: -]+\); wait for it to end or choose another hydra.run.dir",
        err.strip(),
    ), err
    assert (run_dir / ".hydra" / "config.yaml").read_bytes() == config_before  # its config untouched
    assert first.wait(timeout=300) == 0, first.stdout.read()
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"] == 40
    assert "lr: 0.0001" not in (run_dir / ".hydra" / "config.yaml").read_text()


def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from transformer.training.run_dir import RunDirectoryLock as L; "
            "L.acquire(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(TrainingError, match=f"in use by another training run \\(pid {holder.pid} "):
        RunDirectoryLock.acquire(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert "pid" in (tmp_path / ".lock").read_text()  # the file stays; the lock went with the process
    lock = RunDirectoryLock.acquire(tmp_path)
    assert f"pid {os.getpid()}" in (tmp_path / ".lock").read_text()
    lock.release()


@pytest.mark.slow
def test_sigterm_during_validation_saves_and_exits_within_seconds(tmp_path, data_cache):
    # An untrained model decodes every validation sentence to its length limit: a long validation.
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "transformer.train",
            *FAST,
            "trainer.max_steps=1000",
            "trainer.validate_every=3",
            "trainer.val_max_sentences=0",
            "decode.max_len_b=200",
            "decode.max_len_a=3",
            "trainer.val_beam_size=4",
            "decode.batch_tokens=64",
            f"data.cache_dir={data_cache}",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for_log(run_dir / "train.log", "validating at step 3", 120)
    time.sleep(1.0)  # well inside the validation decode
    proc.send_signal(signal.SIGTERM)
    sent = time.time()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert time.time() - sent < 15, "the run took too long to stop"
    assert "validation at step 3 interrupted by SIGTERM" in out
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"] == 3
    assert "validation step 3 |" not in (run_dir / "train.log").read_text()  # no half validation was reported


@pytest.mark.slow
def test_disk_full_while_saving_names_the_file_and_the_last_good_checkpoint(tmp_path, data_cache, monkeypatch):
    import transformer.checkpoint as checkpoint
    from transformer.training.trainer import train

    real_save, calls = torch.save, {"n": 0}

    def save_until_full(obj, handle, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] <= 2:  # last.pt (everything) and step_2.pt (the weights) fit
            return real_save(obj, handle, *args, **kwargs)
        handle.write(b"partial")
        try:  # what torch does: ENOSPC only in the chain
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as error:
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4096 vs 0") from error

    monkeypatch.setattr(checkpoint.torch, "save", save_until_full)
    cfg = compose_config(
        FAST
        + [
            "trainer.max_steps=6",
            "trainer.checkpoint_every=2",
            "trainer.validate_every=100",
            "trainer.test_at_end=false",
        ],
        data_cache,
    )
    with pytest.raises(TrainingError) as error:
        train(cfg, tmp_path)
    message = str(error.value)
    assert re.fullmatch(
        r".*/checkpoints/last.pt: cannot write the checkpoint: No space left on device; "
        r"the last good checkpoint is .*/checkpoints/last.pt",  # written first; the one of step 2 still whole
        message,
    ), message
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["last.pt", "step_2.pt"]  # no temporary file left behind
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["step"] == 2


@pytest.mark.slow
def test_a_test_split_the_end_could_not_read_is_said_before_training(tmp_path, data_cache, caplog):
    """A corpus without a test split (or a broken one) was found out only after the whole run."""
    from transformer.training.trainer import train

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split, count in (("train", 300), ("validation", 20)):
        (corpus / f"{split}.tsv").write_text(
            "".join(f"Satz {i} über Haus {i % 17} .\tSentence {i} about house {i % 17} .\n" for i in range(count)),
            encoding="utf-8",
        )
    (corpus / "test.de").write_text("eins\nzwei\n", encoding="utf-8")
    (corpus / "test.en").write_text("one\n", encoding="utf-8")
    cfg = compose_config(
        FAST
        + [
            "data=custom",
            f"data.path={corpus}",
            "data.vocab_size=100",
            "trainer.max_steps=2",
            "trainer.validate_every=100",
            "trainer.test_at_end=true",
        ],
        data_cache,
    )
    with caplog.at_level(logging.INFO, logger="transformer"):
        train(cfg, tmp_path / "run")
    messages = [r.getMessage() for r in caplog.records]
    early = next(i for i, m in enumerate(messages) if m.startswith("no test split to score at the end of this run"))
    assert re.search(r"line counts differ: .*test\.de has 2 lines, .*test\.en has 1", messages[early]), messages[early]
    assert early < next(i for i, m in enumerate(messages) if m.startswith("step ") or m.startswith("reached"))


def _python(code: str, *, path: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (path, ROOT) if p)}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, **INTERRUPTIBLE
    )


def test_a_ctrl_c_while_torch_loads_is_delivered_after_the_import_not_lost(tmp_path):
    """A SIGINT that arrives while torch's C library loads (a tenth of a second of `import torch`, here)
    was lost: the command ran on. A stand-in torch that loses one the same way: held back, it arrives
    as the import returns."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        "import os, signal, time\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(0.2)\n"
        "except KeyboardInterrupt:\n"
        "    pass       # lost, as in the C library's load\n"
        "LOADED = True\n"
    )
    held = (
        "import sys\nfrom transformer.errors import import_torch_holding_interrupts\n"
        "try:\n    import_torch_holding_interrupts()\n"
        "except KeyboardInterrupt:\n    print('interrupted after the import:', sys.modules['torch'].LOADED)\n"
        "else:\n    print('ran on')\n"
    )
    assert _python(held, path=tmp_path).stdout == "interrupted after the import: True\n"
    assert (
        _python(held.replace("import_torch_holding_interrupts()", "import torch"), path=tmp_path).stdout == "ran on\n"
    )  # what happened before


def test_after_the_interrupted_message_a_second_ctrl_c_ends_the_process_quietly():
    proc = _python(
        "import os, signal, time\nfrom transformer.errors import next_interrupt_ends_at_once\n"
        "next_interrupt_ends_at_once()\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(10)\n"
        "print('still running')\n"
    )
    assert proc.returncode == -signal.SIGINT and proc.stdout == "" and proc.stderr == ""


@pytest.mark.parametrize("handled", [False, True])
def test_an_interrupt_that_passed_through_embedded_code_still_exits_130(tmp_path, handled):
    """A KeyboardInterrupt raised inside code torch runs through `PyRun_String` (pybind11) left CPython's
    "unhandled interrupt" flag set although the command caught it: the process then killed itself with
    SIGINT at exit, status -2 after the one-line message (seen in CI, one start in ten under load). The
    unhandled case shows that the mechanism is real; the handled one that the commands' path clears it.
    Run with -m, as the commands are (`python -c` exits before the flag is looked at)."""
    (tmp_path / "interrupted_inside.py").write_text(
        "import ctypes, sys\n"
        "from transformer.errors import next_interrupt_ends_at_once\n"
        "run = ctypes.pythonapi.PyRun_String\n"
        "run.restype = ctypes.py_object\n"
        "run.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object]\n"
        "try:\n"
        "    run(b'raise KeyboardInterrupt', 257, {}, {})     # 257: Py_file_input\n"
        "except KeyboardInterrupt:\n"
        f"    if {handled}:\n"
        "        next_interrupt_ends_at_once()\n"
        "    print('interrupted', file=sys.stderr)\n"
        "    sys.exit(130)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    proc = subprocess.run(
        [sys.executable, "-m", "interrupted_inside"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.stderr.strip() == "interrupted", proc.stderr
    if not handled and proc.returncode == 130:
        pytest.skip("this Python does not kill itself for an interrupt that passed through PyRun_String")
    assert proc.returncode == (130 if handled else -signal.SIGINT)


def test_ctrl_c_while_training_starts_is_one_line_and_exit_130(tmp_path):
    """Ctrl-C in the first seconds of `make train` (imports, Hydra, the run directory's checks) printed a
    traceback of whatever was loading."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "transformer.cli.train",
            *FAST,
            "trainer.max_steps=3",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **INTERRUPTIBLE,
    )
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in one_line(err), err
