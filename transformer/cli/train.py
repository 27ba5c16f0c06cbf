"""`transformer-train`'s front door: `--help` (with or without overrides and --config-dir) is composed
and printed here, without torch (about 2.5 s of every start); everything else goes to Hydra and the
training (`transformer.train.main`), whose --help prints the same text."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from transformer.cli.args import version_line
from transformer.cli.hydra_args import bare_word, command_line_config, quiet_as_override
from transformer.cli.run import run_command
from transformer.compose import CONFIG_SOURCE_FLAGS, HYDRA_CONFIG_FLAGS, compose_tree
from transformer.config import CONF_DIR, Config, ConfigError
from transformer.errors import (
    DataError,
    PeerGone,
    Stopped,
    TrainingError,
    discard_stdout,
    import_torch_holding_interrupts,
    next_interrupt_ends_at_once,
)


def refuse_bare_words(argv: list[str]) -> None:
    """Exit 2 with one line for a word that is neither a flag nor an override (`hydra_args.bare_word`),
    before Hydra answers it in five lines (also for python -m transformer.train and torchrun), or for an
    empty run directory."""
    bare = bare_word(argv, "transformer-train")
    if bare:
        print(f"error: {bare}", file=sys.stderr)
        sys.exit(2)
    # `hydra.run.dir=$RUN` with RUN unset: Hydra would write the run into the working directory
    if any(arg.split("=", 1)[0] == "hydra.run.dir" and not arg.split("=", 1)[1].strip(" '\"") for arg in argv):
        print(
            "error: hydra.run.dir is empty (an unset shell variable?); name the run's directory, or leave "
            "hydra.run.dir out for runs/<data>/<model>/<time>",
            file=sys.stderr,
        )
        sys.exit(2)
    misuse = hydra_flag_error(argv)
    if misuse:
        print(f"error: {misuse}", file=sys.stderr)
        sys.exit(2)


def hydra_flag_error(argv: list[str]) -> str | None:
    """One line for what Hydra answers with a traceback or several lines (exit 1): --multirun with
    --cfg/--info/--shell-completion, --shell-completion without its subcommand, a --config-dir that is no
    directory, a --config-name no config directory holds, hydra.job.chdir=true (relative paths would be
    read inside the run directory); None when there is none of these."""
    words = set(argv)
    given, _ = config_flags(argv)
    alone = sorted(words & {"--cfg", "-c", "--info", "-i", "--shell-completion", "-sc"})
    if words & {"-m", "--multirun"} and alone:
        return f"--multirun and {alone[0]} do not go together: {alone[0]} prints, it runs nothing; leave one out"
    if words & {"--shell-completion", "-sc"} and not any(
        w.split("=", 1)[0] in ("install", "uninstall", "query") for w in argv
    ):
        return "--shell-completion needs install=SHELL, uninstall=SHELL or query=SHELL (e.g. install=bash)"
    for directory in given.get("--config-dir", []):
        if not Path(directory).expanduser().is_dir():
            return (
                f"--config-dir {directory}: no such directory; give the directory that holds your presets "
                "(DIR/data/NAME.yaml, then data=NAME)"
            )
    for name in given.get("--config-name", []):
        if "--config-path" in given:
            break  # Hydra's own search; it says what it cannot find
        places = [CONF_DIR, *(Path(d).expanduser() for d in given.get("--config-dir", []))]
        if not any((place / f"{name.removesuffix('.yaml')}.yaml").is_file() for place in places):
            return (
                f"--config-name {name}: no {name.removesuffix('.yaml')}.yaml in {' or '.join(map(str, places))}; "
                "a config of your own goes in a --config-dir DIR as DIR/NAME.yaml"
            )
    if any(arg.lstrip("+").lower() in ("hydra.job.chdir=true", "hydra.job.chdir=yes") for arg in argv):
        return (
            "hydra.job.chdir=true: training reads relative paths (data.path, data.cache_dir, trainer.init_from) "
            "from the directory it starts in and writes into its run directory by name; leave hydra.job.chdir out"
        )
    return None


def config_flags(argv: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """`argv` read as Hydra reads its config flags: {long flag: its values in order} (`-cd DIR`,
    `--config-dir=DIR`), and the other words."""
    given, rest, words = {}, [], iter(argv)
    for word in words:
        name = word.split("=", 1)[0]
        if name in CONFIG_SOURCE_FLAGS:
            value = word.split("=", 1)[1] if "=" in word else next(words, "")
            given.setdefault(HYDRA_CONFIG_FLAGS.get(name, name), []).append(value)
        else:
            rest.append(word)
    return given, rest


def refuse_uncomposable(argv: list[str], validate: bool = False) -> None:
    """Exit 2 with one line (a misspelt preset with the group's options, a misspelt key with the nearest
    one, a value of the wrong type) where Hydra's own answer is several lines and exit 1. Composes the
    config once more before hydra.main (a fraction of a second), a sweep's once per value of its choices
    (`sweep_jobs_to_check`); --help, --cfg, --info and the flags it does not follow are left to Hydra.
    `validate`: a run that is no sweep is also checked value by value (`Config.from_dict`), before Hydra
    makes its run directory (transformer-train) or starts the ranks that would each refuse it
    (transformer-train-ddp)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    given, words = config_flags(argv)
    if "--config-name" in given or "--config-path" in given:
        return  # compose() finds a primary config in conf/ only
    overrides = []
    for word in words:
        name = word.split("=", 1)[0]
        if word in ("-m", "--multirun"):
            continue  # each job's config is checked below
        if word.startswith("-") or name.lstrip("+") == "hydra.mode":
            return  # --help, --cfg, --info, hydra.mode=MULTIRUN
        if name.lstrip("+") == "hydra.searchpath" or not name.startswith(("hydra.", "+hydra.", "hydra/")):
            overrides.append(word)
    config_dir = given["--config-dir"][-1] if "--config-dir" in given else None
    sweep = bool({"-m", "--multirun"} & set(words))
    try:
        for job in sweep_jobs_to_check(overrides):
            tree = compose_tree(job, config_dir=config_dir)
            if validate and not sweep:  # a sweep's job may fail alone, as a row of its summary
                try:
                    raw = OmegaConf.to_container(tree, resolve=True)
                except OmegaConfBaseException:  # an interpolation only hydra.main resolves (${hydra:...})
                    return
                Config.from_dict(raw)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def sweep_jobs_to_check(overrides: list[str]) -> list[list[str]]:
    """The override lists whose composition proves every value of a sweep (`trainer.lr=1e-3,abc`): the
    first of each swept key's values together, then each other value in turn. [] where Hydra alone can
    tell (an override its grammar refuses, range(), interval(), glob()); [overrides] without a sweep."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    from transformer.training.run_dir import hydra_value

    parser = OverridesParser.create()
    fixed, swept = [], []
    for override in overrides:
        try:
            parsed = parser.parse_override(override)
        except Exception:
            return []
        if not parsed.is_sweep_override():
            fixed.append(override)
        elif isinstance(parsed.value(), ChoiceSweep):
            swept.append([f"{parsed.get_key_element()}={hydra_value(v)}" for v in parsed.value().list])
        else:
            return []  # glob(), range(), interval(): Hydra expands them
    firsts = [values[0] for values in swept]
    return [fixed + firsts] + [
        fixed + firsts[:i] + [value] + firsts[i + 1 :] for i, values in enumerate(swept) for value in values[1:]
    ]


def main() -> None:
    if "--version" in sys.argv[1:]:  # before Hydra, whose --version is its own
        print(version_line())
        return
    sys.argv[1:] = quiet_as_override(sys.argv[1:])  # Hydra reads sys.argv itself
    argv = sys.argv[1:]
    refuse_bare_words(argv)
    code = run_command("transformer-train", lambda: _train(argv), interrupted="interrupted before training started")
    if code:
        sys.exit(code)


def _train(argv: list[str]) -> None:
    if {"--help", "-h"} & set(argv):
        try:
            if command_line_config(argv, "transformer-train") is None:  # it printed the help
                return
        except ConfigError:  # something only Hydra takes (--multirun, --config-name, ...): Hydra's help
            pass
    import_torch_holding_interrupts()
    run_training()  # a Ctrl-C once the run has started is its own: it saves, says so and exits


def run_training() -> None:
    """The Hydra application: compose the config, train in the run directory Hydra made, end as a
    command ends (exit 2 with one line for a refused setting, 130 / 143 for a signal)."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from transformer.checkpoint import CheckpointError
    from transformer.cli.help import register_help_resolver
    from transformer.compose import register_schema
    from transformer.config import CONF_DIR
    from transformer.errors import signal_exit_status
    from transformer.runtime import tune_cpu_process
    from transformer.training import trainer
    from transformer.training.resume import check_run_directory
    from transformer.training.run_dir import (
        check_sweep_directory,
        chooses_run_directory,
        discard_unused_run_directory,
        named_run_directory,
    )
    from transformer.training.run_log import log_to_file_only
    from transformer.training.sweep import interrupt_sweep, job_failed, sweep_interrupted

    started = time.time() - 0.1  # what this start writes is newer (the file clock is a tick behind)
    refuse_bare_words(sys.argv[1:])
    refuse_uncomposable(sys.argv[1:], validate=True)  # a refused value: one line, and nothing written

    # Before Hydra writes .hydra/ and train.log into an explicitly named run directory, make sure no
    # other run is using it (a timestamped default directory is taken again inside `train`); a named
    # sweep directory must not hold an earlier sweep.
    rank = int(os.environ.get("RANK", "0"))
    single_process = int(os.environ.get("WORLD_SIZE", "1")) == 1  # not under torchrun
    sweep = bool({"-m", "--multirun"} & set(sys.argv))
    named_dir = named_run_directory(sys.argv[1:], "hydra.sweep.dir" if sweep else "hydra.run.dir")
    try:
        if named_dir is not None and sweep:
            check_sweep_directory(named_dir, sys.argv[1:])
        elif named_dir is not None and rank == 0:
            check_run_directory(named_dir, sys.argv[1:])
    except TrainingError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    if rank != 0 and not any(a.startswith("hydra.output_subdir=") for a in sys.argv):
        # Rank 0 alone writes .hydra/: its record of the launch is what the next resume is checked against.
        sys.argv.append("hydra.output_subdir=null")

    # An absolute path: Hydra then finds conf/ however this module was started (-m, torchrun, -c).
    tune_cpu_process()  # before the first tensor operation (runtime.py says why)
    register_schema()  # the ConfigStore entries conf/config.yaml names
    register_help_resolver()  # hydra.main's --help

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
    def _main(cfg) -> float | None:
        """Trains; returns the best validation BLEU (what a sweeper such as Optuna optimises)."""
        hydra_cfg = HydraConfig.get()
        run_dir = cfg.get("run_dir") or hydra_cfg.runtime.output_dir
        in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
        stopped_by = sweep_interrupted() if in_sweep else None
        if stopped_by:
            job_failed(f"not run: the sweep was stopped by {stopped_by}", status="not run")
            return None
        try:
            result = trainer.train(cfg, run_dir)
            if in_sweep and result.get("stopped_by"):
                interrupt_sweep(result["stopped_by"])
                job_failed(
                    f"stopped by {result['stopped_by']}; last.pt resumes it (trainer.resume=true)", status="interrupted"
                )
                return None
            if result.get("stopped_by") and single_process:
                # Saved, not finished: 130 / 143, so that `make train && make evaluate` stops here. Not
                # under torchrun, which takes a worker's non-zero status for a crash (a ChildFailedError
                # report; with --max-restarts, the workers started again), and whose ranks may not all
                # have seen the signal.
                sys.exit(signal_exit_status(result["stopped_by"]))
            return result["best_bleu"]
        except PeerGone as error:  # under torchrun: the rank that went (or the launcher) says why
            if in_sweep:
                job_failed(str(error))
                return None
            print(f"error: {error}", file=sys.stderr)
            sys.exit(1)
        except (ConfigError, DataError, CheckpointError, TrainingError) as error:
            if not in_sweep:
                log_to_file_only(f"{error}")  # the console has it once, on stderr below
                if not chooses_run_directory(sys.argv[1:]) and not cfg.get("run_dir") and single_process:
                    discard_unused_run_directory(Path(run_dir), started)  # the default, timestamped one
                print(f"error: {error}", file=sys.stderr)
                sys.exit(2)
            logging.getLogger("transformer").error("%s", error)  # the job's train.log; the sweep's table
            reason = str(error)
        except KeyboardInterrupt as stop:  # before the loop's first step (`Stopped`), or a second Ctrl-C
            next_interrupt_ends_at_once()
            name = stop.signal_name if isinstance(stop, Stopped) else "SIGINT"
            if in_sweep and isinstance(stop, Stopped):  # the sweep ends after its table, as in the loop
                interrupt_sweep(name)
                job_failed(f"stopped by {name} before its first step", status="interrupted")
                return None
            print(
                f"interrupted{'' if name == 'SIGINT' else f' by {name}'}: stopped at once; checkpoints "
                f"written before now stay in {run_dir}/checkpoints",
                file=sys.stderr,
            )
            sys.exit(signal_exit_status(name))
        except Exception as error:
            if not in_sweep:
                raise
            # One job's bug must not end the sweep: the traceback goes to its train.log, the reason to its row.
            logging.getLogger("transformer").exception("this job of the sweep failed")
            reason = f"{type(error).__name__}: {error}"
        job_failed(reason)  # the sweep goes on with the next job; its summary marks this one failed
        return None

    try:
        _main()
    except BrokenPipeError:  # `transformer-train --help | head`: the reader has what it wanted
        discard_stdout()
        sys.exit(0)


if __name__ == "__main__":
    main()
