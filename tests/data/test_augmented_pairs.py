"""data.augment_*: the training stream's noise (issue 73): a pure function of (seed, corpus, epoch, pair), packed
by each epoch's own lengths, tags never touched, the tokenizer's sample noised alike."""

import pickle
import random

import numpy as np
import pytest
import torch

from transformer.config import ConfigError, DataConfig
from transformer.data import augment
from transformer.data.augmented_pairs import AugmentSettings, _uniforms
from transformer.data.batching import TokenBatchSampler
from transformer.data.corpus import encoded_split
from transformer.data.sources import InMemory
from transformer.data.tokenizer import augmented_sample, build_tokenizer
from transformer.special import EOS_ID, PAD_ID

WORDS = ["Hund", "Katze", "Haus", "rot", "läuft", "schnell", "ein", "der", "über", "Brücke", "Straße"]


def _corpus(tmp_path, n=300, max_len=40, tagged=False):
    rng = random.Random(5)
    src = [" ".join(rng.choices(WORDS, k=rng.randint(3, 9))) + "." for _ in range(n)]
    tgt = [" ".join(rng.choices(WORDS, k=rng.randint(3, 9))) + "!" for _ in range(n)]
    tokenizer = build_tokenizer(  # as training builds it: its sample noised too, so upper case has pieces
        InMemory(src, tgt, "unit"),
        vocab_size=160,
        cache_dir=tmp_path,
        languages=["en", "fr"] if tagged else (),
        augment={"upper": 0.3, "title": 0.3, "typos": 0.3, "typo_rate": 0.2},
    )
    cfg = DataConfig(name="unit", embedded=True, cache_dir=str(tmp_path), max_len=max_len)
    if tagged:  # a multilingual corpus: every source starts with the target's tag
        cfg.tgt_lang = "fr"
    corpus = encoded_split(InMemory(src, tgt, "unit"), tokenizer, cfg, "train")
    return corpus, tokenizer, src, tgt


def _rows(t):
    return [[i for i in row if i not in (PAD_ID, EOS_ID)] for row in t.tolist()]


def _texts(tokenizer, batch):
    return tokenizer.src.decode(_rows(batch.src)), tokenizer.decode_tgt(_rows(batch.tgt_out))


def test_a_pair_gets_the_same_noise_for_the_same_seed_epoch_and_pair_in_any_process(tmp_path):
    corpus, tokenizer, _, _ = _corpus(tmp_path)
    plain = corpus.collate(range(60))
    corpus.enable_augmentation(tokenizer, AugmentSettings(upper=0.3, typos=0.5, merge=0.2), seed=4)
    assert torch.equal(corpus.collate(range(60)).src, plain.src)  # no key: validation is never noised
    first = corpus.collate(range(60), (0, 3))
    worker = pickle.loads(pickle.dumps(corpus)).collate(range(60), (0, 9))  # a DataLoader worker, another batch
    assert torch.equal(first.src, worker.src) and torch.equal(first.tgt_out, worker.tgt_out)
    # the draws are per pair: the same pair in a different batch, alone, gets the same noise
    alone = corpus.collate([17], (0, 1))
    assert _texts(tokenizer, alone)[0][0] == _texts(tokenizer, first)[0][17]
    next_epoch = corpus.collate(range(60), (1, 3))
    assert _texts(tokenizer, next_epoch) != _texts(tokenizer, first)
    other_seed = pickle.loads(pickle.dumps(corpus))
    other_seed.augmentation.seed = 5
    assert _texts(tokenizer, other_seed.collate(range(60), (0, 3))) != _texts(tokenizer, first)


def test_the_shares_are_drawn_per_pair_in_their_proportions():
    u = _uniforms(seed=1, stream=0, epoch=2, pairs=np.arange(100_000))
    assert u.shape == (100_000, 4) and 0 <= u.min() and u.max() < 1
    assert np.abs((u < 0.1).mean(axis=0) - 0.1).max() < 0.005
    assert abs(np.corrcoef(u[:, 0], u[:, 1])[0, 1]) < 0.01  # the decisions are independent
    assert not np.array_equal(u, _uniforms(1, 1, 2, np.arange(100_000)))  # another corpus of a mixture


def test_each_modifier_changes_what_it_should_and_leaves_the_rest(tmp_path):
    corpus, tokenizer, src, tgt = _corpus(tmp_path)
    clean = _texts(tokenizer, corpus.collate(range(50)))
    pairs = corpus.pair_index[np.arange(50)]
    assert clean == ([src[p] for p in pairs], [tgt[p] for p in pairs])
    for settings, expected in [
        (AugmentSettings(upper=1.0), lambda s, t: (s.upper(), t.upper())),
        (AugmentSettings(title=1.0), lambda s, t: (augment.title(s), augment.title(t))),
        (AugmentSettings(nopunct=1.0), lambda s, t: (s.rstrip("."), t.rstrip("!"))),
    ]:
        corpus.enable_augmentation(tokenizer, settings, seed=1)
        noised = _texts(tokenizer, corpus.collate(range(50), (0, 0)))
        assert noised == tuple(map(list, zip(*[expected(s, t) for s, t in zip(*clean)]))), settings
    corpus.enable_augmentation(tokenizer, AugmentSettings(typos=1.0, typo_rate=0.5), seed=1)
    typo_src, typo_tgt = _texts(tokenizer, corpus.collate(range(50), (0, 0)))
    assert typo_tgt == clean[1]  # typos hit the source only
    assert sum(a != b for a, b in zip(typo_src, clean[0])) > 40
    assert all(a.endswith(".") for a in typo_src)  # punctuation is not a letter: never misspelt


def test_a_merge_joins_the_next_pairs_within_max_len(tmp_path):
    corpus, tokenizer, src, tgt = _corpus(tmp_path, max_len=30)
    corpus.enable_augmentation(tokenizer, AugmentSettings(merge=1.0), seed=2)
    batch = corpus.collate(range(len(corpus)), (0, 0))
    merged_src, merged_tgt = _texts(tokenizer, batch)
    texts = [(src[p], tgt[p]) for p in corpus.pair_index]
    spans = []
    for k, (s, t) in enumerate(zip(merged_src, merged_tgt)):
        span = next(n for n in (3, 2, 1) if k + n <= len(texts) and s == " ".join(x for x, _ in texts[k : k + n]))
        assert t == " ".join(y for _, y in texts[k : k + span])
        spans.append(span)
    assert set(spans) == {1, 2, 3}  # sizes drawn from 2 and 3; alone where the next would not fit
    assert (batch.src != PAD_ID).sum(1).max() - 1 <= 30 and (batch.tgt_out != PAD_ID).sum(1).max() - 1 <= 30
    assert spans[-1] == 1  # the last pair has nothing after it


def test_a_language_tag_is_never_noised(tmp_path):
    corpus, tokenizer, _, _ = _corpus(tmp_path, tagged=True)
    tag = tokenizer.tag_id("fr")
    clean = corpus.collate(range(40))
    assert (clean.src[:, 0] == tag).all()
    corpus.enable_augmentation(tokenizer, AugmentSettings(upper=0.5, typos=0.5, merge=0.5), seed=3)
    noised = corpus.collate(range(40), (0, 0))
    assert (noised.src[:, 0] == tag).all()  # still first, and only once, after a merge too
    assert ((noised.src == tag).sum(1) == 1).all()
    assert not torch.equal(noised.src[:, 1:5], clean.src[:, 1:5])


def test_each_epoch_is_packed_by_its_own_noised_lengths(tmp_path):
    corpus, tokenizer, _, _ = _corpus(tmp_path)
    corpus.enable_augmentation(tokenizer, AugmentSettings(upper=0.4, merge=0.2, typos=0.3), seed=1)
    sampler = TokenBatchSampler(
        corpus.src_lens, corpus.tgt_lens, max_tokens=300, seed=7, epoch_lengths=corpus.epoch_lengths
    )
    for epoch in (0, 1):
        src_lens, tgt_lens = corpus.epoch_lengths(epoch)
        assert (src_lens > corpus.src_lens).mean() > 0.2  # upper case and merges make longer sources
        for number, positions in enumerate(sampler.batches(epoch)):
            batch = corpus.collate(positions, (epoch, number))
            assert ((batch.src != PAD_ID).sum(1).numpy() - 1).tolist() == src_lens[positions].tolist()
            assert ((batch.tgt_out != PAD_ID).sum(1).numpy() - 1).tolist() == tgt_lens[positions].tolist()
            assert len(positions) == 1 or len(positions) * max(batch.src.size(1), batch.tgt_in.size(1)) <= 300


def test_the_tokenizer_sample_is_noised_in_the_same_shares_and_learns_upper_case_pieces(tmp_path):
    lines = [f"ein Hund läuft über die Straße {i}" for i in range(4000)]
    shares = {"upper": 0.2, "title": 0.1, "typos": 0.0, "typo_rate": 0.1}
    noised = list(augmented_sample(lines, shares))
    assert noised == list(augmented_sample(lines, shares))  # the same in every process
    upper = sum(line == line.upper() for line in noised) / len(lines)
    assert 0.17 < upper < 0.23
    plain = build_tokenizer(InMemory(lines, lines, "u"), vocab_size=200, cache_dir=tmp_path / "a")
    covered = build_tokenizer(InMemory(lines, lines, "u"), vocab_size=200, cache_dir=tmp_path / "b", augment=shares)
    text = "EIN HUND LÄUFT ÜBER DIE STRASSE"
    assert len(covered.src.encode(text)) < len(plain.src.encode(text)) / 2  # not shredded into letters


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"augment_upper": 1.5}, "data.augment_upper=1.5 must be a share of pairs in \\[0, 1\\]"),
        ({"augment_upper": 0.6, "augment_title": 0.6}, "augment_upper \\+ augment_title = 1.2"),
        ({"augment_typo_rate": 0.0}, "data.augment_typo_rate=0.0 must be in \\(0, 1\\]"),
        ({"augment_merge": 0.1, "subword_sampling": 0.1}, "data.subword_sampling and data.augment_\\* do not work"),
    ],
)
def test_bad_shares_are_refused_with_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        DataConfig(**overrides).validate()


def test_at_most_half_the_tokenizer_sample_is_noised_so_clean_text_keeps_its_pieces():
    from transformer.data.corpus import _tokenizer_augmentation

    shares = _tokenizer_augmentation(DataConfig(augment_upper=0.9, augment_title=0.1, augment_typos=1.0))
    assert shares == pytest.approx({"upper": 0.45, "title": 0.05, "typos": 0.5, "typo_rate": 0.1})
    assert _tokenizer_augmentation(DataConfig(augment_upper=0.1))["upper"] == 0.1


def test_an_epoch_noises_each_pair_once_and_a_worker_without_the_kept_ids_makes_the_same(tmp_path, monkeypatch):
    corpus, tokenizer, _, _ = _corpus(tmp_path)
    corpus.enable_augmentation(tokenizer, AugmentSettings(upper=0.3, typos=0.5, merge=0.2), seed=4)
    worker = pickle.loads(pickle.dumps(corpus))  # started before the epoch's lengths: nothing kept
    corpus.epoch_lengths(2)  # the batch sampler's packing noises the whole epoch
    calls = []
    noised = type(corpus.augmentation)._noised
    monkeypatch.setattr(type(corpus.augmentation), "_noised", lambda self, *a: calls.append(a[-1]) or noised(self, *a))
    kept = corpus.epoch_sides(np.arange(60), 2)
    assert calls == []  # served from what the lengths made
    assert kept == worker.epoch_sides(np.arange(60), 2) and calls == [2]  # noised afresh, to the same ids
    assert len(pickle.dumps(corpus)) == len(pickle.dumps(worker))  # a worker is not sent the epoch's ids
    later = corpus.epoch_sides(np.arange(60), 3)  # another epoch is never served the kept one
    assert calls == [2, 3] and later != kept


def test_with_a_lower_case_source_upper_and_title_case_add_one_marker_to_the_clean_sources_ids(tmp_path):
    from transformer.data import casing

    rng = random.Random(6)
    words = [w for w in WORDS if "ß" not in w]  # STRASSE lower-cases to strasse: other pieces than straße
    src = [" ".join(rng.choices(words, k=rng.randint(3, 9))) + "." for _ in range(200)]
    tgt = [" ".join(rng.choices(words, k=rng.randint(3, 9))) + "!" for _ in range(200)]
    tokenizer = build_tokenizer(
        InMemory(src, tgt, "unit"), vocab_size=160, cache_dir=tmp_path, inline_case=True, lowercase_source=True
    )
    cfg = DataConfig(name="unit", embedded=True, cache_dir=str(tmp_path), max_len=40)
    corpus = encoded_split(InMemory(src, tgt, "unit"), tokenizer, cfg, "train")
    upper, title = (tokenizer.src.piece_to_id(m) for m in casing.SOURCE_MARKERS)
    clean = corpus.collate(range(50))
    clean_src, clean_tgt = _rows(clean.src), tokenizer.decode_tgt(_rows(clean.tgt_out))
    corpus.enable_augmentation(tokenizer, AugmentSettings(upper=1.0), seed=1)
    noised = corpus.collate(range(50), (0, 0))
    assert _rows(noised.src) == [ids + [upper] for ids in clean_src]
    assert tokenizer.decode_tgt(_rows(noised.tgt_out)) == [t.upper() for t in clean_tgt]  # the target in letters
    corpus.enable_augmentation(tokenizer, AugmentSettings(title=1.0), seed=1)
    titled = _rows(corpus.collate(range(50), (0, 0)).src)
    assert titled == [ids if ids[-1] == title else ids + [title] for ids in clean_src]
    assert sum(ids[-1] != title for ids in clean_src) > 40  # most clean sentences are not in Title case
