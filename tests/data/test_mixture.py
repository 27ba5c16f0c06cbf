"""Training on several corpora (data.corpora): the shares of an epoch, the batches that mix them, what a
mixture prepares, the config's refusals, and an exact resume of a two-corpus run."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import FAST, compose_config
from transformer.checkpoint import load_checkpoint
from transformer.config import ConfigError
from transformer.data.batching import TokenBatchSampler, pad_sequences
from transformer.data.mixture import MixedCorpus, epoch_counts, mixture_shares
from transformer.data.prepare import prepare
from transformer.data.toy import generate
from transformer.errors import DataError


def _write_corpus(directory: Path, pairs: int, seed: int) -> Path:
    """A corpus directory of files: {train,validation,test}.{de,en}, from the toy generator."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, (src, tgt) in generate(pairs, 40, 40, seed=seed).items():
        (directory / f"{split}.de").write_text("\n".join(src) + "\n")
        (directory / f"{split}.en").write_text("\n".join(tgt) + "\n")
    return directory


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("corpora")
    return _write_corpus(root / "big", 900, seed=1), _write_corpus(root / "small", 150, seed=2)


def _mixture_overrides(corpora, weights=(1, 1), temperature=1.0) -> list[str]:
    big, small = corpora
    return [
        f"data.path={big}",
        "data.name=mix",
        "data.embedded=false",
        f"data.corpora=[{{path: {big}, weight: {weights[0]}}}, {{path: {small}, weight: {weights[1]}}}]",
        f"data.temperature={temperature}",
    ]


def test_shares_follow_weighted_size_and_flatten_with_the_temperature():
    assert np.allclose(mixture_shares([900, 100], [1, 1], 1.0), [0.9, 0.1])
    assert np.allclose(mixture_shares([900, 100], [1, 9], 1.0), [0.5, 0.5])  # weight 9 = 9x the size
    assert np.allclose(mixture_shares([900, 100], [1, 1], 2.0), [0.75, 0.25])  # sqrt(9) : 1
    assert np.allclose(mixture_shares([900, 100], [1, 1], 1e6), [0.5, 0.5], atol=1e-4)  # toward uniform
    counts = epoch_counts(np.array([1 / 3, 1 / 3, 1 / 3]), 1000)
    assert counts.sum() == 1000 and sorted(counts.tolist()) == [333, 333, 334]


def test_each_epoch_draws_every_corpus_in_its_share_and_batches_mix_them(corpora, data_cache):
    cfg = compose_config(FAST + _mixture_overrides(corpora, weights=(1, 3), temperature=2.0), data_cache)
    train = prepare(cfg.data).train
    assert isinstance(train, MixedCorpus)
    big, small = (len(part) for part in train.parts)
    expected = mixture_shares([big, small], [1, 3], 2.0)
    sampler = TokenBatchSampler(
        train.src_lens, train.tgt_lens, 300, seed=7, epoch_pairs=lambda epoch: train.epoch_positions(7, epoch)
    )
    subsets = []
    for epoch in range(3):
        positions = np.concatenate(list(sampler.batches(epoch)))
        assert len(positions) == big + small  # an epoch holds all pairs' count
        assert np.array_equal(np.sort(positions), np.sort(train.epoch_positions(7, epoch)))
        drawn = np.bincount(train.corpus_of(positions), minlength=2)
        assert np.abs(drawn / len(positions) - expected).max() <= 1 / len(positions)  # rounding only
        first = positions[train.corpus_of(positions) == 0]
        assert len(np.unique(first)) == len(first)  # a down-sampled corpus: no repeats
        subsets.append(frozenset(first.tolist()))
        small_drawn = np.bincount(positions[train.corpus_of(positions) == 1] - big)
        assert small_drawn.min() >= drawn[1] // small  # every pair of the up-sampled one
        assert any(
            len(set(batch.tolist()) & set(range(big))) and len(set(batch.tolist()) - set(range(big)))
            for batch in sampler.batches(epoch)
        )  # batches mix the corpora
    assert len(set(subsets)) == 3  # another subset each epoch
    assert np.array_equal(train.epoch_positions(7, 1), train.epoch_positions(7, 1))


def test_a_mixed_batch_holds_each_pairs_own_ids(corpora, data_cache):
    cfg = compose_config(FAST + _mixture_overrides(corpora), data_cache)
    train = prepare(cfg.data).train
    positions = np.array([len(train) - 1, 0, train.parts[0].__len__(), 5, len(train) - 2])
    batch = train.collate(positions)
    src, tgt = [], []
    for position in positions.tolist():  # the slow reference: pair by pair
        corpus = int(train.corpus_of([position])[0])
        s, t = train.parts[corpus].ids(position - int(train.starts[corpus]))
        src.append(s)
        tgt.append(t)
    from transformer.special import BOS_ID, EOS_ID

    assert torch.equal(batch.src, pad_sequences(src, suffix=[EOS_ID]))
    assert torch.equal(batch.tgt_out, pad_sequences(tgt, suffix=[EOS_ID]))
    assert torch.equal(batch.tgt_in[:, 0], torch.full((len(positions),), BOS_ID))
    assert batch.num_tgt_tokens == sum(len(t) + 1 for t in tgt)


def test_each_corpus_is_prepared_once_and_shared_by_runs_that_list_it(corpora, tmp_path, caplog):
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="transformer"):
        first = prepare(compose_config(FAST + _mixture_overrides(corpora), cache).data).train
    assert (
        "training mixture (data.temperature=1), each epoch 1,050 pairs: big 900 pairs x weight 1 -> 85.7%"
        in caplog.text
    )
    directories = sorted(p.name.split(".")[0] for p in (cache / "corpus").iterdir())
    assert directories == ["big", "mix", "small"]  # mix: the validation split
    stamps = {p: p.stat().st_mtime_ns for p in (cache / "corpus").iterdir()}
    again = prepare(compose_config(FAST + _mixture_overrides(corpora, weights=(2, 1)), cache).data).train
    assert {p: p.stat().st_mtime_ns for p in (cache / "corpus").iterdir()} == stamps  # nothing prepared again
    assert [p.identity for p in again.parts] == [p.identity for p in first.parts]
    assert again.identity != first.identity  # other weights: another mixture


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.corpora=[{weight: 1}]", "data.corpora[0] names no source: give it a path"),
        ("data.corpora=[{path: a, weight: 0}]", "data.corpora[0].weight=0.0 must be a positive number"),
        ("data.corpora=[{path: a, weight: nan}]", "data.corpora[0].weight"),
        ("data.corpora=[{path: x/a}, {path: y/a}]", "two corpora are named 'a'; give each a name"),
        (
            "data.corpora=[{path: x/a}, {path: x/./a/, name: again}]",
            "data.corpora[1] reads the same text as "
            "data.corpora[0] (x/./a/, de-en): every pair would count twice; to weigh a corpus more, give it a weight",
        ),
        ("data.temperature=0", "data.temperature=0.0 must be a positive number"),
        (
            "data.temperature=2",
            "data.temperature=2.0 flattens the shares of the corpora listed in data.corpora, and "
            "there is no data.corpora (one corpus: data.path): nothing to mix",
        ),
    ],
)
def test_a_bad_mixture_is_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose_config([override])


def test_a_checkpoint_whose_corpora_list_one_text_twice_still_loads():
    """The refusal is for training: a config saved before it (in a checkpoint) must load to translate."""
    from transformer.config import Config

    raw = compose_config(["data.corpora=[{path: x/a}, {path: x/b}]"]).to_dict()
    raw["data"]["corpora"][1]["path"] = "x/a"
    raw["data"]["corpora"][1]["name"] = "again"
    assert len(Config.from_dict(raw, saved=True).data.corpora) == 2
    with pytest.raises(ConfigError, match=r"data.corpora\[1\] reads the same text as data.corpora\[0\]"):
        Config.from_dict(raw)


def test_a_temperature_needs_two_corpora_to_mix(corpora):
    big = corpora[0]
    one = [f"data.path={big}", "data.name=mix", "data.embedded=false", f"data.corpora=[{{path: {big}}}]"]
    with pytest.raises(ConfigError, match="there is one corpus in data.corpora: nothing to mix"):
        compose_config(one + ["data.temperature=3"])
    assert compose_config(one).data.temperature == 1.0
    assert compose_config(_mixture_overrides(corpora, temperature=3.0)).data.temperature == 3.0


def test_an_unknown_corpus_key_lists_the_keys_a_corpus_takes():
    with pytest.raises(ConfigError) as error:
        compose_config(["data.corpora=[{path: a, wieght: 2}]"])
    assert "wieght" in str(error.value) and "weight" in str(error.value) and "hub_id" in str(error.value)


def test_subword_sampling_of_a_mixture_is_refused(corpora):
    with pytest.raises(ConfigError, match="data.subword_sampling does not work with data.corpora"):
        compose_config(_mixture_overrides(corpora) + ["data.subword_sampling=0.1"])


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_two_corpus_run_resumed_mid_epoch_trains_like_an_uninterrupted_one(
    corpora, tmp_path, data_cache, workers, caplog
):
    from transformer.training.trainer import train

    common = (
        FAST
        + _mixture_overrides(corpora, weights=(1, 2), temperature=1.5)
        + [
            "trainer.precision=fp32",
            "trainer.device=cpu",
            "trainer.max_tokens=3000",
            "trainer.validate_every=4",
            "trainer.val_max_sentences=8",
            "decode.beam_size=1",
            "model.dropout=0.2",
            "trainer.max_minutes=0",
            "trainer.test_at_end=false",
            f"trainer.num_workers={workers}",
        ]
    )
    train(compose_config(common + ["trainer.max_steps=12"], data_cache), tmp_path / "full")
    train(compose_config(common + ["trainer.max_steps=5"], data_cache), tmp_path / "split")
    state = load_checkpoint(tmp_path / "split/checkpoints/last.pt")
    assert state["step"] == 5 and state["data_state"]["epoch"] == 0 and state["data_state"]["position"] > 0
    assert ".mixture." in state["data_state"]["batching"]["corpus"]
    with caplog.at_level(logging.WARNING, logger="transformer"):
        train(compose_config(common + ["trainer.max_steps=12", "trainer.resume=true"], data_cache), tmp_path / "split")
    assert "not an exact resume" not in caplog.text
    full = load_checkpoint(tmp_path / "full/checkpoints/last.pt")
    resumed = load_checkpoint(tmp_path / "split/checkpoints/last.pt")
    assert full["data_state"]["epoch"] >= 1  # the run crossed into a second epoch
    for name, value in full["model"].items():
        assert torch.equal(value, resumed["model"][name]), name


def test_a_small_temperature_or_a_huge_weight_sharpens_the_shares_without_overflowing():
    shares = mixture_shares([4_500_000, 1_000_000], [1, 1], 0.02)  # (4.5M)^50 overflows a float
    assert np.isfinite(shares).all() and shares.sum() == pytest.approx(1.0)
    assert shares[0] == pytest.approx(1.0) and shares[1] < 1e-30
    assert np.allclose(mixture_shares([10, 10], [1e308, 1e307], 1.0), [10 / 11, 1 / 11])  # 1e309: inf
    assert epoch_counts(shares, 1000).tolist() == [1000, 0]


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.corpora=[{path: a, name: web/crawl}]", "data.corpora[0].name='web/crawl' names directories and files"),
        (
            "data.corpora=[{path: a, src_lang: en, tgt_lang: fr}]",
            "data.src_lang=de data.tgt_lang=en: the direction the test at the end scores (and the model's default) "
            "is not one data.corpora trains (en-fr); set data.src_lang=en data.tgt_lang=fr",
        ),
    ],
)
def test_a_mixture_whose_names_or_test_direction_cannot_work_is_refused(override, message):
    with pytest.raises(ConfigError) as error:
        compose_config([override])
    assert message in str(error.value)


def test_a_corpus_that_cannot_be_read_is_named_by_its_own_key(corpora, tmp_path, data_cache):
    big, _ = corpora
    cfg = compose_config(
        FAST
        + [
            f"data.path={big}",
            "data.name=mix",
            "data.embedded=false",
            f"data.corpora=[{{path: {big}}}, {{path: {tmp_path / 'nope'}}}]",
        ],
        data_cache,
    )
    with pytest.raises(DataError) as error:
        prepare(cfg.data)
    assert str(error.value) == f"data.corpora[1].path={tmp_path / 'nope'}: no such file or directory"


def test_a_direction_validates_on_data_path_when_its_first_corpus_has_no_validation_split(
    corpora, tmp_path, data_cache
):
    big, _ = corpora
    train_only = tmp_path / "train_only"  # en->de training text, no validation files
    train_only.mkdir()
    for language in ("de", "en"):
        (train_only / f"train.{language}").write_text((big / f"train.{language}").read_text())
    cfg = compose_config(
        FAST
        + [
            f"data.path={big}",
            "data.name=both",
            "data.embedded=false",
            f"data.corpora=[{{path: {big}, src_lang: de, tgt_lang: en}}, "
            f"{{path: {train_only}, src_lang: en, tgt_lang: de}}]",
        ],
        data_cache,
    )
    data = prepare(cfg.data)
    validation_lines = len((big / "validation.de").read_text().splitlines())
    assert {direction: len(corpus) for direction, (corpus, _) in data.directions.items()} == {
        "de-en": validation_lines,
        "en-de": validation_lines,
    }


def test_one_tsv_file_listed_for_two_directions_is_refused(tmp_path, data_cache):
    corpus = tmp_path / "tsv"
    corpus.mkdir()
    (corpus / "train.tsv").write_text("".join(f"Satz {i} .\tSentence {i} .\n" for i in range(50)))
    cfg = compose_config(
        FAST
        + [
            f"data.path={corpus}",
            "data.name=tsv",
            "data.embedded=false",
            f"data.corpora=[{{path: {corpus}, src_lang: de, tgt_lang: en}}, "
            f"{{path: {corpus}, src_lang: en, tgt_lang: de}}]",
        ],
        data_cache,
    )
    with pytest.raises(DataError) as error:
        prepare(cfg.data)
    assert str(error.value) == (
        f"data.corpora[1] reads {corpus / 'train.tsv'} as en-de, and data.corpora[0] as "
        "de-en: a file whose columns do not name their languages holds one direction (source, "
        "then target); for the other, write a file with the columns swapped"
    )


def test_a_direction_validates_on_its_corpus_when_data_path_does_not_name_languages(corpora, tmp_path, data_cache):
    big, _ = corpora
    tsv = tmp_path / "tsv"  # de TAB en: no language in the file names
    tsv.mkdir()
    for split in ("train", "validation"):
        de, en = (big / f"{split}.de").read_text().splitlines(), (big / f"{split}.en").read_text().splitlines()
        (tsv / f"{split}.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in zip(de, en)))
    cfg = compose_config(
        FAST
        + [
            f"data.path={tsv}",
            "data.name=both",
            "data.embedded=false",
            f"data.corpora=[{{path: {tsv}, src_lang: de, tgt_lang: en}}, {{path: {big}, src_lang: en, tgt_lang: de}}]",
        ],
        data_cache,
    )
    directions = prepare(cfg.data).directions
    assert directions["de-en"][1].where == str(tsv / "validation.tsv")
    assert directions["en-de"][1].where == f"{big / 'validation.en'} + validation.de"  # not the TSV read backwards


def test_each_corpus_of_a_mixture_is_augmented_by_its_own_shares(corpora, data_cache):
    """data.corpora[i].augment_*: the first corpus upper-cased (its own share), the second left clean (the
    run's 0); a batch mixing both collates each row as its corpus says, at the epoch's packed lengths."""
    from transformer.data.mixture import enable_augmentation
    from transformer.special import EOS_ID, PAD_ID

    big, small = corpora
    overrides = _mixture_overrides(corpora)
    overrides[3] = f"data.corpora=[{{path: {big}, augment_upper: 1.0}}, {{path: {small}}}]"
    cfg = compose_config(FAST + overrides, data_cache)
    data = prepare(cfg.data)
    train, tokenizer = data.train, data.tokenizer
    enable_augmentation(train, cfg.data, tokenizer, seed=1)
    assert train.parts[0].augmentation is not None and train.parts[1].augmentation is None
    assert train.varies_by_epoch
    positions = np.array([len(train) - 1, 0, len(train.parts[0]), 5, len(train) - 2])
    clean, noised = train.collate(positions), train.collate(positions, (0, 0))
    src_lens, _ = train.epoch_lengths(0)

    def texts(batch):
        return tokenizer.src.decode([[i for i in row if i not in (PAD_ID, EOS_ID)] for row in batch.src.tolist()])

    for row, (before, after) in enumerate(zip(texts(clean), texts(noised))):
        first_corpus = positions[row] < len(train.parts[0])
        assert after == (before.upper() if first_corpus else before), row
    assert ((noised.src != PAD_ID).sum(1).numpy() - 1).tolist() == src_lens[positions].tolist()
