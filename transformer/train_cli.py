"""`transformer-train`'s front door: `--help` (with or without overrides and --config-dir) is composed
and printed here, without torch (about 2.5 s of every start); everything else goes to Hydra and the
training (`transformer.train.main`), whose --help prints the same text."""

from __future__ import annotations

import sys

from transformer.config import ConfigError, bare_word, command_line_config, compose_tree
from transformer.errors import discard_stdout, import_torch_holding_interrupts, next_interrupt_ends_at_once


def refuse_bare_words(argv: list[str]) -> None:
    """Exit 2 with one line for a word that is neither a flag nor an override (`config.bare_word`),
    before Hydra answers it in five lines (also for python -m transformer.train and torchrun), or for an
    empty run directory."""
    bare = bare_word(argv, "transformer-train")
    if bare:
        print(f"error: {bare}", file=sys.stderr)
        sys.exit(2)
    # `hydra.run.dir=$RUN` with RUN unset: Hydra would write the run into the working directory
    if any(arg.split("=", 1)[0] == "hydra.run.dir" and not arg.split("=", 1)[1].strip(" '\"") for arg in argv):
        print("error: hydra.run.dir is empty (an unset shell variable?); name the run's directory, or leave "
              "hydra.run.dir out for runs/<data>/<model>/<time>", file=sys.stderr)
        sys.exit(2)


# Hydra's flags that change what is composed, as compose_tree's arguments.
COMPOSE_FLAGS = {"--config-name": "config_name", "-cn": "config_name", "--config-dir": "config_dir", "-cd": "config_dir"}


def refuse_uncomposable(argv: list[str]) -> None:
    """Exit 2 with one line (a misspelt preset with the group's options, a misspelt key with the nearest
    one, a value of the wrong type) where Hydra's own answer is several lines and exit 1. Composes the
    config once more before hydra.main (a fraction of a second), a sweep's once per value of its choices
    (`sweep_jobs_to_check`); --help, --cfg, --info and the flags it does not follow are left to Hydra."""
    flags, overrides, words = {}, [], iter(argv)
    for word in words:
        name = word.split("=", 1)[0]
        if name in COMPOSE_FLAGS:
            flags[COMPOSE_FLAGS[name]] = word.split("=", 1)[1] if "=" in word else next(words, "")
        elif word in ("-m", "--multirun"):
            continue                            # each job's config is checked below
        elif word.startswith("-") or name.lstrip("+") == "hydra.mode":
            return                              # --help, --cfg, --info, --config-path, hydra.mode=MULTIRUN
        elif name.lstrip("+") == "hydra.searchpath" or not name.startswith(("hydra.", "+hydra.", "hydra/")):
            overrides.append(word)
    if "config_name" in flags:
        return      # compose() finds a primary config in conf/ only
    jobs = sweep_jobs_to_check(overrides)
    try:
        for job in jobs:
            compose_tree(job, **flags)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def sweep_jobs_to_check(overrides: list[str]) -> list[list[str]]:
    """The override lists whose composition proves every value of a sweep (`trainer.lr=1e-3,abc`): the
    first of each swept key's values together, then each other value in turn. [] where Hydra alone can
    tell (an override its grammar refuses, range(), interval(), glob()); [overrides] without a sweep."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from transformer.run_dir import hydra_value

    parser = OverridesParser.create()
    fixed, swept = [], []
    for override in overrides:
        try:
            parsed = parser.parse_override(override)
        except Exception:
            return []
        if not parsed.is_sweep_override():
            fixed.append(override)
        elif parsed.is_choice_sweep():
            swept.append([f"{parsed.get_key_element()}={hydra_value(v)}" for v in parsed.value().list])
        else:
            return []
    firsts = [values[0] for values in swept]
    return [fixed + firsts] + [fixed + firsts[:i] + [value] + firsts[i + 1:]
                               for i, values in enumerate(swept) for value in values[1:]]


def main() -> None:
    argv = sys.argv[1:]
    refuse_bare_words(argv)
    if {"--help", "-h"} & set(argv):
        try:
            if command_line_config(argv, "transformer-train") is None:      # it printed the help
                return
        except ConfigError:      # something only Hydra takes (--multirun, --config-name, ...): Hydra's help
            pass
        except BrokenPipeError:  # `transformer-train --help | head`
            discard_stdout()
            return
    try:
        import_torch_holding_interrupts()
        from transformer.train import main as train_main

        train_main()         # a Ctrl-C once the run has started is its own: it saves, says so and exits
    except KeyboardInterrupt:
        next_interrupt_ends_at_once()
        print("transformer-train: interrupted before training started", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
