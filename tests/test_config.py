import pytest

from tests.conftest import CONF_DIR, compose_config
from transformer.config import Config, ConfigError


@pytest.mark.parametrize("group", ["model", "data", "trainer", "decode"])
def test_every_config_group_option_composes(group):
    options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    assert options
    for option in options:
        cfg = compose_config([f"{group}={option}"])
        assert isinstance(cfg, Config)


def test_default_is_the_embedded_corpus_with_a_stopping_rule():
    cfg = compose_config()
    assert cfg.data.embedded and cfg.model.name == "tiny"
    assert cfg.trainer.max_steps > 0


def test_multi30k_reads_local_files_with_data_path():
    cfg = compose_config(["data=multi30k_de_en", "data.path=/somewhere", "model=small"])
    assert cfg.data.path == "/somewhere" and cfg.data.split_name("test") == "test_2016_flickr"
    assert (cfg.model.d_model, cfg.model.encoder_layers, cfg.model.n_heads) == (256, 3, 4)
    assert compose_config(["data=multi30k_en_de"]).data.src_lang == "en"


@pytest.mark.parametrize("override, message", [
    ("model.n_heads=3", "model.d_model=128 is not divisible by model.n_heads=3"),
    ("trainer.lr=-1", "trainer.lr=-1.0 must be > 0"),
    ("trainer.precision=fp8", "trainer.precision='fp8'"),
    ("model.dropout=1.5", "model.dropout=1.5 must be in"),
    ("trainer.max_tokens=0", "trainer.max_tokens=0 must be > 0"),
    ("decode.nbest=9", "decode.nbest=9 cannot exceed decode.beam_size=5"),
    ("+trainer.max_stepz=5", "unknown config key(s) trainer.max_stepz"),
    ("trainer.max_steps=abc", "trainer.max_steps='abc' must be of type int"),
    ("trainer.compile=3", "trainer.compile=3 must be true or false"),
])
def test_impossible_settings_name_the_key(override, message):
    with pytest.raises(ConfigError) as error:
        compose_config([override])
    assert message in str(error.value)


def test_no_stopping_rule_is_refused():
    with pytest.raises(ConfigError, match="no stopping rule"):
        compose_config(["trainer.max_steps=0", "trainer.max_minutes=0"])
