"""One override that exhausts the machine, or overflows later with a traceback (issue 71, classes 5 and 6).

- every count and size key of the schema has a range: a value beyond it is one line naming the key and the
  range, before anything is written (not workers forked until the OOM killer acts, a model built layer by
  layer for hours, an OverflowError from numpy or torch at the first step);
- a negative seed or Adam epsilon, an impossible --nproc_per_node or --nnodes: one line, exit 2;
- SIGTERM before the first step ends the run at once (one line, 143), wherever it is;
- a rank whose peer went says so in one line, not gloo's traceback.
"""

import copy
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, assert_one_line_refusal, compose_config, one_line
from transformer.config import (
    Config,
    ConfigError,
    DataConfig,
    DecodeConfig,
    ModelConfig,
    TrainerConfig,
    available_cpus,
)
from transformer.errors import PeerGone, Stopped

HUGE = "99999999999999999999"  # beyond an int64
TOO_MANY = str(4 * available_cpus() + 1)  # processes or threads: more than 4 per core of this machine

REFUSED = [
    ("model.encoder_layers=" + HUGE, r"^model.encoder_layers=\d+ must be from 1 to 1000 \("),
    ("model.decoder_layers=1001", r"^model.decoder_layers=1001 must be from 1 to 1000 \("),
    ("model.d_model=131072", r"^model.d_model=131072 must be from 1 to 65536 \("),
    ("model.d_ff=" + HUGE, r"^model.d_ff=\d+ must be from 1 to 262144 \("),
    ("model.max_positions=" + HUGE, r"^model.max_positions=\d+ must be from 1 to 65536 \("),
    ("data.vocab_size=" + HUGE, r"^data.vocab_size=\d+ must be from 1 to 1048576 \("),
    ("data.embedded_pairs=" + HUGE, r"^data.embedded_pairs=\d+ must be from 1 to 10000000 \("),
    ("trainer.max_tokens=" + HUGE, r"^trainer.max_tokens=\d+ must be from 1 to 16777216 \("),
    ("trainer.update_freq=" + HUGE, r"^trainer.update_freq=\d+ must be from 1 to 10000 \("),
    ("trainer.num_workers=" + HUGE, r"^trainer.num_workers=\d+ must be from 0 to 4096 \(DataLoader processes\)"),
    ("trainer.num_workers=" + TOO_MANY, rf"^trainer.num_workers={TOO_MANY} must be from 0 to \d+ on this machine"),
    ("trainer.num_threads=" + TOO_MANY, rf"^trainer.num_threads={TOO_MANY} must be from 0 to \d+ on this machine"),
    ("trainer.val_beam_size=100000", r"^trainer.val_beam_size=100000 must be from 1 to 1000 \("),
    ("trainer.max_steps=" + HUGE, r"^trainer.max_steps=\d+ is beyond a 64-bit integer: give at most 2\*\*63 - 1$"),
    ("trainer.warmup=" + HUGE, r"^trainer.warmup=\d+ is beyond a 64-bit integer"),
    ("trainer.keep_last=" + HUGE, r"^trainer.keep_last=\d+ is beyond a 64-bit integer"),
    ("trainer.seed=-1", r"^trainer.seed=-1 must be from 0 to 2\*\*63 - 1 \(.*no negative seed\)"),
    ("trainer.seed=" + HUGE, r"^trainer.seed=\d+ must be from 0 to 2\*\*63 - 1"),
    ("trainer.adam_eps=-1e-9", r"^trainer.adam_eps=-1e-09 must be > 0"),
    ("trainer.adam_eps=0", r"^trainer.adam_eps=0.0 must be > 0"),
    ("decode.beam_size=100000", r"^decode.beam_size=100000: must be a whole number >= 1 and <= 1000$"),
    ("decode.batch_tokens=" + HUGE, r"^decode.batch_tokens=\d+: must be a whole number >= 1 and <= 16777216$"),
    ("decode.max_len_b=" + HUGE, r"^decode.max_len_b=\d+: must be a whole number >= 0 and <= 65536$"),
]


@pytest.mark.parametrize("override, message", REFUSED, ids=[override for override, _ in REFUSED])
def test_a_count_or_size_beyond_what_the_machine_can_use_is_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as refused:
        compose_config([override])
    assert re.search(message, str(refused.value)) and "\n" not in str(refused.value), str(refused.value)


SECTIONS = {"model": ModelConfig, "data": DataConfig, "trainer": TrainerConfig, "decode": DecodeConfig}
INT_KEYS = [
    f"{section}.{spec.name}"
    for section, schema in SECTIONS.items()
    for spec in dataclasses.fields(schema)
    if "int" in str(spec.type)
]


@pytest.fixture(scope="module")
def default_config() -> dict:
    return compose_config([]).to_dict()


@pytest.mark.parametrize("key", INT_KEYS)
def test_every_int_key_of_the_schema_refuses_a_value_beyond_int64(key, default_config):
    """The class, not the keys listed: a key added later without a range still gets the int64 one."""
    raw = copy.deepcopy(default_config)
    section, name = key.split(".")
    raw[section][name] = int(HUGE)
    ranged = r"(must be from -?\d+ to |is beyond a 64-bit integer|: must be a whole number >= \d+ and <= )"
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}={HUGE} ?{ranged}"):
        Config.from_dict(raw)


def test_the_limits_leave_what_big_models_and_machines_use():
    compose_config(
        [
            "model=big",
            "model.d_model=4096",
            "model.n_heads=32",
            "model.d_ff=16384",
            "model.encoder_layers=48",
            "model.decoder_layers=48",
            "model.max_positions=8192",
            "data.vocab_size=500000",
            "trainer.max_tokens=65536",
            "trainer.update_freq=128",
            f"trainer.num_workers={4 * available_cpus()}",
            "trainer.seed=0",
            "decode.beam_size=50",
        ]
    )


def test_a_value_beyond_its_range_is_refused_by_the_cli_in_one_line_before_anything_is_written(tmp_path):
    """trainer.num_workers=99999999999999999999 forked DataLoader workers until the OOM killer acted."""
    proc = subprocess.run(
        [sys.executable, "-m", "transformer.train", "trainer.num_workers=" + HUGE, f"hydra.run.dir={tmp_path}/run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2, proc.stderr
    assert_one_line_refusal(proc.stderr, None, r"^error: trainer.num_workers=\d+ must be from 0 to 4096")
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []  # no run directory, no log line


@pytest.mark.parametrize(
    "torchrun, message",
    [
        (["--nproc_per_node=0"], r"--nproc_per_node=0: give a number of processes from 1 to \d+"),
        (["--nproc_per_node=abc"], r"--nproc_per_node=abc: give a number of processes"),
        (["--nproc_per_node=" + HUGE], r"--nproc_per_node=\d+: give a number of processes from 1 to \d+"),
        (["--nproc_per_node=1", "--nnodes=abc"], r"--nnodes=abc: give a number of machines"),
        (["--nproc_per_node=1", "--nnodes=0"], r"--nnodes=0: give a number of machines"),
    ],
)
def test_an_impossible_process_count_for_the_launcher_is_one_line_before_any_rank_starts(torchrun, message, capsys):
    from transformer.cli.launch import main

    assert main(["--standalone", *torchrun, "trainer.max_steps=1"]) == 2
    assert_one_line_refusal(capsys.readouterr().err, None, message)


# --- a stop signal before the first step ------------------------------------------------------------


def test_a_signal_before_the_loop_stops_at_once_and_after_it_waits_for_the_step():
    from transformer.training.run_dir import StopSignals

    before = signal.getsignal(signal.SIGTERM)
    stop = StopSignals()
    stop.install()
    try:
        with pytest.raises(Stopped) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10**9):  # a loop that never asks (building a model, preparing a corpus)
                pass
        assert stopped.value.signal_name == "SIGTERM" and stop.name == "SIGTERM"
        later = StopSignals()
        later.install()
        later.defer()  # the loop has started: the step finishes, last.pt is saved
        os.kill(os.getpid(), signal.SIGTERM)
        assert later.name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):  # a second one: now
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        later.restore()
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) == before


# The data preparation replaced by a loop that never ends and never asks whether to stop.
ENDLESS_PREPARATION = """
import sys
import transformer.training.trainer as trainer
def prepare(cfg, tokenizer=None):
    print("preparing", flush=True)
    while True:
        pass
trainer.prepare = prepare
sys.argv = ["train", *sys.argv[1:]]
from transformer.cli.train import main
main()
"""


def test_sigterm_while_the_data_is_prepared_ends_the_run_at_once_in_one_line_with_143(tmp_path):
    """SIGTERM used to be acknowledged only once the loop had started (or, before, to kill the run
    without a word); a loop that never asks now ends too."""
    proc = subprocess.Popen(
        [sys.executable, "-c", ENDLESS_PREPARATION, f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "preparing"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert one_line(err) == (
        f"interrupted by SIGTERM: stopped at once; checkpoints written before now stay in {tmp_path}/checkpoints"
    )


# --- a rank whose peer went ---------------------------------------------------------------------------

GLOO_PEER_GONE = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:52651. This is typically caused by a remote worker crashing. Check the logs of the remote "
    "worker before reporting an error."
)


def test_a_collective_failing_because_another_rank_went_is_one_line_naming_this_rank(tmp_path, monkeypatch):
    import transformer.training.trainer as trainer

    def collective_fails(cfg, run_dir, launch):
        raise RuntimeError(GLOO_PEER_GONE)  # what gloo raises in all_reduce, broadcast or DDP's backward

    monkeypatch.setattr(trainer, "_train_in", collective_fails)
    monkeypatch.setattr(trainer, "attach_log_file", lambda run_dir, is_main, level=None: None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    cfg = compose_config(["trainer.max_steps=1"])
    with pytest.raises(PeerGone) as gone:
        trainer.train(cfg, tmp_path)
    assert str(gone.value) == (
        "rank 1: another rank of the run stopped (Connection closed by peer [127.0.0.1]:52651); see its error above"
    )
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: no peer to lose, the error is a bug and stays one
    with pytest.raises(RuntimeError, match="Connection closed by peer") as bug:
        trainer.train(cfg, tmp_path)
    assert not isinstance(bug.value, PeerGone)
    monkeypatch.setenv("WORLD_SIZE", "2")

    def another_error(cfg, run_dir, launch):
        raise RuntimeError("a bug")

    monkeypatch.setattr(trainer, "_train_in", another_error)
    with pytest.raises(RuntimeError, match="^a bug$"):
        trainer.train(cfg, tmp_path)
