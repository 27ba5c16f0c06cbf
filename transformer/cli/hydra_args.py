"""The command line of transformer-train and transformer-prepare: Hydra overrides and flags. Composed
without hydra.main for a tool that makes no run directory (`command_line_config`); a word that is neither
is one line (`bare_word`)."""

from __future__ import annotations

from transformer.cli.help import help_text
from transformer.compose import CONFIG_SOURCE_FLAGS, compose, compose_tree
from transformer.config import Config, ConfigError


def command_line_config(argv: list[str], program: str) -> Config | None:
    """What `transformer-train` takes, for a tool that composes without hydra.main (so without a run
    directory): key=value overrides, --config-dir DIR, --cfg job [--resolve] and --help. Prints the help
    or the composed config and returns None for those; else the validated Config."""
    import argparse

    from omegaconf import OmegaConf

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise ConfigError(
                f"{program}: {message}; it takes key=value overrides, --config-dir DIR, "
                "--cfg job [--resolve] and --help"
            )

    parser = Parser(prog=program, add_help=False, allow_abbrev=False)
    parser.add_argument("--help", "-h", action="store_true")
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
