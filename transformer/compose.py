"""A Config from the presets: the schema put into Hydra's ConfigStore, composition with Hydra's compose API
(for what makes no run directory: prepare, bench, tests), its errors in one line naming the key, and how a
value and Hydra's config-source flags are written on a command line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformer.config import (
    CONF_DIR,
    Config,
    DecodeConfig,
    ModelConfig,
    TrainerConfig,
    composition_error_line,
)
from transformer.errors import ConfigError

_schema_registered = False


def register_schema() -> None:
    """Put the dataclasses into Hydra's ConfigStore: `schema` types the whole tree (conf/config.yaml
    lists it first), and each group's default option is its dataclass (no YAML copy of a default).
    Called by whatever composes a config (`compose_tree`, `transformer-train` before hydra.main), not on
    import: translating needs the schema's dataclasses, not Hydra (about 0.15 s of every start-up)."""
    global _schema_registered
    if _schema_registered:
        return
    _schema_registered = True
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store = ConfigStore.instance()
    schema = OmegaConf.structured(Config)
    # Hydra makes the composed tree "struct" (no new keys); this mapping's keys are the user's to add:
    # data.local_splits='{validation: dev, test: newstest2014}' on the command line.
    OmegaConf.set_struct(schema.data.local_splits, False)
    OmegaConf.set_struct(schema.decode.alpha_by_language, False)  # decode.alpha_by_language.en=2.5
    store.store(name="schema", node=schema)
    store.store(group="model", name="tiny", node=ModelConfig)
    store.store(group="trainer", name="default", node=TrainerConfig)
    store.store(group="decode", name="beam", node=DecodeConfig)


def compose(overrides: list[str] = (), config_name: str = "config", config_dir: str | None = None) -> Config:
    """The config `make train key=value ...` would see, composed with Hydra's compose API (for tools
    that make no run directory: prepare, bench, tests), with the presets of `config_dir` as
    `--config-dir` adds them. Errors become one ConfigError line."""
    from omegaconf import OmegaConf

    tree = compose_tree(overrides, config_name, config_dir)
    return Config.from_dict(OmegaConf.to_container(tree, resolve=True))


def compose_tree(
    overrides: list[str] = (), config_name: str = "config", config_dir: str | None = None, with_hydra: bool = False
):
    """The composed DictConfig, unresolved and unvalidated (what `--cfg job` prints); `with_hydra` keeps
    Hydra's node (the chosen presets, the config directories) for the help."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_schema()
    overrides = list(overrides)
    if config_dir is not None:
        directory = Path(config_dir).resolve()
        if not directory.is_dir():
            raise ConfigError(
                f"--config-dir {config_dir}: no such directory; give the directory that holds "
                "your presets (DIR/data/NAME.yaml, then data=NAME)"
            )
        quoted = str(directory).replace("\\", "\\\\").replace("'", "\\'")
        overrides.append(f"hydra.searchpath=['file://{quoted}']")  # where hydra.main puts --config-dir
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name, overrides=overrides, return_hydra_config=with_hydra)
    except (HydraException, OmegaConfBaseException) as error:
        raise ConfigError(composition_error_line(error)) from None


# Hydra's flags that choose what is composed, short form -> long form; a resume command repeats them.
HYDRA_CONFIG_FLAGS = {"-cd": "--config-dir", "-cn": "--config-name", "-cp": "--config-path"}


CONFIG_SOURCE_FLAGS = (*HYDRA_CONFIG_FLAGS, *HYDRA_CONFIG_FLAGS.values())


def override_text(value: Any) -> str:
    """A value as a key=value override writes it."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {override_text(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(override_text(item) for item in value) + "]"
    return str(value)
