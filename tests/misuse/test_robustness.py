"""Hostile input and crashes: random bytes through the CLI and the corpus loader, SIGKILL at random
moments (checkpoint writes included) followed by an exact resume."""

import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.helpers import FAST, ROOT
from transformer.checkpoint import load_checkpoint
from transformer.cli.translate import main as translate_main
from transformer.config import DataConfig
from transformer.data.sources import DataError, load_split_text

lines_of_bytes = st.lists(st.binary(max_size=60).filter(lambda b: b"\n" not in b), max_size=6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=lines_of_bytes, text=st.text(max_size=80))
def test_translate_cli_survives_random_bytes_and_unicode(untrained_checkpoint, tmp_path, lines, text):
    source = tmp_path / "in.txt"
    payload = b"\n".join(lines + [text.replace("\n", " ").replace("\r", " ").encode("utf-8", "surrogatepass")])
    source.write_bytes(payload + b"\n")
    output = tmp_path / "out.txt"
    assert (
        translate_main([str(untrained_checkpoint), "--input", str(source), "--output", str(output), "--beam", "2"]) == 0
    )
    expected = payload.count(b"\n") + 1
    assert output.read_text(encoding="utf-8").count("\n") == expected


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(src=st.binary(max_size=200), tgt=st.binary(max_size=200))
@example(src=b"", tgt=b"\xfe\xff")  # a UTF-16 byte-order mark: the message says so
def test_corpus_loader_aligns_or_refuses_with_a_message(tmp_path, src, tgt):
    (tmp_path / "train.de").write_bytes(src)
    (tmp_path / "train.en").write_bytes(tgt)
    try:
        de, en = load_split_text(DataConfig(path=str(tmp_path)), "train")
    except DataError as error:  # the only two ways bytes can be refused, each naming file(s) and line
        message = str(error)
        utf8 = (
            r".*/train\.(de|en):\d+: invalid UTF-8 \(byte 0x[0-9a-f]{2} at column \d+(; the file is UTF-16)?\); "
            r"re-encode .*"
        )
        assert re.fullmatch(utf8, message) or re.fullmatch(
            r"line counts differ: .*/train\.de has \d+ lines, .*/train\.en has \d+; .*", message
        ), message
        return
    assert len(de) == len(en)
    assert all("\n" not in line for line in de + en)


SLOW_SAVE = """
import sys, time, torch
import transformer.checkpoint as checkpoint
real_save = torch.save
def slow_save(obj, f, *args, **kwargs):
    real_save(obj, f, *args, **kwargs)
    time.sleep(0.4)           # widen the window in which a kill lands mid-write
checkpoint.torch.save = slow_save
from transformer.cli.train import main
sys.argv = ["train", *sys.argv[1:]]
main()
"""


def _start(args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", SLOW_SAVE, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_matches_an_uninterrupted_run(tmp_path, data_cache):
    common = FAST + [
        "trainer.precision=fp32",
        "trainer.device=cpu",
        "trainer.validate_every=1000",
        "trainer.checkpoint_every=2",
        "trainer.keep_last=2",
        "trainer.test_at_end=false",
        "trainer.max_minutes=0",
        "trainer.num_threads=1",
        "model.dropout=0.1",
        "trainer.max_steps=16",
        f"data.cache_dir={data_cache}",
    ]
    reference = tmp_path / "reference"
    assert _start(common + [f"hydra.run.dir={reference}"]).wait(timeout=300) == 0
    common.append("trainer.num_workers=2")  # killed and resumed runs collate in DataLoader workers
    expected = load_checkpoint(reference / "checkpoints" / "last.pt")["model"]
    rng = random.Random(7)
    for attempt in range(3):
        run_dir = tmp_path / f"killed{attempt}"
        proc = _start(common + [f"hydra.run.dir={run_dir}"])
        # wait for the first checkpoint, then kill at a random moment of the run
        deadline = time.time() + 120
        while time.time() < deadline and not (run_dir / "checkpoints").exists():
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 2.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        survivors = sorted(p.name for p in (run_dir / "checkpoints").glob("*.pt"))
        for name in survivors:  # whatever is there is complete and loadable
            load_checkpoint(run_dir / "checkpoints" / name)
        resumed = _start(common + [f"hydra.run.dir={run_dir}", "trainer.resume=true"])
        assert resumed.wait(timeout=300) == 0
        final = load_checkpoint(run_dir / "checkpoints" / "last.pt")
        assert final["step"] == 16
        for name, value in expected.items():
            assert torch.equal(final["model"][name], value), (attempt, name)
