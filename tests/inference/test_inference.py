"""Ensembles, target prefixes and int8 weights through the Python API (`Translator`); the search-level
proofs (an ensemble of two equals the hand-averaged log-probabilities, a prefix's continuation equals the
model's own uncached greedy continuation) are in test_search.py."""

import pytest
import torch

from tests.helpers import assert_one_line_refusal, one_line, run_main
from transformer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from transformer.data.batching import pad_sequences
from transformer.data.tokenizer import Tokenizer, train_sentencepiece
from transformer.data.toy import generate
from transformer.inference.decoders import ModelDecoder
from transformer.inference.search import Search, beam_search, max_lengths, translate_ids
from transformer.inference.translator import Translator
from transformer.kernels import Int8Linear
from transformer.special import EOS_ID

SENTENCES = ["Der Hund sieht die Katze.", "Die Kuh.", "Oft ruft das Kind den Vogel."]


@pytest.fixture(scope="module")
def other_vocabulary_checkpoint(untrained_checkpoint, tmp_path_factory):
    """The untrained checkpoint with another SentencePiece model of the same size."""
    state = load_checkpoint(untrained_checkpoint)
    src, tgt = generate(300, 10, 10, seed=7)["train"]
    state["tokenizer"] = Tokenizer(
        train_sentencepiece(src + tgt, vocab_size=120, model_type="unigram", character_coverage=1.0, sample=10_000)
    ).state_dict()
    path = tmp_path_factory.mktemp("other-vocab") / "best.pt"
    save_checkpoint(state, path)
    return path


def test_an_ensemble_of_a_checkpoint_with_itself_translates_as_the_checkpoint(untrained_checkpoint):
    alone = Translator.from_checkpoint(untrained_checkpoint, device="cpu", precision="fp32")
    pair = Translator.from_checkpoints(
        [untrained_checkpoint, untrained_checkpoint], weights=[1, 2], device="cpu", precision="fp32"
    )
    assert len(pair.models) == 2 and pair.models[0] is not pair.models[1]
    for beam in (1, 3):
        assert pair.translate(SENTENCES, beam_size=beam, max_len_b=6) == alone.translate(
            SENTENCES, beam_size=beam, max_len_b=6
        )


def test_an_ensembles_reference_score_is_the_weighted_mean_of_its_models(untrained_checkpoint, tmp_path):
    """score() of an ensemble used its first model alone (translate() followed the weights): the
    ensemble's search scores a token by the weighted mean of the models' log-probabilities, so a
    reference's score is the weighted mean of their scores."""
    state = load_checkpoint(untrained_checkpoint)
    generator = torch.Generator().manual_seed(3)
    state["model"] = {
        name: value + 0.05 * torch.randn(value.shape, generator=generator) if value.is_floating_point() else value
        for name, value in state["model"].items()
    }
    other = tmp_path / "other.pt"
    save_checkpoint(state, other)
    references = ["The dog sees the cat.", "The cow.", "The child often calls the bird."]
    alone = [
        Translator.from_checkpoint(path, device="cpu", precision="fp32").score(SENTENCES, references)
        for path in (untrained_checkpoint, other)
    ]
    assert all(abs(a - b) > 1e-3 for a, b in zip(*alone))
    pair = Translator.from_checkpoints([untrained_checkpoint, other], weights=[1, 3], device="cpu", precision="fp32")
    assert pair.score(SENTENCES, references) == pytest.approx([0.25 * a + 0.75 * b for a, b in zip(*alone)], rel=1e-5)
    pair.weights = [0, 1]
    assert pair.score(SENTENCES, references) == pytest.approx(alone[1], rel=1e-6)


def test_an_ensemble_refuses_models_with_different_vocabularies(untrained_checkpoint, other_vocabulary_checkpoint):
    with pytest.raises(CheckpointError, match="vocabulary differs") as error:
        Translator.from_checkpoints([untrained_checkpoint, other_vocabulary_checkpoint], device="cpu")
    assert str(other_vocabulary_checkpoint) in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("weights", [[1.0], [1.0, float("nan")], [0, 0], [-1, 2], [1, True]])
def test_ensemble_weights_that_do_not_fit_are_refused(untrained_checkpoint, weights):
    with pytest.raises(ValueError, match="weights="):
        Translator.from_checkpoints([untrained_checkpoint, untrained_checkpoint], weights=weights, device="cpu")


def test_a_prefix_starts_the_translation_and_empty_means_none(untrained_checkpoint):
    translator = Translator.from_checkpoint(untrained_checkpoint, device="cpu", precision="fp32")
    plain = translator.translate(SENTENCES, beam_size=1, max_len_b=6)
    prefixed = translator.translate(SENTENCES, beam_size=1, max_len_b=6, prefixes=["the dog", "", "a cat sees"])
    assert prefixed[0].startswith("the dog") and prefixed[2].startswith("a cat sees")
    assert prefixed[1] == plain[1]
    empty = translator.translate(["", "", SENTENCES[0]], beam_size=1, max_len_b=6, prefixes=["the dog", "", ""])
    assert empty[0].startswith("the dog") and empty[1] == "" and empty[2] == plain[0]  # the prefix was dropped
    beam = translator.translate_hypotheses(SENTENCES, beam_size=3, nbest=3, max_len_b=6, prefixes=["the dog"] * 3)
    assert all(text.startswith("the dog") for hyps in beam for text, _ in hyps)


def test_prefixes_must_be_one_per_sentence(untrained_checkpoint):
    translator = Translator.from_checkpoint(untrained_checkpoint, device="cpu")
    with pytest.raises(ValueError, match="2 prefixes for 3 sentences"):
        translator.translate(SENTENCES, prefixes=["a", "b"])
    with pytest.raises(TypeError, match="prefixes must be a list of str"):
        translator.translate(SENTENCES, prefixes="the dog")


def test_a_prefix_as_long_as_the_model_allows_still_ends(untrained_checkpoint):
    translator = Translator.from_checkpoint(untrained_checkpoint, device="cpu", precision="fp32")
    long_prefix = " ".join(["the dog"] * 200)
    with torch.no_grad():
        hyps = translator.hypotheses(SENTENCES[:1], beam_size=2, prefixes=[long_prefix])
    assert len(hyps[0][0].tokens) <= translator.max_length


def test_int8_weights_keep_the_search_equivalences(untrained_checkpoint):
    """With int8 linear layers: cached decoding equals recomputing the prefix, beam 1 equals greedy."""
    translator = Translator.from_checkpoint(untrained_checkpoint, device="cpu", quantize="int8")
    assert isinstance(translator.model.output, Int8Linear)
    sources = translator.encode_sources(SENTENCES)
    for beam in (1, 3):
        cached = translate_ids(translator.model, sources, Search(beam_size=beam, max_len_b=8))
        uncached = translate_ids(translator.model, sources, Search(beam_size=beam, max_len_b=8, use_cache=False))
        assert [h[0].tokens for h in cached] == [h[0].tokens for h in uncached]
    greedy = translate_ids(translator.model, sources, Search(beam_size=1, max_len_b=8))
    src = pad_sequences(sources, suffix=[EOS_ID])
    with torch.inference_mode():
        beam1 = beam_search(ModelDecoder(translator.model, src), max_lengths(src, 1.2, 8, 1000), beam_size=1)
    assert [h[0].tokens for h in beam1] == [h[0].tokens for h in greedy]
    float_model = Translator.from_checkpoint(untrained_checkpoint, device="cpu", precision="fp32").model
    assert not torch.equal(translator.model.encode(src[:1]), float_model.encode(src[:1]))  # int8 really ran


@pytest.mark.parametrize(
    "options, message",
    [
        ({"quantize": "int4"}, "quantize='int4': must be int8"),
        ({"quantize": "int8", "precision": "bf16"}, "leave precision=bf16 out"),
    ],
)
def test_int8_settings_that_do_not_fit_are_refused(untrained_checkpoint, options, message):
    with pytest.raises(ValueError, match=message):
        Translator.from_checkpoint(untrained_checkpoint, device="cpu", **options)


# --- the command lines --------------------------------------------------------------------------------


@pytest.fixture
def source_file(tmp_path):
    path = tmp_path / "in.de"
    path.write_text("".join(s + "\n" for s in SENTENCES), encoding="utf-8")
    return path


def test_translate_takes_an_ensemble_weights_and_workers(untrained_checkpoint, source_file, capsys):
    from transformer.cli.translate import main

    common = ["--input", source_file, "--beam", 2, "--max-len-b", 6, "--precision", "fp32"]
    rc, alone, _ = run_main(main, capsys, untrained_checkpoint, *common)
    assert rc == 0 and len(alone.splitlines()) == 3
    rc, pair, _ = run_main(main, capsys, untrained_checkpoint, untrained_checkpoint, "--weights", "1,3", *common)
    assert rc == 0 and pair == alone
    rc, parallel, _ = run_main(main, capsys, untrained_checkpoint, "--workers", 2, "--batch-tokens", 20, *common)
    assert rc == 0 and parallel == alone


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--weights", "1"], "--weights 1: give 2 comma-separated numbers >= 0, one per checkpoint"),
        (["--weights", "1,nan"], "--weights 1,nan: give 2"),
        (["--workers", "0"], "--workers 0: must be a whole number >= 1"),
        (["--quantize", "int8", "--precision", "bf16"], "--quantize int8 runs float32 around its int8 layers"),
    ],
)
def test_translate_refuses_ensemble_settings_that_do_not_fit(untrained_checkpoint, source_file, capsys, extra, message):
    from transformer.cli.translate import main

    rc, out, err = run_main(main, capsys, untrained_checkpoint, untrained_checkpoint, "--input", source_file, *extra)
    assert rc == 2 and out == "" and message in assert_one_line_refusal(err, "transformer-translate"), err


def test_translate_refuses_an_ensemble_over_two_vocabularies(
    untrained_checkpoint, other_vocabulary_checkpoint, source_file, capsys
):
    from transformer.cli.translate import main

    rc, out, err = run_main(main, capsys, untrained_checkpoint, other_vocabulary_checkpoint, "--input", source_file)
    assert rc == 2 and out == "" and "vocabulary differs" in assert_one_line_refusal(err, "transformer-translate")


def test_translate_keeps_the_prefixes_of_a_prefix_file(untrained_checkpoint, source_file, tmp_path, capsys):
    from transformer.cli.translate import main

    prefixes = tmp_path / "prefix.en"
    prefixes.write_text("the dog\n\na cat sees\n", encoding="utf-8")
    common = ["--input", source_file, "--beam", 1, "--max-len-b", 6, "--precision", "fp32"]
    rc, plain, _ = run_main(main, capsys, untrained_checkpoint, *common)
    rc, out, err = run_main(main, capsys, untrained_checkpoint, *common, "--prefix", prefixes)
    lines = out.splitlines()
    assert rc == 0 and lines[0].startswith("the dog") and lines[2].startswith("a cat sees"), (out, err)
    assert lines[1] == plain.splitlines()[1]
    prefixes.write_text("the dog\n", encoding="utf-8")
    rc, out, err = run_main(main, capsys, untrained_checkpoint, *common, "--prefix", prefixes)
    assert (
        rc == 2
        and out == ""
        and one_line(err)
        == f"transformer-translate: error: --prefix {prefixes}: 1 lines for 3 "
        "input lines; give one prefix per input line (an empty line for none)"
    )
    rc, out, err = run_main(main, capsys, untrained_checkpoint, *common, "--prefix", prefixes, "--output", prefixes)
    assert rc == 2 and "is the --prefix file" in assert_one_line_refusal(err, "transformer-translate")
    assert prefixes.read_text() == "the dog\n"  # never overwritten


def test_evaluate_takes_an_ensemble(untrained_checkpoint, source_file, tmp_path, capsys):
    import json
    import shutil

    from transformer.cli.evaluate import main

    first = tmp_path / "a.pt"
    shutil.copy(untrained_checkpoint, first)
    rc, out, err = run_main(
        main,
        capsys,
        first,
        untrained_checkpoint,
        "--src",
        source_file,
        "--ref",
        source_file,
        "--beam",
        1,
        "--max-len-b",
        4,
    )
    assert rc == 0, err
    scores = json.loads((tmp_path / "a.in.de.ensemble2.beam1.json").read_text())
    assert scores["ensemble"] == [str(first), str(untrained_checkpoint)]
    assert (tmp_path / "a.in.de.ensemble2.beam1.hyp").read_text().count("\n") == 3


def test_evaluate_searches_the_length_penalty_over_several_alphas(untrained_checkpoint, source_file, tmp_path, capsys):
    import json
    import shutil

    from transformer.cli.evaluate import main

    checkpoint = tmp_path / "m.pt"
    shutil.copy(untrained_checkpoint, checkpoint)
    rc, out, err = run_main(
        main,
        capsys,
        checkpoint,
        "--src",
        source_file,
        "--ref",
        source_file,
        "--beam",
        2,
        "--alpha",
        "0.5,3",
        "--max-len-b",
        4,
    )
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("alpha 0.5: BLEU ") and lines[1].startswith("alpha 3: BLEU ")
    recorded = [json.loads((tmp_path / f"m.in.de.alpha{a}.beam2.json").read_text()) for a in ("0.5", "3")]
    assert [r["alpha"] for r in recorded] == [0.5, 3.0]  # each scored with its own, in its own files
    best = max(recorded, key=lambda r: (r["bleu"], r["chrf"]))
    assert lines[2] == f"best on in.de (beam 2): --alpha {best['alpha']:g} (BLEU {best['bleu']:.2f})"
    assert lines[3] == f"as the model's default: decode.alpha={best['alpha']:g} at training"
    rc, out, err = run_main(main, capsys, checkpoint, "--alpha", "1,1.5", "--beam", 1)
    assert rc == 2 and one_line(err) == (
        "transformer-evaluate: error: --alpha 1,1.5: a length penalty search needs a beam "
        "of 2 or more (--beam 5): greedy search has no length penalty"
    )


def test_sampling_refuses_search_options_and_alpha_without_a_beam_is_warned(untrained_checkpoint):
    """Through the API, sampling silently dropped beam_size and alpha, and nbest gave one hypothesis per
    sentence but nbest placeholders per empty one."""
    from transformer.inference.sampling import Sampling

    translator = Translator.from_checkpoint(untrained_checkpoint, device="cpu", precision="fp32")
    for options, named in (
        ({"beam_size": 4}, "beam_size=4"),
        ({"nbest": 3}, "nbest=3"),
        ({"beam_size": 2, "nbest": 2}, "beam_size=2 and nbest=2"),
    ):
        with pytest.raises(ValueError, match=f"^sampling draws one translation per sentence: leave out {named}$"):
            translator.hypotheses(SENTENCES + [""], sampling=Sampling(top_k=5), max_len_b=4, **options)
    hyps = translator.hypotheses(SENTENCES + [""], sampling=Sampling(top_k=5), beam_size=1, nbest=1, max_len_b=4)
    assert [len(h) for h in hyps] == [1, 1, 1, 1]
    for options in ({"sampling": Sampling(top_k=5)}, {"beam_size": 1}):
        with pytest.warns(UserWarning, match="alpha=2.0 is ignored by greedy search and sampling"):
            translator.translate(SENTENCES, alpha=2.0, max_len_b=4, **options)
    s = Sampling(top_k=50, seed=3)  # a new Sampling of the same seed repeats the call
    first = translator.translate(SENTENCES, sampling=s, max_len_b=6)
    assert translator.translate(SENTENCES, sampling=Sampling(top_k=50, seed=3), max_len_b=6) == first


def test_the_api_refuses_what_the_command_lines_refuse_in_its_own_words(untrained_checkpoint):
    """The command lines checked devices and beams before the Python API did: there, torch's errors
    ("Expected one of cpu, cuda, ipu, xpu, ...", "Torch not compiled with CUDA enabled") or a search of
    10**9 hypotheses per sentence that ran for good."""
    for device, problem in (
        ("gpu", "must be auto, cpu, cuda or cuda:N"),
        ("CPU", "must be auto, cpu, cuda or cuda:N"),
        (None, "must be auto, cpu, cuda or cuda:N"),
        (0, "must be auto, cpu, cuda or cuda:N"),
        ("meta", "must be auto, cpu, cuda or cuda:N"),
    ) + ((("cuda", "CUDA is not available"),) if not torch.cuda.is_available() else ()):
        with pytest.raises(ValueError, match=f"^device={device!r}: {problem}$"):
            Translator.from_checkpoint(untrained_checkpoint, device=device)
    translator = Translator.from_checkpoint(untrained_checkpoint, device="cpu")
    vocabulary = translator.tokenizer.tgt_vocab_size
    with pytest.raises(ValueError, match=f"^beam_size=999: the model's target vocabulary has {vocabulary} pieces"):
        translator.translate(SENTENCES, beam_size=999)
    assert len(translator.translate(SENTENCES, beam_size=vocabulary, max_len_b=2)) == 3
    one = Translator.from_checkpoints(str(untrained_checkpoint), device="cpu")  # a path, not its characters
    assert len(one.models) == 1 and one.translate(SENTENCES, max_len_b=4) == translator.translate(
        SENTENCES, max_len_b=4
    )
    with pytest.raises(ValueError, match=r"^weights='1,2': give a list of numbers, one per model"):
        Translator.from_checkpoints([untrained_checkpoint] * 2, weights="1,2", device="cpu")
    for workers in ("2", 2.5, 0, True):
        with pytest.raises(ValueError, match=f"^workers={workers!r}: must be a whole number >= 1"):
            translator.translate(SENTENCES, workers=workers)
    with pytest.raises(TypeError, match="^stop=True: must be a function"):
        translator.translate(SENTENCES, stop=True)
    direct = Translator(translator.model, translator.tokenizer, translator.config, "cpu")  # a device name
    assert direct.translate(SENTENCES, max_len_b=4) == translator.translate(SENTENCES, max_len_b=4)
    with pytest.raises(ValueError, match="precision='fp64' must be one of"):
        Translator(translator.model, translator.tokenizer, translator.config, "cpu", precision="fp64")


def test_exported_directories_that_cannot_load_say_why_in_one_line(untrained_checkpoint, tmp_path):
    """Damaged config.json values came out as AttributeErrors, an unknown tokenizer list with a git-lfs
    hint (and a string spelt letter by letter), a checkpoint file as a missing hub id; saving an int8
    model failed inside safetensors."""
    import json

    from transformer.inference.pretrained import load_pretrained, save_pretrained

    translator = Translator.from_checkpoint(untrained_checkpoint, device="cpu")
    out = save_pretrained(translator.model, translator.tokenizer, translator.config, tmp_path / "m")
    meta = json.loads((out / "config.json").read_text())
    for change, message in (
        ({"config": "x"}, 'its "config" is not a mapping of settings'),
        ({"config": None}, 'its "config" is not a mapping of settings'),
        ({"tokenizer": "spm.model"}, r"unknown tokenizer files 'spm.model' \(an export lists"),
        ({"tokenizer": ["foo.model"]}, r"unknown tokenizer files \['foo.model'\]"),
        ({"format_version": True}, "format_version True is not a whole number >= 0"),
        ({"format_version": -5}, "format_version -5 is not a whole number >= 0"),
    ):
        (out / "config.json").write_text(json.dumps({**meta, **change}))
        with pytest.raises(CheckpointError, match=message) as error:
            load_pretrained(out)
        assert "\n" not in str(error.value) and "lfs" not in str(error.value)
    (out / "config.json").unlink()
    (out / "config.json").mkdir()
    with pytest.raises(CheckpointError, match="config.json: Is a directory"):
        load_pretrained(out)
    with pytest.raises(
        CheckpointError, match="best.pt: a file, not an exported directory; .* Translator.from_checkpoint"
    ):
        Translator.from_pretrained(untrained_checkpoint)
    int8 = Translator.from_checkpoint(untrained_checkpoint, device="cpu", quantize="int8")
    with pytest.raises(ValueError, match="save_pretrained takes the float model, not an int8 one"):
        save_pretrained(int8.model, int8.tokenizer, int8.config, tmp_path / "q")
    assert not (tmp_path / "q").exists()


def test_workers_beyond_the_batches_fork_no_more_processes_than_batches(untrained_checkpoint, monkeypatch):
    """workers=100 forked 100 decoding processes for a handful of batches."""
    from transformer.inference import search

    translator = Translator.from_checkpoint(untrained_checkpoint, device="cpu", precision="fp32")
    expected = translator.translate(SENTENCES, beam_size=1, max_len_b=4, workers=1)
    forked = []
    real = search.in_processes

    def counting(batches, attempt, done, workers, stop=None):
        forked.append((len(batches), workers))
        return real(batches, attempt, done, workers, stop)

    monkeypatch.setattr(search, "in_processes", counting)
    assert translator.translate(SENTENCES, beam_size=1, max_len_b=4, workers=100, batch_tokens=8) == expected
    assert forked and all(workers <= batches for batches, workers in forked), forked
