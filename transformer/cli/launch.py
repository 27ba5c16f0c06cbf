"""`transformer-train-ddp` (and `make train-ddp`): torchrun with this trainer as its program.

One command line takes torchrun's options (`--nproc_per_node=8`, `--nnodes 2`, `--rdzv-endpoint=HOST:PORT`
...) and the trainer's overrides and Hydra flags, in any order, and the command ends as `transformer-train`
does: a command line or settings that every rank would refuse are refused in one line (exit 2) before
any rank starts, a rank's own refusal exits 2 too, 130 / 143 after Ctrl-C or SIGTERM (every rank finished its
step and saved last.pt), without torchrun's traceback and failure report. torchrun itself keeps working
(`torchrun ... -m transformer.train OVERRIDES`); this front door only reads how it ended."""

from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path

from transformer.cli.args import version_line
from transformer.cli.hydra_args import quiet_as_override
from transformer.cli.train import refuse_bare_words, refuse_uncomposable
from transformer.config import available_cpus
from transformer.errors import import_torch_holding_interrupts, signal_exit_status
from transformer.training.run_dir import LAUNCH_ENV, python_command

PROGRAM = ["-m", "transformer.cli.train"]
# torchrun's options that pick the program (this launcher does) or are also Hydra's short flags (-m
# multirun, -r run, -h help): these words go to the trainer; torchrun's long forms (--redirects) still work.
NOT_TORCHRUN = {"-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path", "-r", "-h", "--help"}
USAGE = """usage: transformer-train-ddp [torchrun options] [overrides] [Hydra flags]

torchrun with the trainer as its program, e.g.
  transformer-train-ddp --standalone --nproc_per_node=8 model=big data=wmt14_en_de
torchrun's options: torchrun --help (not -m, --no-python, --run-path: the program is the trainer);
overrides and flags (--quiet among them): transformer-train --help; --version prints the version."""


def torchrun_options() -> dict[str, bool]:
    """torchrun's option words (both spellings), each with whether it takes a value."""
    from torch.distributed.run import get_args_parser

    return {
        word: action.nargs != 0
        for action in get_args_parser()._actions
        for word in action.option_strings
        if word not in NOT_TORCHRUN
    }


def split_command_line(argv: list[str], options: dict[str, bool]) -> tuple[list[str], list[str]]:
    """(torchrun's words, the trainer's words) of `argv`, each in the order typed: a torchrun option
    brings its value along, whether written `--nnodes=2` or `--nnodes 2`."""
    torchrun, trainer, words = [], [], iter(argv)
    for word in words:
        name = word.split("=", 1)[0]
        if name not in options:
            trainer.append(word)
            continue
        torchrun.append(word)
        if options[name] and "=" not in word:
            value = next(words, None)
            if value is not None:  # none: torchrun's parser says the value is missing
                torchrun.append(value)
    return torchrun, trainer


def torchrun_count_error(nproc_per_node: str, nnodes: str) -> str | None:
    """Why `--nproc_per_node` or `--nnodes` cannot start a run (torchrun answers them with a traceback),
    in one line naming the option; None when both can. More processes on a machine than 4 per CPU core
    only compete for the cores, and each loads torch and its own copy of the model."""
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    limit = 4 * available_cpus()
    try:
        count = determine_local_world_size(nproc_per_node)
    except ValueError as error:
        count, why = None, str(error)
    if count is None or not 1 <= count <= limit:
        unavailable = f" ({why})" if count is None and "not available" in why else ""
        return (
            f"--nproc_per_node={nproc_per_node}: give a number of processes from 1 to {limit} (4 per CPU "
            f"core of this machine), or auto, cpu or gpu{unavailable}"
        )
    try:
        low, high = parse_min_max_nnodes(nnodes)
    except ValueError:
        low = high = 0
    if not 0 < low <= high:
        return f"--nnodes={nnodes}: give a number of machines (e.g. 2), or MIN:MAX (e.g. 1:4), each at least 1"
    return None


def failure_line(rank: int, exitcode: int) -> tuple[str | None, int]:
    """(what to say, the exit status) for the rank whose exit stopped the run: a refusal (status 2) was
    said by the ranks themselves; a status of its own is named; a rank a signal killed is named with its
    signal (SIGKILL: most often the kernel's out-of-memory killer)."""
    if exitcode == 2:
        return None, 2
    if exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else f"signal {-exitcode}"
        cause = " (the kernel's out-of-memory killer? see `dmesg`)" if name == "SIGKILL" else ""
        return f"error: rank {rank} was killed by {name}{cause}", 128 - exitcode  # as a shell reports it
    return f"error: rank {rank} exited with status {exitcode} (its own message is above)", exitcode


def launcher_name() -> list[str]:
    """This launcher as a user would type it again."""
    if Path(sys.argv[0]).name == "transformer-train-ddp":
        return ["transformer-train-ddp"]
    return [python_command(), "-m", "transformer.cli.launch"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if {"-h", "--help"} & set(argv):
        print(USAGE)
        return 0
    if "--version" in argv:
        print(version_line())
        return 0
    import_torch_holding_interrupts()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    torchrun, trainer = split_command_line(argv, torchrun_options())
    trainer = quiet_as_override(trainer)  # every rank's, and checked below as an override
    refuse_bare_words(trainer)  # what every rank would refuse: one line, before any rank starts
    refuse_uncomposable(trainer, validate=True)
    args = parse_args([*torchrun, *PROGRAM, *trainer])  # argparse: usage and exit 2 when wrong
    problem = torchrun_count_error(args.nproc_per_node, args.nnodes)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    os.environ[LAUNCH_ENV] = shlex.join([*launcher_name(), *torchrun])
    try:
        run(args)
    except SignalException as stop:  # the ranks said where last.pt is and how to continue
        return signal_exit_status(signal.Signals(stop.sigval).name)
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        line, status = failure_line(rank, failure.exitcode)
        if line:
            print(line, file=sys.stderr)
        return status
    except KeyboardInterrupt:  # before the agent's own handler was in place
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
