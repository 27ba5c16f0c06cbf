"""The decoding options are defined once (`config.DECODE_OPTIONS`, from DecodeConfig's fields) and checked
once (`config.check_decode_options`): the config, the command lines (transformer-translate and
transformer-evaluate) and the Python API refuse the same values, each with one line that names the option
in its own words (decode.alpha=, --alpha, alpha=). Trains nothing."""

import dataclasses

import pytest

from tests.helpers import assert_one_line_refusal, compose_config, run_main
from transformer.cli.evaluate import build_parser as evaluate_parser
from transformer.cli.evaluate import main as evaluate_main
from transformer.cli.translate import build_parser as translate_parser
from transformer.cli.translate import main as translate_main
from transformer.config import DECODE_OPTIONS, Config, ConfigError, DecodeConfig
from transformer.inference.request import SEARCH_KEYS, DecodeRequest
from transformer.inference.translator import Translator

OPTIONS = {option.key: option for option in DECODE_OPTIONS}
FLOAT_OPTIONS = [option for option in DECODE_OPTIONS if not option.whole]
NON_FINITE = ["nan", "inf", "-inf"]
COMMAND_LINES = {"transformer-translate": translate_main, "transformer-evaluate": evaluate_main}


@pytest.fixture(scope="module")
def translator(untrained_checkpoint):
    return Translator.from_checkpoint(untrained_checkpoint, device="cpu")


def _config_error(key: str, value) -> str:
    """The config's refusal of decode.KEY=VALUE, through both of its doors: a composed override and
    `Config.from_dict` (a checkpoint's saved config); the same one line from each."""
    with pytest.raises(ConfigError) as composed:
        compose_config([f"decode.{key}={value}"])
    raw = compose_config().to_dict()
    raw["decode"][key] = value if isinstance(value, (int, float)) else float(value)
    with pytest.raises(ConfigError) as loaded:
        Config.from_dict(raw)
    assert str(composed.value) == str(loaded.value)
    return str(composed.value)


def _cli_error(program: str, capsys, *args) -> str:
    """The one stderr line of the command line `program` (`PROG: error: ...`) that refuses `args` with exit
    code 2, writing nothing."""
    code, out, err = run_main(COMMAND_LINES[program], capsys, *args)
    assert code == 2 and out == "", (code, out, err)
    return assert_one_line_refusal(err, program)


def _api_error(translator, **options) -> str:
    with pytest.raises(ValueError) as error:
        translator.translate(["Der Hund."], **options)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_the_float_options_are_the_ones_expected():
    assert {option.key for option in FLOAT_OPTIONS} == {"alpha", "max_len_a"}


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("key", [option.key for option in FLOAT_OPTIONS])
def test_the_config_refuses_a_non_finite_option_naming_its_key(key, value):
    message = _config_error(key, value)
    assert message.startswith(f"decode.{key}={value}") and "finite number" in message, message


@pytest.mark.parametrize("program", COMMAND_LINES)
@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("key", [option.key for option in FLOAT_OPTIONS])
def test_the_command_lines_refuse_a_non_finite_option_naming_its_flag(
    key, value, program, untrained_checkpoint, tmp_path, capsys
):
    flag = OPTIONS[key].flag
    source = tmp_path / "in.de"
    source.write_text("Der Hund.\n")
    inputs = ["--input", source] if program == "transformer-translate" else ["--src", source, "--ref", source]
    line = _cli_error(program, capsys, untrained_checkpoint, *inputs, f"{flag}={value}")
    assert line == f"{program}: error: {flag} {value}: {OPTIONS[key].rule}", line
    # `--alpha -inf`: argparse takes -inf for an option; still one line that names the flag and the fix.
    line = _cli_error(program, capsys, untrained_checkpoint, *inputs, flag, value)
    assert line.startswith(f"{program}: error: ") and flag in line, line
    assert f"{flag} {value}: {OPTIONS[key].rule}" in line or f"is written {flag}=VALUE" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.de"]


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("key", [option.key for option in FLOAT_OPTIONS])
def test_the_api_refuses_a_non_finite_option_naming_its_keyword(key, value, translator):
    message = _api_error(translator, **{key: float(value)})
    assert message == f"{key}={float(value)!r}: {OPTIONS[key].rule}", message


# One bad value per option (below its smallest) and nbest above the beam: the three refuse it with the same
# words after the option's name.
BAD = [{option.key: option.low - (1 if option.whole else 0.5)} for option in DECODE_OPTIONS] + [
    {"alpha": 1e300},
    {"beam_size": 2, "nbest": 3},
]  # alpha 1e300: the length penalty overflowed


@pytest.mark.parametrize("values", BAD, ids=lambda values: ",".join(f"{k}={v}" for k, v in values.items()))
def test_the_config_the_command_lines_and_the_api_say_the_same(values, translator, untrained_checkpoint, capsys):
    refused = list(values)[-1]  # the option in question: nbest, not the beam
    with pytest.raises(ConfigError) as error:
        compose_config([f"decode.{key}={value}" for key, value in values.items()])
    config = str(error.value)
    api = _api_error(translator, **values)
    flags = [text for key, value in values.items() for text in (OPTIONS[key].flag, value)]
    cli = _cli_error("transformer-translate", capsys, untrained_checkpoint, *flags).removeprefix(
        "transformer-translate: error: "
    )
    names = {"config": f"decode.{refused}=", "api": f"{refused}=", "cli": f"{OPTIONS[refused].flag} "}
    for where, message in (("config", config), ("api", api), ("cli", cli)):
        assert message.startswith(names[where] + str(values[refused]) + ": "), (where, message)
    words = {
        message.partition(": ")[2].replace("decode.beam_size=", "").replace("beam_size=", "").replace("--beam ", "")
        for message in (config, api, cli)
    }
    assert len(words) == 1, (config, api, cli)


def _decoding_flags(parser) -> dict:
    """The flags of a parser's `decoding options` group: {flag: argparse action} (argparse lists its groups
    only in private attributes)."""
    (group,) = [g for g in parser._action_groups if g.title == "decoding options"]
    return {action.option_strings[0]: action for action in group._group_actions}


def test_the_command_lines_offer_the_options_the_config_defines():
    # decode.alpha_by_language is a table per target language, not one value a flag could give
    keys = {spec.name for spec in dataclasses.fields(DecodeConfig)} - {"name", "alpha_by_language"}
    assert set(OPTIONS) == keys
    everywhere = {option.flag for option in DECODE_OPTIONS}
    assert set(_decoding_flags(translate_parser())) == everywhere
    assert set(_decoding_flags(evaluate_parser())) == everywhere - {"--nbest"}  # it scores the best one
    for parser in (translate_parser(), evaluate_parser()):
        flagged = _decoding_flags(parser)
        for flag, action in flagged.items():
            option = next(option for option in DECODE_OPTIONS if option.flag == flag)
            assert (
                action.default is None and action.help.startswith(option.meaning) and str(option.default) in action.help
            ), (flag, action.help)
        # No second, hand-written flag for an option outside the group.
        others = [action for action in parser._actions if action not in flagged.values()]
        assert not {action.dest for action in others} & {action.dest for action in flagged.values()}
    # The Python API takes them as one DecodeRequest (or its fields as keywords): None = the checkpoint's.
    fields = {spec.name: spec for spec in dataclasses.fields(DecodeRequest)}
    assert keys == set(SEARCH_KEYS) and keys <= set(fields) and all(fields[key].default is None for key in keys)


def test_options_left_out_come_from_the_checkpoint_or_the_schema():
    saved = DecodeConfig(beam_size=3, alpha=1.5, max_len_a=2.0, max_len_b=4, batch_tokens=99, nbest=2)
    chosen = saved.for_translation(
        beam_size=None, alpha=0.0, nbest=None, max_len_a=None, max_len_b=None, batch_tokens=None
    )
    assert (chosen.beam_size, chosen.alpha, chosen.max_len_a, chosen.max_len_b) == (3, 0.0, 2.0, 4)
    assert (chosen.nbest, chosen.batch_tokens) == (OPTIONS["nbest"].default, OPTIONS["batch_tokens"].default)


@pytest.mark.parametrize("key", [option.key for option in DECODE_OPTIONS if option.whole])
def test_a_fraction_for_a_whole_option_is_refused_alike_by_the_command_line_and_the_api(
    key, translator, untrained_checkpoint, capsys
):
    flag = OPTIONS[key].flag
    rule = OPTIONS[key].rule  # "must be a whole number >= LOW" (and "<= HIGH" where it has one)
    assert (
        _cli_error("transformer-translate", capsys, untrained_checkpoint, flag, "2.5")
        == f"transformer-translate: error: {flag} 2.5: {rule}"
    )
    assert _api_error(translator, **{key: 2.5}) == f"{key}=2.5: {rule}"
