"""data.language_tag (issue 74): a multilingual model that reads its target-language tag in the decoder, in
place of BOS (`both`: in the source too; `decoder`: there only). Training places the tag in every batch,
decoding starts from it, a tag is never generated, and a run with it resumes exactly."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import FAST, compose_config
from tests.test_multilingual import _overrides, _write_corpus
from transformer.checkpoint import load_checkpoint, save_checkpoint
from transformer.config import ConfigError
from transformer.data.batching import Batch, place_language_tag
from transformer.data.prepare import prepare
from transformer.inference.decoders import ModelDecoder
from transformer.inference.search import Search, translate_ids
from transformer.inference.translator import Translator
from transformer.model import build_model
from transformer.special import BOS_ID, EOS_ID, PAD_ID


def test_the_tag_moves_into_the_decoders_first_input_and_nothing_is_predicted_at_it():
    tag_en, tag_de = 4, 5
    src = torch.tensor([[tag_en, 10, 11, EOS_ID], [tag_de, 12, EOS_ID, PAD_ID]])  # (B, S)
    tgt_in = torch.tensor([[BOS_ID, 20, 21], [BOS_ID, 22, PAD_ID]])
    tgt_out = torch.tensor([[20, 21, EOS_ID], [22, EOS_ID, PAD_ID]])
    batch = Batch(src, tgt_in, tgt_out, num_tgt_tokens=5)
    assert place_language_tag(batch, "source") is batch
    both = place_language_tag(batch, "both")
    assert both.src is src and both.tgt_in.tolist() == [[tag_en, 20, 21], [tag_de, 22, PAD_ID]]
    assert both.tgt_out is tgt_out and both.num_tgt_tokens == 5
    assert batch.tgt_in[:, 0].tolist() == [BOS_ID, BOS_ID]  # the collated batch itself is not changed
    decoder = place_language_tag(batch, "decoder")
    assert decoder.src.tolist() == [[10, 11, EOS_ID], [12, EOS_ID, PAD_ID]]
    assert decoder.tgt_in.tolist() == both.tgt_in.tolist()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.language_tag=target"], "data.language_tag='target' must be one of source, both, decoder"),
        (["data.language_tag=both"], "data.language_tag=both: the run trains a model into one language"),
    ],
)
def test_a_bad_or_pointless_language_tag_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_config(FAST + overrides)


@pytest.fixture(scope="module", params=["both", "decoder"])
def tagged(request, tmp_path_factory):
    """(side, tokenizer, untrained multilingual checkpoint reading its tag with data.language_tag=side)."""
    root = tmp_path_factory.mktemp("tagged")
    overrides = _overrides(_write_corpus(root / "toy", 300)) + [f"data.language_tag={request.param}"]
    cfg = compose_config(FAST + overrides, root / "cache")
    tok = prepare(cfg.data).tokenizer
    torch.manual_seed(0)
    model = build_model(cfg.model, tok.src_vocab_size, tok.tgt_vocab_size, tok.joint)
    path = root / "best.pt"
    state = {"model": model.state_dict(), "config": cfg.to_dict(), "tokenizer": tok.state_dict(), "step": 0}
    save_checkpoint(state, path)
    return request.param, tok, path


def test_decoding_starts_from_the_tag_and_the_source_holds_it_as_the_side_says(tagged):
    side, tok, path = tagged
    translator = Translator.from_checkpoint(path, device="cpu")
    assert translator.language_tag == side
    (ids,) = translator.encode_sources(["Der Hund ."], tgt_lang="en")
    assert (ids[0] == tok.tag_id("en")) == (side == "both")
    search = translator.search(translator_request(), "en", 1)
    assert search.start == tok.tag_id("en") and search.never == tok.tag_ids
    model = translator.model
    src = torch.tensor([ids + [EOS_ID]])
    first = ModelDecoder(model, src, start=search.start).logits(torch.tensor([[BOS_ID]]))
    with torch.no_grad():
        expected = model(src, torch.tensor([[tok.tag_id("en")]]))[:, -1]
    torch.testing.assert_close(first, expected)
    # the tag says the target language: the two requests differ even where the source is the same
    if side == "decoder":
        assert translator.score(["Der Hund ."], ["The dog ."], tgt_lang="en") != translator.score(
            ["Der Hund ."], ["The dog ."], tgt_lang="de"
        )


def translator_request():
    from transformer.inference.request import DecodeRequest

    return DecodeRequest(beam_size=3)


@pytest.mark.parametrize("beam", [1, 3])
def test_a_tag_is_never_generated_and_cached_decoding_equals_recomputing(tagged, beam):
    _, tok, path = tagged
    translator = Translator.from_checkpoint(path, device="cpu")
    first, end = tok.tag_ids
    with torch.no_grad():  # a model that would write a tag at every step, were they not barred
        translator.model.output.weight[first:end] *= 1000
    sources = ["Der Hund läuft .", "Ein Mann .", "Zwei Katzen spielen im Garten ."]
    cached = translator.hypotheses(sources, beam_size=beam, tgt_lang="de")
    uncached = translator.hypotheses(sources, beam_size=beam, tgt_lang="de", use_cache=False)
    for with_cache, without in zip(cached, uncached):
        assert with_cache[0].tokens == without[0].tokens
        assert with_cache[0].score == pytest.approx(without[0].score, abs=1e-4)
        assert not any(first <= token < end for token in with_cache[0].tokens)
        assert with_cache[0].tokens  # something else was written


@pytest.mark.parametrize("beam", [1, 3])
def test_a_start_per_sentence_decodes_each_as_its_own_language_alone_would(tagged, beam):
    """Search(start=[...]): one search for sentences into several languages (online back-translation's)."""
    side, tok, path = tagged
    model = Translator.from_checkpoint(path, device="cpu").model
    sources = [[5, 9, 12, 7], [8, 6], [10, 11, 13, 5, 6], [7, 7, 9]]
    starts = [tok.tag_id(language) for language in ("de", "en", "de", "en")]
    together = translate_ids(model, sources, Search(beam_size=beam, start=starts, never=tok.tag_ids))
    for source, start, hyps in zip(sources, starts, together):
        (alone,) = translate_ids(model, [source], Search(beam_size=beam, start=start, never=tok.tag_ids))
        assert hyps[0].tokens == alone[0].tokens and hyps[0].score == pytest.approx(alone[0].score, abs=1e-4)
    assert [h[0].tokens for h in together] != [
        h[0].tokens for h in translate_ids(model, sources, Search(beam_size=beam, start=starts[0], never=tok.tag_ids))
    ]  # the starts were read: one tag for all decodes something else
    with pytest.raises(ValueError, match="key/value cache"):
        translate_ids(model, sources, Search(beam_size=beam, start=starts, use_cache=False))


def test_an_ensemble_must_read_its_tags_alike(tagged, tmp_path):
    side, _, path = tagged
    state = load_checkpoint(path)
    state["config"]["data"]["language_tag"] = "source"
    other = tmp_path / "source.pt"
    save_checkpoint(state, other)
    from transformer.errors import CheckpointError

    with pytest.raises(CheckpointError, match=f"reads its language tag with data.language_tag=source, .* with {side}"):
        Translator.from_checkpoints([path, other], device="cpu")


@pytest.mark.slow
def test_a_run_with_the_tag_in_the_decoder_resumed_mid_epoch_equals_an_uninterrupted_one(tmp_path, data_cache, caplog):
    from transformer.training.trainer import train

    corpus = _write_corpus(tmp_path / "toy", 300)
    common = (
        FAST
        + _overrides(corpus)
        + [
            "data.language_tag=decoder",
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
    train(compose_config(common + ["trainer.max_steps=10"], data_cache), tmp_path / "full")
    train(compose_config(common + ["trainer.max_steps=5"], data_cache), tmp_path / "split")
    with caplog.at_level(logging.WARNING, logger="transformer"):
        train(compose_config(common + ["trainer.max_steps=10", "trainer.resume=true"], data_cache), tmp_path / "split")
    assert "not an exact resume" not in caplog.text
    full, resumed = (load_checkpoint(tmp_path / run / "checkpoints/last.pt") for run in ("full", "split"))
    assert full["config"]["data"]["language_tag"] == "decoder"
    for name, value in full["model"].items():
        assert torch.equal(value, resumed["model"][name]), name
    # and the tag mattered: a run that reads it in the source trains other weights
    in_source = [o for o in common if not o.startswith("data.language_tag")] + ["trainer.max_steps=10"]
    train(compose_config(in_source, data_cache), tmp_path / "source")
    source = load_checkpoint(tmp_path / "source/checkpoints/last.pt")
    assert source["config"]["data"]["language_tag"] == "source"
    assert not torch.equal(source["model"]["output.weight"], full["model"]["output.weight"])
