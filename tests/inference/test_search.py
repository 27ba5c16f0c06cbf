"""Search tests: a hand-built step distribution whose beams can be worked out on paper, and the real
model (beam 1 == greedy, batch == one at a time, cache == recomputation)."""

import math
import os
import weakref
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT
from transformer.checkpoint import load_checkpoint, model_from_checkpoint
from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer.errors import DecodingProcessDied
from transformer.inference.candidates import row_topk, top_candidates
from transformer.inference.decoders import ModelDecoder
from transformer.inference.sampling import Sampling
from transformer.inference.search import Search, beam_search, greedy_search, length_penalty, translate_ids

A, B = 4, 5
VOCAB = 6  # PAD UNK BOS EOS A B
# Next-token probabilities after each prefix (tokens after BOS); unlisted prefixes end with certainty.
TABLE = {
    (): {A: 0.5, B: 0.4, EOS_ID: 0.1},
    (A,): {A: 0.36, B: 0.34, EOS_ID: 0.30},
    (B,): {EOS_ID: 0.9, A: 0.05, B: 0.05},
}


class TableDecoder:
    """A StepDecoder whose next-token distribution depends only on the prefix."""

    def __init__(self):
        self.steps = 0

    def step(self, tokens):
        self.steps += 1
        out = torch.full((tokens.size(0), VOCAB), float("-inf"))
        for row, prefix in enumerate(tokens[:, 1:].tolist()):
            for token, p in TABLE.get(tuple(prefix), {EOS_ID: 1.0}).items():
                out[row, token] = math.log(p)
        return out

    def select(self, rows, sentences=None):
        pass


def test_greedy_takes_the_locally_best_token():
    (hyp,) = greedy_search(TableDecoder(), torch.tensor([10]))
    assert hyp.tokens == [A, A]
    assert hyp.logprob == pytest.approx(math.log(0.5 * 0.36))


def test_beam_finds_the_better_sequence_greedy_misses():
    (hyps,) = beam_search(TableDecoder(), torch.tensor([10]), beam_size=2, alpha=0.0, nbest=1)
    assert [h.tokens for h in hyps] == [[B]]
    assert hyps[0].score == pytest.approx(math.log(0.4 * 0.9))


def test_beam_nbest_and_length_penalty_by_hand():
    (hyps,) = beam_search(TableDecoder(), torch.tensor([10]), beam_size=2, alpha=1.0, nbest=2)
    assert [h.tokens for h in hyps] == [[B], [A, A]]
    # "B EOS" has 2 tokens, "A A EOS" has 3: GNMT penalty ((5 + len) / 6) ** alpha.
    assert hyps[0].score == pytest.approx(math.log(0.36) / (7 / 6))
    assert hyps[1].score == pytest.approx(math.log(0.5 * 0.36) / (8 / 6))
    assert hyps[1].logprob == pytest.approx(math.log(0.18))


@pytest.mark.parametrize("alpha", [0.6, 1.0, 2.0])
def test_length_penalty_is_the_gnmt_formula(alpha):
    """((5 + length) / 6) ** alpha, worked out by hand: 1 at length 1, growing with the length."""
    assert length_penalty(1, alpha) == pytest.approx(1.0)
    assert length_penalty(7, alpha) == pytest.approx(2.0**alpha)  # (5 + 7) / 6 = 2
    assert length_penalty(3, alpha) == pytest.approx((8 / 6) ** alpha)
    assert length_penalty(13, alpha) == pytest.approx(3.0**alpha)
    assert length_penalty(1, alpha) < length_penalty(2, alpha) < length_penalty(3, alpha) < length_penalty(30, alpha)
    assert length_penalty(3, 2 * alpha) == pytest.approx(length_penalty(3, alpha) ** 2)


def test_a_strong_length_penalty_prefers_the_longer_hypothesis():
    """On log-probability "B EOS" (p 0.36, 2 tokens) beats "A A EOS" (p 0.18, 3 tokens); dividing by
    ((5 + len) / 6) ** alpha favours the longer one once (8/7) ** alpha > log 0.18 / log 0.36 (alpha > 3.88).
    Hypotheses of one length keep their order ("A A" 0.18 before "A B" 0.17) whatever alpha."""
    (short_first,) = beam_search(TableDecoder(), torch.tensor([10]), beam_size=2, alpha=3.0, nbest=2)
    assert [h.tokens for h in short_first] == [[B], [A, A]]
    (long_first,) = beam_search(TableDecoder(), torch.tensor([10]), beam_size=2, alpha=4.0, nbest=2)
    assert [h.tokens for h in long_first] == [[A, A], [B]]
    assert long_first[0].score == pytest.approx(math.log(0.18) / (8 / 6) ** 4)
    assert long_first[1].score == pytest.approx(math.log(0.36) / (7 / 6) ** 4)
    (longer,) = beam_search(TableDecoder(), torch.tensor([10]), beam_size=2, alpha=5.0, nbest=2)
    assert [h.tokens for h in longer] == [[A, A], [A, B]]
    assert longer[1].score == pytest.approx(math.log(0.5 * 0.34) / (8 / 6) ** 5)
    assert [h.logprob for h in longer] == pytest.approx([math.log(0.18), math.log(0.17)])


def test_max_length_forces_eos():
    (hyps,) = beam_search(TableDecoder(), torch.tensor([2]), beam_size=2, alpha=0.0, nbest=2)
    # At step 2 only EOS is allowed: "A EOS" (0.5 * 0.3) and "B EOS" (0.4 * 0.9).
    assert [h.tokens for h in hyps] == [[B], [A]]
    assert hyps[1].logprob == pytest.approx(math.log(0.15))
    (greedy,) = greedy_search(TableDecoder(), torch.tensor([2]))
    assert greedy.tokens == [A] and greedy.hit_max_len


def test_a_length_limit_beyond_int64_is_the_models_limit_not_one_token():
    """max_len_a=1e30 ("no limit") went past int64 and wrapped to the minimum: every output was empty."""
    from transformer.inference.search import max_lengths

    src = torch.tensor([[5, 6, 7, EOS_ID], [5, EOS_ID, PAD_ID, PAD_ID]])  # 3 and 1 tokens
    assert max_lengths(src, 1.2, 10, 1000).tolist() == [13, 11]
    assert max_lengths(src, 0.0, 0, 1000).tolist() == [1, 1]
    for a, b in ((1e30, 0), (0.0, 2**63 - 1), (0.0, 10**30), (1e300, 10**30)):
        assert max_lengths(src, a, b, 127).tolist() == [127, 127], (a, b)


def test_a_source_ending_in_a_sentence_marker_counts_twice_for_the_length_limit():
    """A lower-case source's `EIN HUND.` is `ein hund.` + a marker; its target writes a marker after every
    word (`A DOG.`: a, marker, dog, marker, .): the limit of the source's own length cut such translations
    (issue 73: 28 of 1,000 upper-cased test sentences ended early, their last word in lower case)."""
    from transformer.inference.search import max_lengths

    marker = 9
    src = torch.tensor(
        [
            [5, 6, 7, marker, EOS_ID],
            [5, 6, 7, 8, EOS_ID],
            [5, marker, 7, EOS_ID, PAD_ID],
            [marker, EOS_ID, PAD_ID, PAD_ID, PAD_ID],
        ]
    )
    assert max_lengths(src, 1.0, 2, 1000).tolist() == [6, 6, 5, 3]  # without: the length as it is
    assert max_lengths(src, 1.0, 2, 1000, doubled_by=(marker, 10)).tolist() == [10, 6, 5, 4]
    assert max_lengths(src, 1.0, 2, 9, doubled_by=(marker,)).tolist() == [9, 6, 5, 4]  # still capped


def test_sentences_in_one_batch_do_not_interact():
    hyps = beam_search(TableDecoder(), torch.tensor([10, 2, 10]), beam_size=2, alpha=0.0, nbest=1)
    assert [h[0].tokens for h in hyps] == [[B], [B], [B]]


def test_beam_stops_once_no_open_hypothesis_can_win():
    decoder = TableDecoder()
    beam_search(decoder, torch.tensor([50]), beam_size=2, alpha=0.0, nbest=1)
    assert decoder.steps == 2  # "B" finished at step 2 and both open beams already score lower


def test_nbest_larger_than_beam_is_refused():
    with pytest.raises(ValueError, match="nbest"):
        beam_search(TableDecoder(), torch.tensor([5]), beam_size=2, nbest=3)


class CountdownDecoder:
    """Sentence i says A `lengths[i]` times, then EOS; it follows `select` like a real decoder's cache,
    so a wrong row kept at a compaction changes what that row says next."""

    def __init__(self, lengths):
        self.sentence = torch.arange(len(lengths))  # the sentence of each row
        self.lengths = torch.tensor(lengths)
        self.compactions = 0

    def step(self, tokens):
        out = torch.full((tokens.size(0), VOCAB), float("-inf"))
        said = tokens.size(1) - 1
        ends = self.lengths[self.sentence] <= said
        out[:, EOS_ID] = torch.where(ends, 0.0, -5.0)
        out[:, A] = torch.where(ends, -5.0, -0.1 * (self.sentence + 1).float())
        return out

    def select(self, rows, sentences=None):
        self.sentence = self.sentence[rows]
        self.compactions += 1


def test_greedy_drops_finished_sentences_in_batches_with_the_same_results(monkeypatch):
    import transformer.inference.search as search

    lengths = [3, 0, 7, 1, 1, 5, 2, 9, 4, 6, 2, 8]
    results = {}
    for share in (0.0, 0.25, 1.0):  # at every finish, a quarter of the rows, never until the end
        monkeypatch.setattr(search, "GREEDY_COMPACT_SHARE", share)
        decoder = CountdownDecoder(lengths)
        hyps = greedy_search(decoder, torch.full((len(lengths),), 20))
        results[share] = ([h.tokens for h in hyps], [h.logprob for h in hyps], decoder.compactions)
    assert results[0.0][0] == [[A] * n for n in lengths]
    assert results[0.0][1] == pytest.approx([-0.1 * (i + 1) * n for i, n in enumerate(lengths)], abs=1e-5)
    for share in (0.25, 1.0):
        assert results[share][:2] == results[0.0][:2]
    # Sentences finish at 10 distinct steps, the last with no row left: 9 compactions at every finish;
    # by quarters, when more than a quarter of the rows left are finished: 5 (at steps 2, 4, 6, 7, 8).
    assert (results[0.0][2], results[0.25][2], results[1.0][2]) == (9, 5, 0)


@pytest.mark.parametrize("width,k", [(8000, 10), (8000, 1), (5000, 6), (300, 4)])
def test_row_topk_equals_torch_topk(width, k):
    """The block-maxima shortcut against plain topk, with ties, blocked columns and a ragged last block."""
    torch.manual_seed(width + k)
    scores = torch.randn(50, width)
    scores[:, 1::7] = float("-inf")
    scores[3] = scores[3].round()  # many ties
    scores[4, :] = float("-inf")
    scores[4, width - 1] = 0.0  # the best entry in the last column
    values, ids = row_topk(scores, k)
    expected = scores.topk(k, dim=1).values
    assert torch.equal(values, expected)
    assert torch.equal(scores.gather(1, ids), values)  # the ids point at those values
    assert ids[4, 0] == width - 1


# --- the real model -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_and_sources(untrained_checkpoint):
    model, tokenizer, _ = model_from_checkpoint(load_checkpoint(untrained_checkpoint))
    model.eval()
    sentences = [
        "Der Hund sieht die Katze.",
        "Heute hat der alte Mann den roten Fisch im Park gefunden.",
        "Ich glaube, dass die Frau das Pferd mag.",
        "Die Kuh.",
        "Oft ruft das Kind den Vogel.",
    ]
    return model, tokenizer.encode_src(sentences)


def test_beam_one_equals_greedy(model_and_sources):
    model, sources = model_and_sources
    greedy = translate_ids(model, sources, Search(beam_size=1))
    src = torch.nn.utils.rnn.pad_sequence([torch.tensor(s + [EOS_ID]) for s in sources], batch_first=True)
    from transformer.inference.search import max_lengths

    lens = max_lengths(src, 1.2, 10, 1000)
    beam1 = beam_search(ModelDecoder(model, src), lens, beam_size=1)
    plain = greedy_search(ModelDecoder(model, src), lens)
    assert [h[0].tokens for h in beam1] == [h.tokens for h in plain] == [h[0].tokens for h in greedy]
    for b, g in zip(beam1, plain):
        assert b[0].logprob == pytest.approx(g.logprob, abs=1e-4)


def test_blockwise_candidates_equal_those_from_the_full_distribution(model_and_sources):
    """From logits, top_candidates works on blocks of 128 rows; 300 rows make three blocks."""
    model, sources = model_and_sources
    src = torch.nn.utils.rnn.pad_sequence([torch.tensor(s + [EOS_ID]) for s in sources], batch_first=True)
    tokens = torch.randint(4, 50, (300, 3))
    tokens[:, 0] = BOS_ID
    decoder = ModelDecoder(model, src.repeat(60, 1), use_cache=False)

    class StepOnly:  # the route for decoders without logits: one full distribution
        step = staticmethod(decoder.step)

    with torch.no_grad():
        values, ids, eos = top_candidates(decoder, tokens, 6)
        generic = top_candidates(StepOnly(), tokens, 6)
        plain = decoder.step(tokens)
    plain[:, [PAD_ID, BOS_ID]] = float("-inf")
    assert torch.allclose(values, plain.topk(6, dim=1).values, atol=1e-5)
    assert torch.allclose(plain.gather(1, ids), values, atol=1e-5)
    assert torch.allclose(eos, plain[:, EOS_ID], atol=1e-5)
    assert torch.equal(generic[1], ids)


def test_greedy_batches_of_finished_sentences_do_not_change_the_model_output(model_and_sources, monkeypatch):
    import transformer.inference.search as search

    model, sources = model_and_sources
    lazily = translate_ids(model, sources, Search(beam_size=1))
    monkeypatch.setattr(search, "GREEDY_COMPACT_SHARE", 0.0)
    assert [h[0].tokens for h in translate_ids(model, sources, Search(beam_size=1))] == [h[0].tokens for h in lazily]


@pytest.mark.parametrize("beam_size", [1, 4])
def test_mixed_length_batch_equals_one_at_a_time(model_and_sources, beam_size):
    model, sources = model_and_sources
    batched = translate_ids(model, sources, Search(beam_size=beam_size, alpha=0.6))
    single = [translate_ids(model, [s], Search(beam_size=beam_size, alpha=0.6))[0] for s in sources]
    assert [h[0].tokens for h in batched] == [h[0].tokens for h in single]


@pytest.mark.parametrize("beam_size", [1, 4])
def test_cache_gives_the_same_output_as_recomputing_the_prefix(model_and_sources, beam_size):
    model, sources = model_and_sources
    cached = translate_ids(model, sources, Search(beam_size=beam_size, nbest=1))
    uncached = translate_ids(model, sources, Search(beam_size=beam_size, nbest=1, use_cache=False))
    assert [h[0].tokens for h in cached] == [h[0].tokens for h in uncached]
    for c, u in zip(cached, uncached):
        assert c[0].score == pytest.approx(u[0].score, abs=1e-4)


def test_out_of_memory_in_decoding_splits_the_batch_and_retries(model_and_sources, monkeypatch):
    import transformer.inference.search as search

    model, sources = model_and_sources
    expected = translate_ids(model, sources, Search(beam_size=3))
    real = search.beam_search
    sizes, failed_attempts = [], []

    def small_memory(decoder, max_lens, *args, **kwargs):
        # Every retry starts only after the failed attempts' encoder output and caches are gone.
        assert all(ref() is None for ref in failed_attempts), "a failed attempt's tensors are still alive"
        sizes.append(max_lens.numel())
        if max_lens.numel() > 2:
            failed_attempts.extend([weakref.ref(decoder.memory), weakref.ref(decoder.cache.memory_kv[0][0])])
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(decoder, max_lens, *args, **kwargs)

    monkeypatch.setattr(search, "beam_search", small_memory)
    assert [h[0].tokens for h in translate_ids(model, sources, Search(beam_size=3))] == [h[0].tokens for h in expected]
    assert sizes == [5, 2, 3, 1, 2]  # 5 fails, halves: 2 | 3 fails, halves: 1, 2
    assert len(failed_attempts) == 4


# ---------------------------------------------------------------------------------------------------
# Sampling (back-translation)


class RandomDecoder:
    """A StepDecoder with a fixed, different random distribution over 200 tokens at every position."""

    def __init__(self, seed=0):
        generator = torch.Generator().manual_seed(seed)
        logits = torch.randn(40, 200, generator=generator) * 3  # (position, V)
        logits[:, [PAD_ID, BOS_ID]] = float("-inf")  # never generated (the search masks them too)
        logits[:, EOS_ID] = -30.0  # long samples: every step is checked
        self.logprobs = torch.log_softmax(logits, dim=1)

    def step(self, tokens):
        return self.logprobs[tokens.size(1) - 1].expand(tokens.size(0), -1).clone()

    def select(self, rows, sentences=None):
        pass


def _samples(sampling, rows=64, length=30):
    return greedy_search(RandomDecoder(), torch.full((rows,), length), sampling)


def test_sampling_with_a_seed_is_reproducible_and_differs_between_seeds():
    first, again = _samples(Sampling(top_k=20, seed=3)), _samples(Sampling(top_k=20, seed=3))
    assert [h.tokens for h in first] == [h.tokens for h in again]
    assert [h.tokens for h in first] != [h.tokens for h in _samples(Sampling(top_k=20, seed=4))]
    assert len({tuple(h.tokens) for h in first}) > 60  # 64 rows, (nearly) all different


def test_top_k_never_draws_outside_the_k_most_probable():
    decoder = RandomDecoder()
    hyps = _samples(Sampling(top_k=5, seed=1))
    for position in range(29):
        allowed = set(decoder.logprobs[position].topk(5).indices.tolist())
        drawn = {h.tokens[position] for h in hyps}
        assert drawn <= allowed, position
        assert len(drawn) > 1  # a sample, not the argmax
    # the score is the model's own log-probability of the drawn tokens
    expected = sum(decoder.logprobs[t, token].item() for t, token in enumerate(hyps[0].tokens))
    assert hyps[0].logprob == pytest.approx(expected + decoder.logprobs[29, EOS_ID].item(), rel=1e-5)


def test_top_p_draws_only_from_the_nucleus():
    decoder = RandomDecoder()
    hyps = _samples(Sampling(top_p=0.5, seed=1))
    for position in range(29):
        probs, order = decoder.logprobs[position].exp().sort(descending=True)
        size = int((probs.cumsum(0) - probs < 0.5).sum())  # tokens needed to reach 0.5
        assert {h.tokens[position] for h in hyps} <= set(order[:size].tolist()), position


def test_sampling_at_a_low_temperature_is_greedy():
    (greedy,) = greedy_search(TableDecoder(), torch.tensor([10]))
    cold = greedy_search(TableDecoder(), torch.full((20,), 10), Sampling(temperature=1e-3, seed=5))
    assert all(h.tokens == greedy.tokens for h in cold)
    with pytest.raises(ValueError, match="temperature > 0"):
        Sampling(temperature=0.0)


def test_decoders_meet_the_search_protocols():
    from transformer.config import ModelConfig
    from transformer.inference.decoders import LogitsDecoder, ModelDecoder, StepDecoder
    from transformer.model import build_model

    model = build_model(ModelConfig(d_model=16, n_heads=2, d_ff=32, encoder_layers=1, decoder_layers=1), 20, 20, True)
    decoder = ModelDecoder(model.eval(), torch.tensor([[5, 6, 3]]))
    assert isinstance(decoder, LogitsDecoder) and isinstance(decoder, StepDecoder)
    table = TableDecoder.__new__(TableDecoder)
    assert isinstance(table, StepDecoder) and not isinstance(table, LogitsDecoder)


# --- ensembles and target prefixes ------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_models(untrained_checkpoint, model_and_sources):
    """The untrained model and a second one over the same vocabulary with other weights."""
    from transformer.model import build_model

    model, sources = model_and_sources
    _, tokenizer, config = model_from_checkpoint(load_checkpoint(untrained_checkpoint))
    torch.manual_seed(1)
    other = build_model(config.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint).eval()
    return model, other, sources


def _padded(sources):
    return torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(s + [EOS_ID]) for s in sources], batch_first=True, padding_value=PAD_ID
    )


def _averaged_logprobs(models, weights, src, tokens):
    """The slow reference: each model run on the whole prefix (no cache), log-softmax, weighted mean."""
    total = sum(weights)
    with torch.no_grad():
        parts = [w / total * torch.log_softmax(m(src, tokens)[:, -1].float(), dim=-1) for m, w in zip(models, weights)]
    return torch.stack(parts).sum(dim=0)  # (rows, V)


def _reference_greedy(models, weights, src, max_len, prefix=()):
    """One sentence (src (1, S)): force `prefix`, then take the most probable averaged token until EOS."""
    tokens = [BOS_ID, *prefix]
    logprob = 0.0
    with torch.no_grad():
        for i, token in enumerate(prefix):
            logprob += _averaged_logprobs(models, weights, src, torch.tensor([tokens[: i + 1]]))[0, token].item()
        while len(tokens) - 1 < max_len:
            lp = _averaged_logprobs(models, weights, src, torch.tensor([tokens]))[0]
            lp[[PAD_ID, BOS_ID]] = float("-inf")
            token = EOS_ID if len(tokens) == max_len else int(lp.argmax())
            logprob += lp[token].item()
            if token == EOS_ID:
                break
            tokens.append(token)
    return tokens[1:], logprob


@pytest.mark.parametrize("beam_size", [1, 4])
def test_an_ensemble_of_one_model_equals_that_model(model_and_sources, beam_size):
    from transformer.inference.decoders import EnsembleDecoder
    from transformer.inference.search import max_lengths

    model, sources = model_and_sources
    src = _padded(sources)
    lens = max_lengths(src, 1.2, 10, 1000)
    alone = beam_search(ModelDecoder(model, src), lens, beam_size, alpha=0.6, nbest=beam_size)
    ensemble = beam_search(
        EnsembleDecoder([ModelDecoder(model, src)], [3.0]), lens, beam_size, alpha=0.6, nbest=beam_size
    )
    assert [[h.tokens for h in hyps] for hyps in alone] == [[h.tokens for h in hyps] for hyps in ensemble]
    for a, e in zip(alone, ensemble):
        assert [h.score for h in a] == pytest.approx([h.score for h in e], abs=1e-5)
    assert translate_ids([model], sources, Search(beam_size=beam_size))[0][0].tokens == alone[0][0].tokens


def test_an_ensemble_steps_with_the_weighted_mean_of_the_models_logprobs(two_models):
    """Forced decoding of a fixed target through the ensemble's cached steps, against the hand
    computation from each model's uncached distribution."""
    from transformer.inference.decoders import EnsembleDecoder

    first, second, sources = two_models
    src = _padded(sources[:2])
    target = torch.tensor([[BOS_ID, 7, 9, 11, 13], [BOS_ID, 20, 8, 6, 30]])  # (2, 5)
    with torch.no_grad():
        ensemble = EnsembleDecoder([ModelDecoder(first, src), ModelDecoder(second, src)], [1.0, 3.0])
        for t in range(1, target.size(1) + 1):
            got = ensemble.step(target[:, :t])  # (2, V)
            expected = _averaged_logprobs([first, second], [1.0, 3.0], src, target[:, :t])
            assert torch.allclose(got, expected, atol=1e-5), t
            # each model alone differs from the mean: the check is not vacuous
            assert not torch.allclose(got, _averaged_logprobs([first], [1.0], src, target[:, :t]), atol=1e-3)
            ensemble.select(torch.arange(2))


def test_ensemble_greedy_equals_the_hand_computed_average(two_models):
    first, second, sources = two_models
    found = translate_ids([first, second], sources, Search(beam_size=1, max_len_a=0.0, max_len_b=8), weights=[2.0, 1.0])
    for source, hyps in zip(sources, found):
        tokens, logprob = _reference_greedy([first, second], [2.0, 1.0], _padded([source]), max_len=8)
        assert hyps[0].tokens == tokens
        assert hyps[0].logprob == pytest.approx(logprob, abs=1e-4)
    alone = translate_ids(first, sources, Search(beam_size=1, max_len_a=0.0, max_len_b=8))
    assert [h[0].tokens for h in found] != [h[0].tokens for h in alone]


@pytest.mark.parametrize("beam_size", [1, 4])
def test_a_prefix_is_kept_and_decoding_continues_as_the_model_would(model_and_sources, beam_size):
    """The hypothesis starts with the prefix; after it, greedy equals the uncached greedy continuation;
    a beam's best hypothesis also starts with it; sentences without a prefix decode as without any."""
    model, sources = model_and_sources
    prefixes = [[7, 9, 11], [], [30], [12, 12, 40, 5, 8], []]
    found = translate_ids(model, sources, Search(beam_size=beam_size, prefixes=prefixes, max_len_a=0.0, max_len_b=9))
    plain = translate_ids(model, sources, Search(beam_size=beam_size, max_len_a=0.0, max_len_b=9))
    for source, prefix, hyps, without in zip(sources, prefixes, found, plain):
        assert hyps[0].tokens[: len(prefix)] == prefix
        if not prefix:
            assert hyps[0].tokens == without[0].tokens
        if beam_size == 1:
            tokens, logprob = _reference_greedy([model], [1.0], _padded([source]), max_len=9, prefix=prefix)
            assert hyps[0].tokens == tokens
            assert hyps[0].logprob == pytest.approx(logprob, abs=1e-4)
    assert any(h[0].tokens[: len(p)] != p for h, p in zip(plain, prefixes) if p)  # the prefix changed something


def test_a_prefix_longer_than_the_length_limit_still_ends_with_eos(model_and_sources):
    model, sources = model_and_sources
    prefix = [7, 9, 11, 13, 15, 17]
    for beam_size in (1, 3):
        hyps = translate_ids(
            model, sources[:1], Search(beam_size=beam_size, prefixes=[prefix], max_len_a=0.0, max_len_b=2)
        )
        assert hyps[0][0].tokens[: len(prefix)] == prefix and len(hyps[0][0].tokens) <= len(prefix)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_parallel_workers_give_the_results_of_one(model_and_sources, beam_size):
    model, sources = model_and_sources
    many = sources * 6  # several batches at a small batch size
    one = translate_ids(model, many, Search(beam_size=beam_size, batch_tokens=60))
    threads = torch.get_num_threads()
    two = translate_ids(model, many, Search(beam_size=beam_size, batch_tokens=60, workers=2))
    assert [h[0].tokens for h in two] == [h[0].tokens for h in one]
    assert [h[0].score for h in two] == pytest.approx([h[0].score for h in one], abs=1e-5)
    assert torch.get_num_threads() == threads  # PyTorch's own thread count is given back


def test_parallel_workers_stop_when_asked_and_pass_errors_on(model_and_sources, monkeypatch):
    import transformer.inference.search as search

    model, sources = model_and_sources
    asked = []

    def stop():
        asked.append(1)
        return len(asked) > 2

    with pytest.raises(search.Interrupted):
        translate_ids(model, sources * 6, Search(beam_size=1, batch_tokens=30, workers=2), stop=stop)
    assert len(asked) == 3  # no batch is started after the stop

    def broken(*args, **kwargs):
        raise RuntimeError("decoding failed")

    monkeypatch.setattr(search, "greedy_search", broken)
    with pytest.raises(RuntimeError, match="decoding failed"):
        translate_ids(model, sources * 6, Search(beam_size=1, batch_tokens=30, workers=2))


def test_parallel_workers_stop_while_waiting_for_batches_already_handed_out(model_and_sources, monkeypatch):
    """Ctrl-C or SIGTERM during a validation whose batches are all with the workers: asked while waiting,
    not only before handing out the next batch (a hung worker used to hold the run for good)."""
    import threading
    import time

    import transformer.inference.search as search

    model, sources = model_and_sources
    slow_greedy = search.greedy_search

    def slow(*args, **kwargs):
        time.sleep(5)
        return slow_greedy(*args, **kwargs)

    monkeypatch.setattr(search, "greedy_search", slow)
    asked_to_stop = threading.Event()
    threading.Timer(0.5, asked_to_stop.set).start()
    started = time.monotonic()
    with pytest.raises(search.Interrupted):
        translate_ids(model, sources * 6, Search(beam_size=1, batch_tokens=30, workers=2), stop=asked_to_stop.is_set)
    assert time.monotonic() - started < 3


def test_decoding_processes_run_compiled_layers_eager(model_and_sources):
    """trainer.compile=true compiles the layers in place; a forked decoding process must not compile (the
    compiler's worker pool does not survive fork: a compiled CPU run's validation hung there)."""
    import copy

    model, sources = model_and_sources
    compiled = copy.deepcopy(model)

    def refusing_backend(graph, example_inputs):
        raise RuntimeError("a decoding process compiled a graph")

    for layer in (*compiled.encoder_layers, *compiled.decoder_layers):
        layer.compile(backend=refusing_backend, dynamic=True)
    eager = translate_ids(model, sources * 2, Search(beam_size=1, batch_tokens=30))
    two = translate_ids(compiled, sources * 2, Search(beam_size=1, batch_tokens=30, workers=2))
    assert [h[0].tokens for h in two] == [h[0].tokens for h in eager]


def test_decoding_processes_end_with_a_parent_killed_outright(untrained_checkpoint, tmp_path):
    """A parent killed by SIGKILL (or dying mid-cleanup) left its decoding processes waiting on their task
    queue for good, each holding the model's memory."""
    import signal
    import subprocess
    import sys
    import time

    script = f"""
import multiprocessing, threading, time
import transformer.inference.search as search
from transformer.checkpoint import load_checkpoint, model_from_checkpoint
model, tokenizer, _ = model_from_checkpoint(load_checkpoint({str(untrained_checkpoint)!r}))
slow = search.greedy_search
def slower(*args, **kwargs):
    time.sleep(60)
    return slow(*args, **kwargs)
search.greedy_search = slower
def report():
    time.sleep(2)
    open({str(tmp_path / "children")!r}, "w").write(" ".join(str(p.pid) for p in multiprocessing.active_children()))
threading.Thread(target=report, daemon=True).start()
search.translate_ids(model, tokenizer.encode_src(["Der Hund sieht die Katze."] * 30),
                     search.Search(beam_size=1, batch_tokens=30, workers=2))
"""
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        for _ in range(600):
            if (tmp_path / "children").exists() and (tmp_path / "children").read_text():
                break
            time.sleep(0.1)
        children = [int(pid) for pid in (tmp_path / "children").read_text().split()]
        assert len(children) == 2
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] not in ("Z", "X")
        except (FileNotFoundError, IndexError):
            return False

    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in children if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []


def test_a_decoding_process_that_dies_is_reported_not_waited_for(model_and_sources, monkeypatch):
    import os

    import transformer.inference.search as search

    model, sources = model_and_sources

    def killed(*args, **kwargs):  # as the kernel's out-of-memory killer would end it
        os._exit(9)

    monkeypatch.setattr(search, "greedy_search", killed)
    with pytest.raises(DecodingProcessDied, match="exit code 9"):
        translate_ids(model, sources * 6, Search(beam_size=1, batch_tokens=30, workers=2))
