"""trainer.online_backtranslation (issue 74): a share of each batch's pairs get the model's own translation of
their target into another language as their source; the draws are a function of (seed, step, pair), the
targets never change, and a run with it resumes exactly."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from tests.helpers import FAST, compose_config
from tests.test_zero_shot import _three_languages
from transformer.checkpoint import load_checkpoint
from transformer.config import ConfigError, CorpusConfig
from transformer.data.batching import place_language_tag
from transformer.data.prepare import prepare
from transformer.inference.search import Search, translate_ids
from transformer.model import build_model, eval_mode
from transformer.special import EOS_ID, PAD_ID
from transformer.training.backtranslation import OnlineBacktranslation


@pytest.fixture(scope="module", params=["source", "decoder"])
def setup(request, tmp_path_factory):
    """(side, tokenizer, an untrained model, a training batch of every direction with the tag placed)."""
    root = tmp_path_factory.mktemp("robt")
    cfg = compose_config(FAST + _three_languages(root / "toy") + [f"data.language_tag={request.param}"], root / "c")
    data = prepare(cfg.data)
    tok = data.tokenizer
    torch.manual_seed(0)
    model = build_model(cfg.model, tok.src_vocab_size, tok.tgt_vocab_size, tok.joint, protected_ids=tok.protected_ids)
    positions = [start + k for start in data.train.starts[:-1].tolist() for k in range(6)]  # 6 of each corpus
    batch = place_language_tag(data.train.collate(positions), request.param)
    return request.param, tok, model, batch


def _robt(setup, share=0.5, start=0, seed=1, end=None, routes=None):
    side, tok, model, _ = setup
    return OnlineBacktranslation(
        share, start, seed, model, tok, side, 64, torch.device("cpu"), None, end=end, routes=routes
    )


# The toy's routes (DataConfig.pivot_routes): de and fr are trained from English alone, and English into both
PIVOT_ROUTES = {"de": ("en", ["fr"]), "fr": ("en", ["de"])}


def _directions(path, *pairs):
    """data.corpora of these (source, target) pairs, each in `path`."""
    return ["data.corpora=[" + ", ".join(f"{{path: {path}, src_lang: {a}, tgt_lang: {b}}}" for a, b in pairs) + "]"]


def test_the_pivot_routes_are_the_targets_one_language_alone_is_trained_into(tmp_path):
    cfg = compose_config(FAST + _three_languages(tmp_path / "toy")).data
    assert cfg.pivot_routes() == PIVOT_ROUTES

    def routes(*pairs):
        corpora = [CorpusConfig(path="x", src_lang=a, tgt_lang=b) for a, b in pairs]
        return dataclasses.replace(cfg, corpora=corpora).pivot_routes()

    through_english = [(x, "en") for x in ("de", "fr", "cs")] + [("en", x) for x in ("de", "fr", "cs")]
    assert routes(*through_english) == {
        "cs": ("en", ["de", "fr"]),
        "de": ("en", ["cs", "fr"]),
        "fr": ("en", ["cs", "de"]),
    }
    # fr is trained from en and de: its rows do not say which their source is; de -> fr is trained, not zero-shot
    assert routes(*through_english, ("de", "fr")) == {"cs": ("en", ["de", "fr"]), "de": ("en", ["cs", "fr"])}
    assert routes(("de", "en"), ("fr", "en"), ("en", "de")) == {}  # into de from en alone; en into no third


def test_side_source_draws_the_pairs_from_the_pivot_into_a_zero_shot_direction(setup):
    side, tok, _, batch = setup
    tags = (batch.tgt_in[:, 0] if side != "source" else batch.src[:, 0]).tolist()
    into = {tok.tag_id(language): language for language in tok.target_languages}
    everything = _robt(setup, share=1.0, routes=PIVOT_ROUTES).draws(batch, step=7)
    assert sorted(row for row, _ in everything) == [row for row, tag in enumerate(tags) if into[tag] != "en"]
    for row, third in everything:  # English -> de pairs become fr -> de, English -> fr pairs de -> fr
        assert third == {"de": "fr", "fr": "de"}[into[tags[row]]]
    half = _robt(setup, share=0.5, routes=PIVOT_ROUTES).draws(batch, step=7)
    assert 0 < len(half) < len(everything) and set(half) <= set(everything)
    assert _robt(setup, share=0.5, routes=PIVOT_ROUTES).draws(batch, step=7) == half


def test_side_source_gives_a_drawn_pair_the_models_translation_of_its_source(setup):
    side, tok, model, batch = setup
    robt = _robt(setup, share=1.0, routes=PIVOT_ROUTES)
    made = robt.batch(batch, step=3)
    assert torch.equal(made.tgt_out, batch.tgt_out) and made.num_tgt_tokens == batch.num_tgt_tokens
    drawn = dict(robt.draws(batch, step=3))
    assert drawn
    for row in range(len(batch.src)):
        source = [i for i in made.src[row].tolist() if i not in (PAD_ID, EOS_ID)]
        original = [i for i in batch.src[row].tolist() if i not in (PAD_ID, EOS_ID)]
        if row not in drawn:
            assert source == original
            continue
        text = original[1:] if side != "decoder" else original  # the English source, without its tag
        tag = tok.tag_id(drawn[row])
        search = Search(beam_size=1, workers=1, start=tag if side != "source" else None, never=tok.tag_ids)
        with torch.no_grad(), eval_mode(model):
            (hyps,) = translate_ids(model, [([tag] if side != "decoder" else []) + text], search)
        assert source == ((original[:1] if side != "decoder" else []) + hyps[0].tokens)[:64]


def test_the_draws_follow_the_pair_and_the_step_not_its_place_in_the_batch(setup):
    side, tok, _, batch = setup
    robt = _robt(setup)
    drawn = robt.draws(batch, step=7)
    assert 0 < len(drawn) < len(batch.src)  # about half of 24
    assert robt.draws(batch, step=7) == drawn and robt.draws(batch, step=8) != drawn
    order = torch.arange(len(batch.src)).flip(0)  # the same pairs in another order: the same pairs drawn
    flipped = type(batch)(batch.src[order], batch.tgt_in[order], batch.tgt_out[order], batch.num_tgt_tokens)
    assert sorted((len(order) - 1 - row, into) for row, into in robt.draws(flipped, step=7)) == sorted(drawn)
    tags = batch.tgt_in[:, 0] if side != "source" else batch.src[:, 0]
    for row, into in drawn:  # another language than the target's, and one of the model's
        assert into in tok.target_languages and tok.tag_id(into) != int(tags[row])
    assert len({into for _, into in drawn}) > 1
    assert _robt(setup, share=0.0).draws(batch, 7) == [] and len(_robt(setup, share=1.0).draws(batch, 7)) == 24


def test_a_drawn_pair_gets_the_models_translation_of_its_target_as_its_source(setup):
    side, tok, model, batch = setup
    robt = _robt(setup)
    assert robt([(batch, 1.0)], step=0)[0][0] is not batch and robt([(batch, 1.0)], step=-1)[0][0] is batch
    before = _robt(setup, start=5)
    assert before([(batch, 1.0)], step=4)[0][0] is batch  # not before trainer.online_backtranslation_from
    window = _robt(setup, start=5, end=8)  # trainer.online_backtranslation_until: from step 8 on, no more
    assert window([(batch, 1.0)], step=7)[0][0] is not batch and window([(batch, 1.0)], step=8)[0][0] is batch
    made = robt.batch(batch, step=3)
    assert torch.equal(made.tgt_in, batch.tgt_in) and torch.equal(made.tgt_out, batch.tgt_out)
    assert made.num_tgt_tokens == batch.num_tgt_tokens
    drawn = dict(robt.draws(batch, step=3))
    for row in range(len(batch.src)):
        source = [i for i in made.src[row].tolist() if i not in (PAD_ID, EOS_ID)]
        original = [i for i in batch.src[row].tolist() if i not in (PAD_ID, EOS_ID)]
        if row not in drawn:
            assert source == original
            continue
        target = [i for i in batch.tgt_out[row].tolist() if i not in (PAD_ID, EOS_ID)]
        tag = tok.tag_id(drawn[row])
        search = Search(beam_size=1, workers=1, start=tag if side != "source" else None, never=tok.tag_ids)
        with torch.no_grad(), eval_mode(model):
            (hyps,) = translate_ids(model, [([tag] if side != "decoder" else []) + target], search)
        expected = (original[:1] if side != "decoder" else []) + hyps[0].tokens
        assert source == expected[:64], (len(source), len(expected), source[-5:], expected[-5:])
        if side != "decoder":
            assert source[0] == original[0]  # the pair keeps its own tag: the language of its target
    assert model.training  # generated with dropout off, then back to training


def test_with_a_lower_case_source_the_model_reads_and_gets_sources_as_the_source_side_writes_them(
    tmp_path, monkeypatch
):
    """data.lowercase_source writes a source without the target's case markers (`der koch`, not `der ⓣ koch ⓣ`):
    a target translated, and the translation that becomes the new source, go through text into that form."""
    from transformer.data import casing
    from transformer.training import backtranslation

    cfg = compose_config(
        FAST + _three_languages(tmp_path / "toy") + ["data.inline_case=true", "data.lowercase_source=true"],
        tmp_path / "c",
    )
    data = prepare(cfg.data)
    tok = data.tokenizer
    assert tok.lowercase_source
    positions = [start + k for start in data.train.starts[:-1].tolist() for k in range(6)]
    batch = place_language_tag(data.train.collate(positions), "source")
    read = []

    def echo(model, sources, search, **kwargs):  # a "translation" that writes back what it read
        read.extend(sources)
        return [[type("Hypothesis", (), {"tokens": source[1:]})()] for source in sources]

    monkeypatch.setattr(backtranslation, "translate_ids", echo)
    robt = OnlineBacktranslation(1.0, 0, 1, torch.nn.Linear(1, 1), tok, "source", 64, torch.device("cpu"), None)
    made = robt.batch(batch, step=3)
    title = tok.src.piece_to_id(casing.TITLE)
    targets = [[i for i in row.tolist() if i not in (PAD_ID, EOS_ID)] for row in batch.tgt_out]
    assert all(title in target for target in targets)  # every toy sentence starts with a capital
    assert [source[1:] for source in read] == [tok.encode_src([text])[0] for text in tok.decode_tgt(targets)]
    for row, source in enumerate(made.src.tolist()):
        source = [i for i in source if i not in (PAD_ID, EOS_ID)]
        assert source[0] == batch.src[row, 0] and title not in source
        (text,) = tok.decode_tgt([targets[row]])
        assert tok.decode_src([source[1:]]) == [casing.decode_source(casing.encode_source(text))]


def test_online_backtranslation_needs_a_multilingual_model_and_a_share(tmp_path):
    with pytest.raises(ConfigError, match="trainer.online_backtranslation=0.5: the run trains a model into one"):
        compose_config(FAST + ["trainer.online_backtranslation=0.5"])
    with pytest.raises(ConfigError, match=r"trainer.online_backtranslation=1.5 must be a share of pairs in \[0, 1\]"):
        compose_config(FAST + _three_languages(tmp_path / "toy") + ["trainer.online_backtranslation=1.5"])
    with pytest.raises(ConfigError, match="trainer.online_backtranslation_side='both' must be one of target, source"):
        compose_config(FAST + _three_languages(tmp_path / "toy") + ["trainer.online_backtranslation_side=both"])
    with pytest.raises(
        ConfigError, match=r"trainer.online_backtranslation_side=source: no target language .* \(de-en, fr-en, en-de\)"
    ):
        compose_config(
            FAST
            + _three_languages(tmp_path / "toy")
            + _directions(tmp_path / "toy", ("de", "en"), ("fr", "en"), ("en", "de"))
            + ["trainer.online_backtranslation=0.5", "trainer.online_backtranslation_side=source"]
        )
    with pytest.raises(ConfigError, match="trainer.online_backtranslation_until=300 must come after"):
        compose_config(
            FAST
            + _three_languages(tmp_path / "toy")
            + ["trainer.online_backtranslation=0.5", "trainer.online_backtranslation_from=300"]
            + ["trainer.online_backtranslation_until=300"]
        )


@pytest.mark.slow
@pytest.mark.parametrize("side", ["target", "source"])
def test_a_run_with_online_backtranslation_resumed_mid_epoch_equals_an_uninterrupted_one(
    side, tmp_path, data_cache, caplog
):
    from transformer.training.trainer import train

    common = (
        FAST
        + _three_languages(tmp_path / "toy")
        + [
            "trainer.online_backtranslation=0.3",
            "trainer.online_backtranslation_from=2",
            f"trainer.online_backtranslation_side={side}",
            "data.language_tag=both",
            "trainer.precision=fp32",
            "trainer.device=cpu",
            "trainer.max_tokens=3000",
            "trainer.validate_every=4",
            "trainer.val_max_sentences=8",
            "decode.beam_size=1",
            "model.dropout=0.2",
            "trainer.max_minutes=0",
            "trainer.test_at_end=false",
        ]
    )
    train(compose_config(common + ["trainer.max_steps=8"], data_cache), tmp_path / "full")
    said = {
        "target": "0.3 of each batch's pairs, their targets",
        "source": "0.3 of the pairs into de, fr, their sources",
    }
    assert f"online back-translation: {said[side]}" in (tmp_path / "full/train.log").read_text()
    train(compose_config(common + ["trainer.max_steps=5"], data_cache), tmp_path / "split")
    with caplog.at_level(logging.WARNING, logger="transformer"):
        train(compose_config(common + ["trainer.max_steps=8", "trainer.resume=true"], data_cache), tmp_path / "split")
    assert "not an exact resume" not in caplog.text
    full, resumed = (load_checkpoint(tmp_path / run / "checkpoints/last.pt") for run in ("full", "split"))
    for name, value in full["model"].items():
        assert torch.equal(value, resumed["model"][name]), name
    off = [o for o in common if not o.startswith("trainer.online_backtranslation=")] + ["trainer.max_steps=8"]
    train(compose_config(off, data_cache), tmp_path / "off")
    plain = load_checkpoint(tmp_path / "off/checkpoints/last.pt")
    assert not torch.equal(plain["model"]["output.weight"], full["model"]["output.weight"])  # it trained on others
