"""transformer-train-ddp's command line and how it reads a run's end (the runs: tests/training/test_ddp.py)."""

import signal

import pytest

from transformer.cli.launch import failure_line, main, split_command_line, torchrun_options


def test_torchrun_options_go_to_torchrun_with_their_values_and_the_rest_to_the_trainer():
    argv = [
        "--nnodes",
        "2",
        "model=big",
        "--nproc_per_node=8",
        "-m",
        "trainer.lr=1e-3,2e-3",
        "--config-dir",
        "my presets",
        "--rdzv-endpoint",
        "host0:29500",
        "-r",
        "--redirects",
        "3",
        "--standalone",
        "data=x",
    ]
    torchrun, trainer = split_command_line(argv, torchrun_options())
    assert torchrun == [
        "--nnodes",
        "2",
        "--nproc_per_node=8",
        "--rdzv-endpoint",
        "host0:29500",
        "--redirects",
        "3",
        "--standalone",
    ]
    # -m is Hydra's --multirun and -r its --run here: the launcher names the program itself
    assert trainer == ["model=big", "-m", "trainer.lr=1e-3,2e-3", "--config-dir", "my presets", "-r", "data=x"]
    assert split_command_line(["--nnodes"], torchrun_options()) == (["--nnodes"], [])  # torchrun says what is missing


def test_the_options_that_pick_the_program_are_not_torchruns_here():
    options = torchrun_options()
    assert {"--nproc_per_node", "--nproc-per-node", "--standalone", "--max-restarts", "--redirects"} <= set(options)
    assert not {"-m", "--module", "--no-python", "--run-path", "-h", "--help"} & set(options)
    assert options["--nnodes"] and not options["--standalone"]


@pytest.mark.parametrize(
    "rank, exitcode, line, status",
    [
        (0, 2, None, 2),  # a refusal: the ranks said it in one line
        (3, 1, "error: rank 3 exited with status 1 (its own message is above)", 1),
        (
            1,
            -signal.SIGKILL,
            "error: rank 1 was killed by SIGKILL (the kernel's out-of-memory killer? see `dmesg`)",
            137,
        ),
        (0, -signal.SIGSEGV, "error: rank 0 was killed by SIGSEGV", 139),
    ],
)
def test_the_rank_that_stopped_the_run_is_named_with_the_status_a_shell_would_give(rank, exitcode, line, status):
    assert failure_line(rank, exitcode) == (line, status)


def test_help_says_what_goes_where(capsys):
    assert main(["--nproc_per_node=2", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: transformer-train-ddp [torchrun options] [overrides] [Hydra flags]")
    assert "torchrun --help" in out and "transformer-train --help" in out


def test_more_processes_on_a_machine_than_gpus_is_one_line_from_the_ranks_without_a_device(monkeypatch):
    import torch

    from transformer.config import ConfigError
    from transformer.distributed import DistInfo
    from transformer.runtime import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_device("cuda", DistInfo(rank=11, local_rank=3, world_size=16)) == torch.device("cuda", 3)
    with pytest.raises(ConfigError) as error:
        resolve_device("cuda", DistInfo(rank=12, local_rank=4, world_size=16))
    assert str(error.value) == (
        "rank 12 is process 5 on a machine with 4 CUDA device(s): start at most one per device (--nproc_per_node=4)"
    )
