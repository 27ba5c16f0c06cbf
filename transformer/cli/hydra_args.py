"""The command line of transformer-train and transformer-prepare: Hydra overrides and flags. Composed
without hydra.main for a tool that makes no run directory (`command_line_config`); a word that is neither
is one line (`bare_word`)."""

from __future__ import annotations

from transformer.cli.args import version_line
from transformer.cli.help import help_text
from transformer.compose import CONFIG_SOURCE_FLAGS, compose, compose_tree
from transformer.config import Config, ConfigError


def command_line_config(argv: list[str], program: str) -> Config | None:
    """What `transformer-train` takes, for a tool that composes without hydra.main (so without a run
    directory): key=value overrides, --config-dir DIR, --cfg job [--resolve], --version and --help (--quiet
    is the caller's: `quiet_as_override`). Prints the version, the help or the composed config and returns
    None for those; else the validated Config."""
    import argparse

    from omegaconf import OmegaConf

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise ConfigError(
                f"{program}: {message}; it takes key=value overrides, --config-dir DIR, "
                "--cfg job [--resolve], --quiet, --version and --help"
            )

    parser = Parser(prog=program, add_help=False, allow_abbrev=False)
    parser.add_argument("--help", "-h", action="store_true")
    parser.add_argument("--version", action="store_true")
    parser.add_argument("--cfg", "-c", choices=["job"])
    parser.add_argument("--resolve", action="store_true")
    parser.add_argument("--config-dir", "-cd")
    parser.add_argument("--config-name", "-cn")  # refused below: read as `-c n` otherwise
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    if args.config_name is not None:
        raise ConfigError(
            f"{program}: --config-name {args.config_name}: it composes conf/config.yaml; put your "
            "presets in a --config-dir DIR (DIR/data/NAME.yaml, then data=NAME)"
        )
    if args.resolve and not args.cfg:
        raise ConfigError(f"{program}: --resolve goes with --cfg job (it prints the composed config resolved)")
    bare = bare_word(args.overrides, program)
    if bare:
        raise ConfigError(bare)
    if args.version:
        print(version_line())
        return None
    if args.help:
        print(help_text(program, args.overrides, args.config_dir))
        return None
    if args.cfg:
        print(OmegaConf.to_yaml(compose_tree(args.overrides, config_dir=args.config_dir), resolve=args.resolve))
        return None
    return compose(args.overrides, config_dir=args.config_dir)


# Hydra's flags that take the next word as their value (that word is not an override).
HYDRA_VALUE_FLAGS = (
    *CONFIG_SOURCE_FLAGS,
    "-c",
    "--cfg",
    "-p",
    "--package",
    "-i",
    "--info",
    "--experimental-rerun",
    "-sc",
    "--shell-completion",
)


def bare_word(argv: list[str], program: str) -> str | None:
    """The one-line error for a word that is neither a flag nor an override (`make train model small`:
    Hydra answers with five lines about its grammar), or None."""
    for previous, word in zip(["", *argv], argv):
        if "=" in word or word.startswith(("-", "~")) or previous in HYDRA_VALUE_FLAGS:
            continue
        hint = (
            f"{word}=VALUE"
            if "." in word
            else f"{word}=NAME"
            if word in ("model", "data", "decode", "recipe")
            else "model=small, trainer.lr=1e-3"
        )
        return (
            f"{program}: {word!r} is not an override: write KEY=VALUE or GROUP=OPTION (e.g. {hint}); "
            f"{program} --help lists them"
        )
    return None


QUIET = "--quiet"
QUIET_OVERRIDE = "trainer.log_level=warning"


def quiet_as_override(argv: list[str]) -> list[str]:
    """`argv` with --quiet written as the override it stands for, trainer.log_level=warning (warnings,
    errors and the final scores only; no progress bars), before Hydra, which knows no such flag. A
    trainer.log_level given as well wins."""
    if QUIET not in argv:
        return argv
    rest = [word for word in argv if word != QUIET]
    if any(word.lstrip("+").split("=", 1)[0] == "trainer.log_level" for word in rest):
        return rest
    return [*rest, QUIET_OVERRIDE]
