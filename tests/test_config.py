import re

import pytest

from tests.helpers import ROOT, compose_config
from transformer.config import CONF_DIR, Config, ConfigError

# Each group's default option is its dataclass in Hydra's ConfigStore (transformer/config.py).
SCHEMA_OPTIONS = {"model": ["tiny"], "trainer": ["default"], "decode": ["beam"], "data": []}
NEEDS_A_SOURCE = {"custom": ["data.path=/corpus"], "multi30k_multi": ["data.path=/corpus"]}


@pytest.mark.parametrize("group", ["model", "data", "trainer", "decode"])
def test_every_config_group_option_composes(group):
    options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")) + SCHEMA_OPTIONS[group]
    assert options
    for option in options:
        cfg = compose_config([f"{group}={option}"] + NEEDS_A_SOURCE.get(option, []))
        assert isinstance(cfg, Config) and getattr(getattr(cfg, group), "name", "default") == option


def test_the_presets_only_override_the_schema_defaults():
    """A default lives in one place: the YAML presets set no key to the value it already has."""
    import yaml

    from transformer.config import DataConfig, DecodeConfig, ModelConfig, TrainerConfig

    defaults = {"model": ModelConfig(), "data": DataConfig(), "trainer": TrainerConfig(), "decode": DecodeConfig()}
    for path in sorted(CONF_DIR.glob("*/*.yaml")):
        if path.parent.name == "recipe":  # recipes override data presets: the next test
            continue
        preset = yaml.safe_load(path.read_text())
        sections = preset if path.parent.name == "data" else {path.parent.name: preset}  # data: _global_
        for section, values in sections.items():
            for key, value in values.items():
                if key not in ("name", "src_lang", "tgt_lang"):  # what names a preset may be said again
                    assert getattr(defaults[section], key) != value, (
                        f"{path.name}: {section}.{key}={value} is the default"
                    )


# multi30k_long's dropout and length penalty equal the de-en data preset's today, but belong to the recipe (chosen
# for its model), not to the 20-minute presets that set theirs: said on purpose, so a change there leaves the recipe
@pytest.mark.parametrize(
    "recipe_name, base, restated",
    [
        ("multi30k_long", ["data=multi30k_de_en", "model=small"], {"model.dropout", "decode.alpha"}),
        ("multi30k_multi", ["data=multi30k_multi"], set()),
        ("augmented", ["data=multi30k_de_en", "model=small"], set()),
        ("multi30k_zero_shot", ["data=multi30k_multi"], set()),  # over recipe=multi30k_multi (its defaults)
    ],
)
def test_a_recipe_changes_every_key_it_sets_and_the_command_line_still_wins(recipe_name, base, restated):
    """A recipe comes after the data preset: each key it sets changes the composed config (none restates
    what its data preset and model already give, except the keys listed as restated on purpose; the recipe
    replaces the model), and key=value overrides it."""
    import yaml

    values = yaml.safe_load((CONF_DIR / "recipe" / f"{recipe_name}.yaml").read_text())
    parents = [f"recipe={parent}" for parent in values.pop("defaults", []) if parent != "_self_"]  # a recipe over one
    plain = compose_config(base + ["data.path=/corpus"] + parents)
    recipe = compose_config(base + ["data.path=/corpus", f"recipe={recipe_name}"])
    for section, keys in values.items():
        for key, value in keys.items():
            assert getattr(getattr(recipe, section), key) == value
            if f"{section}.{key}" in restated:  # listed because it restates: a stale entry fails
                assert getattr(getattr(plain, section), key) == value, f"{section}.{key} no longer restates"
            else:
                assert getattr(getattr(plain, section), key) != value, f"recipe {section}.{key}={value} changes nothing"
    for section in ("data", "decode"):  # what a recipe does not set stays the data preset's
        if section not in values:
            assert getattr(recipe, section) == getattr(plain, section), section
    mine = compose_config(base + ["data.path=/corpus", f"recipe={recipe_name}", "trainer.lr=1e-4", "model.d_model=64"])
    assert mine.trainer.lr == 1e-4 and mine.model.d_model == 64 and mine.model.d_ff == recipe.model.d_ff


def test_the_trainer_defaults_are_the_dataclass_defaults():
    from transformer.config import TrainerConfig

    cfg = compose_config(["data=custom", "data.path=/corpus"])
    assert cfg.trainer == TrainerConfig() and cfg.data.vocab_size == 16000 and cfg.data.name == "custom"


def test_default_is_the_embedded_corpus_with_a_stopping_rule():
    cfg = compose_config()
    assert cfg.data.embedded and cfg.model.name == "tiny"
    assert cfg.trainer.max_steps > 0


def test_multi30k_reads_local_files_with_data_path():
    cfg = compose_config(["data=multi30k_de_en", "data.path=/somewhere", "model=small"])
    assert cfg.data.path == "/somewhere" and cfg.data.split_name("test") == "test_2016_flickr"
    assert (cfg.model.d_model, cfg.model.encoder_layers, cfg.model.n_heads) == (256, 3, 4)
    assert compose_config(["data=multi30k_en_de"]).data.src_lang == "en"


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.n_heads=3", "model.d_model=128 is not divisible by model.n_heads=3"),
        ("trainer.lr=-1", "trainer.lr=-1.0 must be > 0"),
        ("trainer.precision=fp8", "trainer.precision='fp8'"),
        ("model.dropout=1.5", "model.dropout=1.5 must be in"),
        ("model.attention=flash", "model.attention='flash' must be one of auto, sdpa, matmul, math"),
        ("trainer.max_tokens=0", "trainer.max_tokens=0 must be > 0"),
        ("decode.nbest=9", "decode.nbest=9: must be between 1 and the beam size (decode.beam_size=5)"),
        (
            "+trainer.max_stepz=5",
            "unknown config key trainer.max_stepz; known keys: adam_eps, attention_heatmaps, average_last, betas",
        ),
        # type and key errors come from Hydra's own schema check, turned into one line
        (
            "trainer.max_stepz=5",
            "Could not override 'trainer.max_stepz'.: trainer.max_stepz: Key 'max_stepz' not in "
            "'TrainerConfig'; did you mean trainer.max_steps?",
        ),
        ("decode.xyzzy=5", "Key 'xyzzy' not in 'DecodeConfig'; `transformer-train --help` lists the decode keys"),
        ("trainer.max_steps=abc", "trainer.max_steps: Value 'abc' of type 'str' could not be converted to Integer"),
        ("model.dropout=high", "model.dropout: Value 'high' of type 'str' could not be converted to Float"),
        (
            "data.path=/corpus",
            "data.path=/corpus is set but data=toy is the embedded corpus, which ignores it; "
            "for your own corpus select the custom preset: make train data=custom data.path=/corpus",
        ),
        ("data=custom", "data config 'custom' names no source: set data.path=DIR"),
        ("trainer.schedule=cosine trainer.max_steps=100", "trainer.schedule=cosine decays from trainer.warmup=200"),
    ],
)
def test_impossible_settings_name_the_key(override, message):
    with pytest.raises(ConfigError) as error:
        compose_config(override.split())
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_saved_config_with_a_key_this_version_lacks_asks_for_an_upgrade():
    from transformer.config import Config

    saved = compose_config([]).to_dict()
    saved["decode"]["length_bonus"] = 0.5  # a key a later version would add
    with pytest.raises(
        ConfigError,
        match=r"^unknown config key decode.length_bonus: the model was saved by a newer "
        r"version of this package; to load it, upgrade this package: update the checkout .* \(git pull\) "
        r"and reinstall it \(pip install -e \. or make install\)$",
    ):
        Config.from_dict(saved, saved=True)


def test_no_stopping_rule_is_refused():
    with pytest.raises(ConfigError, match="no stopping rule"):
        compose_config(["trainer.max_steps=0", "trainer.max_minutes=0"])


def _float_keys() -> list[str]:
    """Every float key of the schema (lists of floats too), found from the dataclasses: a new key is
    covered without a change here."""
    import dataclasses

    return [
        f"{section.name}.{spec.name}"
        for section in dataclasses.fields(Config)
        if section.name != "run_dir"
        for spec in dataclasses.fields(section.default_factory())
        if "float" in str(spec.type)
    ]


def test_the_schema_has_the_float_keys_the_next_test_covers():
    keys = _float_keys()
    assert {
        "model.dropout",
        "data.character_coverage",
        "trainer.lr",
        "trainer.betas",
        "trainer.max_minutes",
        "decode.alpha",
        "decode.max_len_a",
    } <= set(keys)
    assert {k.split(".")[0] for k in keys} == {"model", "data", "trainer", "decode"}


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", _float_keys())
def test_every_float_key_refuses_a_non_finite_value_naming_it(key, value):
    from transformer.config import DataConfig, DecodeConfig, ModelConfig, TrainerConfig

    schema = {"model": ModelConfig, "data": DataConfig, "trainer": TrainerConfig, "decode": DecodeConfig}
    section, name = key.split(".")
    default = getattr(schema[section](), name)
    if isinstance(default, dict):  # a mapping of floats: one entry named
        key, given = f"{key}.en", value
    else:
        given = f"[0.9,{value}]" if isinstance(default, list) else value
    with pytest.raises(ConfigError) as error:
        compose_config([f"{key}={given}"])
    message = str(error.value)
    hint = "is not finite; give a finite number" + ("" if key.endswith(".en") else " (the default is")
    assert message.startswith(f"{key}=") and hint in message, message
    assert "\n" not in message


@pytest.mark.parametrize("max_len, max_positions, ok", [(64, 64, False), (64, 65, True), (200, 128, False)])
def test_the_positions_cover_the_longest_training_sentence_with_its_eos_or_bos(max_len, max_positions, ok):
    overrides = [f"data.max_len={max_len}", f"model.max_positions={max_positions}"]
    if ok:
        assert compose_config(overrides).model.max_positions == max_positions
        return
    with pytest.raises(ConfigError) as error:
        compose_config(overrides)
    assert str(error.value) == (
        f"model.max_positions={max_positions} is too small for data.max_len={max_len}: a sentence of {max_len} "
        f"tokens and its EOS (source) or BOS (target) take {max_len + 1} positions; set model.max_positions="
        f"{max_len + 1} or more, or data.max_len={max_positions - 1} or less"
    )


def test_the_readme_key_table_has_one_row_per_schema_key():
    from transformer.cli.help import markdown_key_table, schema_keys

    rows = markdown_key_table().splitlines()
    keys = schema_keys()
    assert len(rows) == 2 + len(keys) and len(keys) > 70
    for row, key in zip(rows[2:], keys):
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]]  # `str \| None` is one cell
        assert cells[0] == f"`{key.key}`" and cells[1].replace("\\|", "|") == key.type and cells[3], row
    assert "| `trainer.resume` | bool \\| str | `false` |" in rows[2 + [k.key for k in keys].index("trainer.resume")]


def test_docs_configuration_is_the_generated_key_table():
    from transformer.cli.help import configuration_markdown

    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert text == configuration_markdown(), (
        "regenerate: python -m transformer.cli.help --markdown > docs/configuration.md"
    )


def test_attention_heatmaps_takes_mean_heads_layers_or_off():
    from transformer.config import ConfigError

    assert compose_config(["trainer.attention_heatmaps=layers"]).trainer.attention_heatmaps == "layers"
    with pytest.raises(ConfigError, match="trainer.attention_heatmaps='all' must be one of mean, heads, layers, off"):
        compose_config(["trainer.attention_heatmaps=all"])


def test_a_bare_word_is_refused_but_flag_values_and_overrides_are_not():
    from transformer.cli.hydra_args import bare_word

    assert (
        bare_word(["-cd", "my_conf", "--cfg", "job", "model=small", "~trainer.seed", "+x=1", "--resolve"], "p") is None
    )
    assert bare_word(["--multirun", "trainer.lr=1e-3,5e-4", "hydra/sweeper=basic"], "p") is None
    assert bare_word(["model=small", "trainer.lr", "1e-3"], "p") == (
        "p: 'trainer.lr' is not an override: write KEY=VALUE or GROUP=OPTION (e.g. trainer.lr=VALUE); "
        "p --help lists them"
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.local_splits={validation: train}"],
            "data.local_splits: the validation split reads the training files "
            r"\(train\): best.pt would be chosen on training data",
        ),
        (["data.local_splits={test: train}"], "the test split reads the training files"),
        (["data.valid_split=train"], "the validation split reads the training files"),
        (
            ["data.local_splits={valid: val}"],
            r"data.local_splits: 'valid' is not a split of this run: its keys are the "
            r"splits train, validation, test",
        ),
    ],
)
def test_local_splits_that_name_no_split_or_the_training_files_are_refused(overrides, message):
    """Both were taken silently: `{validation: train}` validated (and picked best.pt) on the training
    data; a misspelt split name changed nothing."""
    with pytest.raises(ConfigError, match=message):
        compose_config(["data=multi30k_de_en", "data.path=/somewhere", *overrides])
    compose_config(["data=multi30k_de_en", "data.path=/somewhere", "data.local_splits={validation: dev}"])


def test_prepare_refuses_flags_it_would_misread_in_one_line(capsys):
    """`transformer-prepare -cn nope` was read as `-c n` ("invalid choice: 'n'"), and --resolve without
    --cfg job was ignored: a whole preparation ran and wrote ./data."""
    from transformer.cli.hydra_args import command_line_config

    for argv, message in (
        (["-cn", "nope"], "--config-name nope: it composes conf/config.yaml; put your presets in a --config-dir DIR"),
        (["--config-name=x"], "--config-name x: it composes conf/config.yaml"),
        (["--resolve"], "--resolve goes with --cfg job"),
    ):
        with pytest.raises(ConfigError, match=f"^transformer-prepare: {re.escape(message)}"):
            command_line_config(argv, "transformer-prepare")
    assert command_line_config(["--cfg", "job", "--resolve"], "transformer-prepare") is None
    assert "trainer:" in capsys.readouterr().out


def test_one_corpus_given_as_a_mapping_is_told_to_come_as_a_list():
    with pytest.raises(
        ConfigError,
        match=r"Cannot merge DictConfig with ListConfig; data.corpora is a list, one "
        r"\{...\} per corpus: data.corpora='\[\{path: DIR, weight: 2\}\]'",
    ):
        compose_config(["data.corpora={path: /x}"])
