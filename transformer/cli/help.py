"""`--help` of transformer-train and transformer-prepare, and docs/configuration.md: every key of the schema
(config.py) with its type, default and meaning, and the presets of each group. Generated:
`.venv/bin/python -m transformer.cli.help --markdown > docs/configuration.md`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

from transformer.compose import compose_tree, override_text, register_schema
from transformer.config import Config


class SchemaKey(NamedTuple):
    key: str  # dotted, as on the command line: model.d_model
    type: str
    default: str  # as an override would write it: null, true, [0.9, 0.98]
    meaning: str


def schema_keys(schema: type = Config, prefix: str = "") -> list[SchemaKey]:
    """Every key of the schema, walking the sections, in declaration order (the help's and the README's
    key table)."""
    keys = []
    for spec in dataclasses.fields(schema):
        default = spec.default if spec.default is not dataclasses.MISSING else spec.default_factory()
        if dataclasses.is_dataclass(default):
            keys += schema_keys(type(default), f"{prefix}{spec.name}.")
        else:
            keys.append(
                SchemaKey(
                    prefix + spec.name,
                    spec.metadata.get("type", spec.type),
                    override_text(default),
                    spec.metadata["help"],
                )
            )
    return keys


def markdown_key_table() -> str:
    """The README's table of every key: | key | type | default | meaning |."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = [
        f"| `{key.key}` | {cell(key.type)} | `{cell(key.default)}` | {cell(key.meaning)} |" for key in schema_keys()
    ]
    return "\n".join(["| key | type | default | meaning |", "|---|---|---|---|", *rows])


WIDTH = 100  # the help fits a terminal this wide


USAGE = """\
{program}: {what}
Usage: {program} [GROUP=OPTION | KEY=VALUE ...] [--config-dir DIR] [--cfg job [--resolve]]
       make {target} [GROUP=OPTION | KEY=VALUE ...] [ARGS="--config-dir DIR"]
  GROUP=OPTION       pick a preset (below): make {target} model=small data=multi30k_de_en
  KEY=VALUE          set any key (below): make {target} data=custom data.path=DIR data.src_lang=fr
  --config-dir DIR   add your own presets: DIR/data/mine.yaml is data=mine, DIR/model/x.yaml model=x
  --cfg job          print the composed config (presets and overrides applied) and exit
  --resolve          with --cfg job: resolve interpolations such as ${{now:...}}
  --quiet            warnings, errors and scores only, no progress bars (trainer.log_level=warning)
  --version          print this package's version (and torch's) and exit
  --help             this help; with overrides, each key they change shows its new value after ->
transformer-train and transformer-prepare take the same arguments; transformer-train also takes
Hydra's own flags (--hydra-help lists them): make sweep trainer.lr=1e-3,5e-4 trains one job a value."""


PROGRAMS = {
    "transformer-train": ("train", "train a Transformer translation model (make train)."),
    "transformer-prepare": (
        "prepare",
        "train the tokenizer and encode the corpus of the data config as "
        "training would, without training (make prepare).",
    ),
}


def help_text(program: str = "transformer-train", overrides: list[str] = (), config_dir: str | None = None) -> str:
    """`program --help`: usage, the presets of each group and every key (type, default, meaning)."""
    return render_help(program, compose_tree(overrides, config_dir=config_dir, with_hydra=True))


def render_help(program: str, composed) -> str:
    """The help for a composed config that holds Hydra's node (its chosen presets, its config
    directories); hydra.main's --help shows it through the `transformer.help` resolver."""
    import textwrap

    from omegaconf import OmegaConf

    target, what = PROGRAMS.get(program, ("train", ""))
    usage = USAGE.format(program=program, what=what, target=target).splitlines()
    lines = textwrap.wrap(usage[0], WIDTH, subsequent_indent="  ") + usage[1:]
    lines += ["", "Presets (GROUP=OPTION; * marks the one picked, recipe goes after data=...):"]
    choices = composed.hydra.runtime.choices
    for group, options in preset_options(composed.hydra.runtime.config_sources).items():
        marked = [f"{option}*" if option == choices.get(group) else option for option in options]
        picked = "" if choices.get(group) else "   (none picked)"
        lines += textwrap.wrap(
            f"{group}=" + " | ".join(marked) + picked, WIDTH, initial_indent="  ", subsequent_indent="      "
        )
    lines += ["", "Keys (KEY: TYPE = DEFAULT, then -> the value this command line gives where it differs):"]
    section = None
    for key in schema_keys():
        head = key.key.partition(".")[0] if "." in key.key else ""
        if head != section:
            section = head
            doc = (type(getattr(Config(), head)) if head else Config).__doc__
            lines += ["", *textwrap.wrap(f"[{head or 'top level'}] " + " ".join(doc.split()), WIDTH)]
        value = OmegaConf.select(composed, key.key, throw_on_resolution_failure=False)
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
        now = "" if override_text(value) == key.default else f" -> {override_text(value)}"
        lines.append(f"  {key.key}: {key.type} = {key.default}{now}")
        lines += textwrap.wrap(key.meaning, WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def preset_options(config_sources) -> dict[str, list[str]]:
    """Each config group's options: the ConfigStore's (a section's dataclass), then the YAML files of every
    directory on the search path (conf/, and DIR of --config-dir); the sections' groups first."""
    from hydra.core.config_store import ConfigStore

    register_schema()
    store = ConfigStore.instance()
    options: dict[str, list[str]] = {
        spec.name: [] for spec in dataclasses.fields(Config) if spec.default_factory is not dataclasses.MISSING
    }
    for group in options:
        if group in store.list(""):
            options[group] += [name.removesuffix(".yaml") for name in store.list(group)]
    for source in config_sources:
        if source.schema != "file":
            continue
        for directory in sorted(path for path in Path(source.path).iterdir() if path.is_dir()):
            found = options.setdefault(directory.name, [])
            found += sorted(path.stem for path in directory.glob("*.yaml") if path.stem not in found)
    return {group: names for group, names in options.items() if names and group != "hydra"}


CONFIGURATION_DOC_HEADER = """# Configuration keys

Every key of the one schema (`transformer/config.py`), with its type, default and meaning. Set any of them
on the command line (`make train key=value`, `transformer-train key=value`, `transformer-prepare key=value`);
presets (`model=small`, `data=multi30k_de_en`, `recipe=multi30k_long`, ...) change several at once.
`transformer-train --help` prints the same table for the presets and overrides you give it.
This file is generated: `.venv/bin/python -m transformer.cli.help --markdown > docs/configuration.md`
(a test fails when it is out of date).
"""


def configuration_markdown() -> str:
    """docs/configuration.md: the header and one table row per schema key."""
    return f"{CONFIGURATION_DOC_HEADER}\n{markdown_key_table()}\n"


def register_help_resolver() -> None:
    """hydra.main's --help: conf/config.yaml's hydra.help.template is ${transformer.help:PROGRAM}. Its
    text goes through string.Template, where $$ is a dollar sign."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver(
        "transformer.help", lambda program, *, _root_: render_help(program, _root_).replace("$", "$$"), replace=True
    )


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m transformer.cli.help --markdown > docs/configuration.md")
    sys.stdout.write(configuration_markdown())
