"""The `transformer-average` command line: the weights of a run's last N step checkpoints (or of the
checkpoint files given) averaged into one checkpoint (`checkpoint.average_checkpoints`). It answers --help
and refuses bad arguments before it loads torch."""

from __future__ import annotations

import sys
from pathlib import Path

from transformer.cli.args import CommandLineParser
from transformer.cli.run import run_command
from transformer.errors import SYMLINK_LOOP, CheckpointError, UsageError, import_torch_holding_interrupts, symlink_loop

DEFAULT_LAST = 5  # step checkpoints averaged from a run directory without --last


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(  # errors in one line, as transformer-translate's
        prog="transformer-average",
        description="Average the weights of the last N step checkpoints of a run into one checkpoint.",
    )
    parser.add_argument("inputs", nargs="+", help="a run directory, or checkpoint files to average")
    parser.add_argument(
        "--last", type=int, help=f"with a run directory: how many step_N.pt to use (default {DEFAULT_LAST})"
    )
    parser.add_argument("--output", "-o", required=True, help="where to write the averaged checkpoint")
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace an existing -o file that is not an earlier output of transformer-average",
    )
    args = parser.parse_args(argv)
    return run_command("transformer-average", lambda: _average(args))


def _average(args) -> int:
    if args.last is not None and args.last < 1:
        raise UsageError(f"--last {args.last}: must be a whole number >= 1")
    import_torch_holding_interrupts()
    from transformer.checkpoint import average_checkpoints, non_finite_tensors, save_checkpoint

    paths = _inputs(args)
    _check_output(Path(args.output), paths, args.force)
    state = average_checkpoints(paths)
    bad = non_finite_tensors(state["model"])
    if bad:
        raise CheckpointError(
            f"the average of {', '.join(map(str, paths))} holds NaN or infinite values in "
            f"{bad[0]}: one of them holds diverged weights; average checkpoints from before it"
        )
    save_checkpoint(state, args.output)
    print(f"averaged {len(paths)} checkpoints ({', '.join(p.name for p in paths)}) -> {args.output}")
    return 0


def _inputs(args) -> list[Path]:
    """The checkpoints to average: a run directory's last step_N.pt, or the files given (each once)."""
    from transformer.checkpoint import step_checkpoints

    if len(args.inputs) == 1 and Path(args.inputs[0]).is_dir():
        paths = step_checkpoints(args.inputs[0])[-(args.last or DEFAULT_LAST) :]
        if not paths:
            raise CheckpointError(f"{args.inputs[0]}: no checkpoints/step_N.pt files to average")
    else:
        if args.last is not None:
            raise CheckpointError(
                "--last picks step checkpoints from a run directory; with checkpoint files "
                "every file given is averaged: leave --last out"
            )
        paths = [Path(p) for p in args.inputs]
    looped = next((p for p in paths if symlink_loop(p)), None)
    if looped is not None:
        raise CheckpointError(f"{looped}: is {SYMLINK_LOOP}, not a checkpoint file")
    twice = next((p for i, p in enumerate(paths) if p.resolve() in {q.resolve() for q in paths[:i]}), None)
    if twice is not None:  # a second mention (or a link to the same file) doubled its weight silently
        raise CheckpointError(
            f"{twice}: given twice (or through a link); each checkpoint is averaged once: leave out the repetition"
        )
    return paths


def _check_output(output: Path, paths: list[Path], force: bool) -> None:
    """-o is a new file, or an earlier average (--force: any file but a run's resume point)."""
    from transformer.checkpoint import holds_training_state, written_by_average

    if symlink_loop(output):
        raise CheckpointError(f"-o {output}: is {SYMLINK_LOOP}; remove the link or write the average elsewhere")
    if any(output.resolve() == p.resolve() for p in paths):
        raise CheckpointError(f"-o {output}: is one of the checkpoints being averaged; write the average to a new file")
    if output.is_dir():
        raise CheckpointError(f"-o {output}: is a directory; give a file name such as {output / 'avg.pt'}")
    nearest = next(p for p in (output.parent, *output.parent.parents) if p.exists())
    if nearest != output.parent and nearest.is_dir():  # a mistyped directory would be made, the average lost in it
        raise CheckpointError(
            f"-o {output}: the directory {output.parent} does not exist; create it first "
            f"(mkdir -p {output.parent}) or write the average elsewhere"
        )
    if output.is_file() and holds_training_state(output):  # --force or not: a run's resume point
        raise CheckpointError(
            f"-o {output}: holds a run's training state (it resumes the run), which an "
            "average (weights only) would replace; write the average to a new file"
        )
    if output.exists() and not force and not written_by_average(output):
        raise CheckpointError(
            f"-o {output}: exists and is not an averaged checkpoint written by "
            "transformer-average; choose a new file name, or pass --force to replace it"
        )


if __name__ == "__main__":
    sys.exit(main())
