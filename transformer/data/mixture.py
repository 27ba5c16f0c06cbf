"""Several training corpora mixed into one training set (`data.corpora`, `data.temperature`).

Each corpus is prepared on its own, like a single corpus (`{name}.train.{key}/` in the cache: runs that
list the same corpus with the same tokenizer share it), with one SentencePiece model trained on all of
them. `MixedCorpus` numbers their kept pairs one corpus after the other (positions 0..N-1) and draws
every epoch's mixture from (seed, epoch) alone:

    share_i = (weight_i * pairs_i) ** (1 / T) / sum_j (weight_j * pairs_j) ** (1 / T)
    an epoch holds N = sum_i pairs_i pairs, of which round(share_i * N) come from corpus i

(rounded so that they sum to N). A corpus drawn more often than it has pairs repeats all of them as
often as fits and adds a random subset; one drawn less often gives a random subset, another each epoch.
T = 1 mixes by (weighted) size, a large T flattens toward equal shares. The epoch's pairs then go
through the usual length bucketing (`TokenBatchSampler(epoch_pairs=...)`), so a batch mixes corpora
and an exact resume needs nothing but the position in the epoch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging

import numpy as np

from transformer.config import AUGMENT_SHARES, CorpusConfig, DataConfig
from transformer.data.augmented_pairs import AugmentSettings
from transformer.data.batching import Batch, flat_ids, make_batch
from transformer.data.corpus import EncodedCorpus, PreparedData, encoded_split, preparation_lock, train_tokenizer
from transformer.data.overlap import warn_of_overlap
from transformer.data.sources import Concatenated, SplitSource, keyed_by_language, open_split
from transformer.data.tokenizer import Tokenizer
from transformer.data.zero_shot import zero_shot_validation
from transformer.errors import DataError

log = logging.getLogger("transformer.data.corpus")
CLEANING_KEYS = ("drop_duplicates", "drop_copies", "max_len_ratio", "langid")  # a corpus may set its own
AUGMENT_KEYS = tuple(f"augment_{name}" for name in (*AUGMENT_SHARES, "typo_rate"))  # and these


def corpus_config(cfg: DataConfig, corpus: CorpusConfig) -> DataConfig:
    """The data config of one corpus of the mixture: its source, name and languages, the cleaning rules it
    sets itself; every other setting (max_len, tokenizer) the run's."""
    own_rules = {key: getattr(corpus, key) for key in CLEANING_KEYS + AUGMENT_KEYS if getattr(corpus, key) is not None}
    return dataclasses.replace(
        cfg,
        name=corpus.label(cfg),
        path=corpus.path,
        hub_id=corpus.hub_id,
        hub_config=corpus.hub_config,
        embedded=False,
        train_split=corpus.train_split,
        local_splits={**cfg.local_splits, **corpus.local_splits},
        src_lang=corpus.src_lang or cfg.src_lang,
        tgt_lang=corpus.tgt_lang or cfg.tgt_lang,
        corpora=[],
        **own_rules,
    )


def _check_one_direction_per_file(part_cfgs: list[DataConfig], part_sources: list[SplitSource]) -> None:
    """A file whose columns do not name their languages (TSV, or src/tgt columns) holds source then target,
    whatever languages a corpus names: listing it for two directions would train both on its one
    direction, the second under the wrong tag."""
    seen: dict[str, tuple[int, str]] = {}
    for i, (part_cfg, source) in enumerate(zip(part_cfgs, part_sources)):
        if keyed_by_language(source, part_cfg.src_lang, part_cfg.tgt_lang):
            continue
        direction = f"{part_cfg.src_lang}-{part_cfg.tgt_lang}"
        first = seen.setdefault(source.where, (i, direction))
        if first[1] != direction:
            raise DataError(
                f"data.corpora[{i}] reads {source.where} as {direction}, and data.corpora[{first[0]}] "
                f"as {first[1]}: a file whose columns do not name their languages holds one direction "
                "(source, then target); for the other, write a file with the columns swapped"
            )


def _direction_validation(cfg: DataConfig, first: DataConfig, index: int) -> tuple[DataConfig, SplitSource]:
    """A multilingual run's validation split of one direction, and the config it is encoded under (named
    as the direction's first corpus, `first`, data.corpora[index]): data.path's / data.hub_id's text in
    those languages where it has some, else that corpus's validation split."""
    problem = "data.path and data.hub_id are not set"
    if cfg.path or cfg.hub_id:
        own = dataclasses.replace(
            first, path=cfg.path, hub_id=cfg.hub_id, hub_config=cfg.hub_config, local_splits=cfg.local_splits
        )
        try:
            source = open_split(own, "validation")
            if keyed_by_language(source, first.src_lang, first.tgt_lang):
                return own, source
            problem = f"{source.where} does not name its languages"
        except DataError as error:
            problem = str(error)
    try:
        return first, open_split(first, "validation", key=f"data.corpora[{index}]")
    except DataError as error:
        raise DataError(
            f"no validation split for {first.src_lang}-{first.tgt_lang}: {error}; nor from "
            f"data.path / data.hub_id ({problem})"
        ) from None


def mixture_shares(sizes, weights, temperature: float) -> np.ndarray:
    """Each corpus's share of an epoch: (weight x pairs)^(1/T), normalised; computed in logarithms, so
    that a small T (or a huge weight) sharpens the shares instead of overflowing."""
    with np.errstate(divide="ignore"):  # an empty corpus: log 0 = -inf, share 0
        logs = (
            np.log(np.asarray(weights, dtype=np.float64)) + np.log(np.asarray(sizes, dtype=np.float64))
        ) / temperature
    scaled = np.exp(logs - logs.max())
    return scaled / scaled.sum()


def epoch_counts(shares: np.ndarray, total: int) -> np.ndarray:
    """round(share x total) per corpus, by largest remainder so that the counts sum to `total`."""
    exact = shares * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


class MixedCorpus:
    """The kept pairs of several prepared corpora, numbered one corpus after the other, and the pairs
    each epoch draws from them (`epoch_positions`). Collates batches that mix corpora; pickles as its
    parts (each as its directory)."""

    sampling = None  # subword sampling is not offered for mixtures (the config refuses it)

    def __init__(
        self, parts: list[EncodedCorpus], weights: list[float], temperature: float, name: str, labels: list[str]
    ):
        self.parts, self.weights, self.temperature, self.name, self.labels = parts, weights, temperature, name, labels
        sizes = [len(part) for part in parts]
        self.starts = np.cumsum([0] + sizes)  # corpus i: positions starts[i]:starts[i + 1]
        self.src_lens = np.concatenate([part.src_lens for part in parts])
        self.tgt_lens = np.concatenate([part.tgt_lens for part in parts])
        self.shares = mixture_shares(sizes, weights, temperature)
        self.counts = epoch_counts(self.shares, len(self))

    def __reduce__(self):
        return MixedCorpus, (self.parts, self.weights, self.temperature, self.name, self.labels)

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def identity(self) -> str:
        """Names this training data in a checkpoint: the corpora, their weights and the temperature."""
        what = {"parts": [part.identity for part in self.parts], "weights": self.weights, "T": self.temperature}
        return f"{self.name}.mixture.{hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]}"

    def epoch_positions(self, seed: int, epoch: int) -> np.ndarray:
        """(N,) int64: the positions epoch `epoch` trains on, corpus by corpus (`counts[i]` of corpus i,
        repeats included); the same for the same (seed, epoch)."""
        drawn = []
        for i, count in enumerate(self.counts.tolist()):
            size = int(self.starts[i + 1] - self.starts[i])
            whole, rest = divmod(count, size)
            subset = np.random.default_rng([seed, epoch, i]).permutation(size)[:rest]
            drawn.append(self.starts[i] + np.concatenate([np.tile(np.arange(size), whole), np.sort(subset)]))
        return np.concatenate(drawn).astype(np.int64)

    def corpus_of(self, positions) -> np.ndarray:
        """Which corpus (its index in data.corpora) each position belongs to."""
        return np.searchsorted(self.starts, np.asarray(positions), side="right") - 1

    @property
    def varies_by_epoch(self) -> bool:
        """Whether some corpus's pairs change from epoch to epoch (its own data.augment_*)."""
        return any(part.varies_by_epoch for part in self.parts)

    def epoch_lengths(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Source and target lengths of every position in `epoch`, corpus after corpus."""
        lengths = [part.epoch_lengths(epoch) for part in self.parts]
        return np.concatenate([src for src, _ in lengths]), np.concatenate([tgt for _, tgt in lengths])

    def collate(self, positions, key=None) -> Batch:
        """The batch of positions `positions`, in their order, whichever corpora they come from; with a
        `key` (epoch, batch number), each augmented corpus's pairs as that epoch noises them."""
        positions = np.asarray(positions, dtype=np.int64)
        owner = self.corpus_of(positions)
        flat, starts = (
            {"src": [], "tgt": []},
            {"src": np.zeros(len(positions), np.int64), "tgt": np.zeros(len(positions), np.int64)},
        )
        lengths = {"src": self.src_lens[positions].astype(np.int64), "tgt": self.tgt_lens[positions].astype(np.int64)}
        used = {"src": 0, "tgt": 0}
        for i in np.unique(owner).tolist():
            rows = np.flatnonzero(owner == i)
            local = positions[rows] - self.starts[i]
            noised = self.parts[i].epoch_sides(local, key[0]) if key is not None else None
            pairs = self.parts[i].pair_index[local]
            for k, side in enumerate(("src", "tgt")):
                if noised is not None:
                    compact, compact_starts, side_lengths = flat_ids(noised[k])
                    lengths[side][rows] = side_lengths
                else:
                    ids, offsets = self.parts[i].stored(side)
                    compact, compact_starts = _gather(ids, offsets[pairs], lengths[side][rows])
                flat[side].append(compact)
                starts[side][rows] = compact_starts + used[side]
                used[side] += len(compact)
        src, tgt = (np.concatenate(flat[side]) if flat[side] else np.zeros(0, np.int64) for side in ("src", "tgt"))
        return make_batch(src, starts["src"], lengths["src"], tgt, starts["tgt"], lengths["tgt"])

    def report(self) -> None:
        """One line on how each epoch is mixed."""
        rows = []
        for label, part, weight, share, count in zip(self.labels, self.parts, self.weights, self.shares, self.counts):
            rows.append(
                f"{label} {len(part):,} pairs x weight {weight:g} -> {100 * share:.1f}% "
                f"({count / len(part):.2f}x its pairs)"
            )
        log.info(
            "training mixture (data.temperature=%g), each epoch %s pairs: %s",
            self.temperature,
            f"{len(self):,}",
            "; ".join(rows),
        )


def _gather(flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sequences flat[starts[b] : starts[b] + lengths[b]] side by side in one int64 array, and where
    each begins in it."""
    lengths = lengths.astype(np.int64)  # compact (uint16) lengths: their cumsum is uint64, and uint64 - int64 float
    new_starts = np.cumsum(lengths) - lengths
    index = np.repeat(starts - new_starts, lengths) + np.arange(int(lengths.sum()))
    return flat[index].astype(np.int64), new_starts


class LanguageSample(SplitSource):
    """What a multilingual mixture's joint SentencePiece model trains on: each language's text once (a
    side that several corpora share, English in de-en and en-fr from one directory, is read once) and
    at most `per_language` lines of each language (its first ones, corpus after corpus), so that one
    language's volume does not drown the others in SentencePiece's sample."""

    def __init__(self, sides: dict[str, list[tuple[SplitSource, int]]], per_language: int):
        self.sides, self.per_language = sides, per_language  # language -> [(source, 0 = src, 1 = tgt)]
        self.where = " + ".join(f"{language} ({len(entries)} file(s))" for language, entries in sides.items())

    def _compute_fingerprint(self) -> str:
        what = [
            [language, [(source.fingerprint(), index) for source, index in entries]]
            for language, entries in self.sides.items()
        ]
        return hashlib.sha256(json.dumps([what, self.per_language]).encode()).hexdigest()[:16]

    def lines(self, *sides: str):
        return self

    def __iter__(self):
        for entries in self.sides.values():
            left = self.per_language
            for source, index in entries:
                for chunk in source.chunks():
                    taken = chunk[index][:left]
                    yield from taken
                    left -= len(taken)
                    if not left:
                        break
                if not left:
                    break


def tokenizer_input(cfg: DataConfig, part_cfgs: list[DataConfig], part_sources: list[SplitSource]) -> SplitSource:
    """The text the joint tokenizer trains on: all training splits, or, for a multilingual model, a
    sample balanced across languages (`LanguageSample`)."""
    if not cfg.target_languages():
        return Concatenated(part_sources)
    sides: dict[str, dict[tuple, tuple[SplitSource, int]]] = {}
    for part_cfg, source in zip(part_cfgs, part_sources):
        where = (part_cfg.path, part_cfg.hub_id, part_cfg.hub_config, part_cfg.train_split)
        for index, language in enumerate((part_cfg.src_lang, part_cfg.tgt_lang)):
            sides.setdefault(language, {}).setdefault(where, (source, index))
    # 0 = every line: the whole corpus of each language (SentencePiece keeps every sentence too)
    per_language = -(-cfg.tokenizer_sample // len(sides)) if cfg.tokenizer_sample > 0 else 2**62
    return LanguageSample({language: list(entries.values()) for language, entries in sides.items()}, per_language)


def prepare_mixture(cfg: DataConfig, tokenizer: Tokenizer | None, splits, sources: dict | None) -> PreparedData:
    """`prepare.prepare` for data.corpora: one tokenizer for all corpora (unless given), each corpus's
    training split prepared under its own lock; validation (and test) from data.path / data.hub_id, and
    for a multilingual model a validation split per direction: data.path's files in those languages, else
    the first corpus's of that direction."""
    multilingual = bool(cfg.target_languages())
    others: dict[str, SplitSource] = dict(
        sources
        or {
            split: open_split(cfg, split)
            for split in splits
            if split != "train" and not (multilingual and split == "validation")
        }
    )
    others.pop("train", None)
    part_cfgs = [corpus_config(cfg, corpus) for corpus in cfg.corpora]
    part_sources = [open_split(part_cfg, "train", key=f"data.corpora[{i}]") for i, part_cfg in enumerate(part_cfgs)]
    _check_one_direction_per_file(part_cfgs, part_sources)
    joined = Concatenated(part_sources)
    if tokenizer is None:
        text = tokenizer_input(cfg, part_cfgs, part_sources)
        tokenizer = train_tokenizer(cfg, text, build=False)
        if tokenizer is None:
            with preparation_lock(cfg):
                tokenizer = train_tokenizer(cfg, text)
    if multilingual and not tokenizer.target_languages:  # a bilingual model's, given by init_from or resume
        raise DataError(
            f"data.corpora translate into {', '.join(cfg.target_languages())}, but the tokenizer this "
            "run continues with (trainer.init_from, or the checkpoint it resumes) is a bilingual "
            "model's, without target-language tags: train the multilingual model from the start, or "
            "fine-tune on corpora into one target language"
        )
    parts = [_encoded(part_cfg, source, tokenizer, "train") for part_cfg, source in zip(part_cfgs, part_sources)]
    directions = {}
    if multilingual and ("validation" in splits or "validation" in others):
        others.pop("validation", None)
        for src_lang, tgt_lang in cfg.directions():
            i, first = next((i, p) for i, p in enumerate(part_cfgs) if (p.src_lang, p.tgt_lang) == (src_lang, tgt_lang))
            where, source = _direction_validation(cfg, first, i)
            directions[f"{src_lang}-{tgt_lang}"] = (_encoded(where, source, tokenizer, "validation"), source)
        main = directions.get(f"{cfg.src_lang}-{cfg.tgt_lang}") or next(iter(directions.values()))
        others["validation"] = main[1]
    encoded = {
        split: _encoded(cfg, source, tokenizer, split)
        for split, source in others.items()
        if not (directions and split == "validation")
    }
    if directions:
        encoded["validation"] = main[0]
    for part in parts:
        part.report()
    train = MixedCorpus(
        parts,
        [corpus.weight for corpus in cfg.corpora],
        cfg.temperature,
        cfg.name,
        [corpus.label(cfg) for corpus in cfg.corpora],
    )
    train.report()
    for valid in [corpus for corpus, _ in directions.values()] or [encoded.get("validation")]:
        if valid is not None:
            valid.report()
            warn_of_overlap(parts, train.identity, valid, "validation")
    log.info(
        "data %s: %d training pairs in %d corpora%s",
        cfg.name,
        len(train),
        len(parts),
        f", validation: {', '.join(f'{d} {len(c)} pairs' for d, (c, _) in directions.items())}"
        if directions
        else f", {len(encoded['validation'])} validation pairs"
        if "validation" in encoded
        else "",
    )
    zero_shot = {}
    if directions and cfg.validate_zero_shot:
        zero_shot = zero_shot_validation(cfg, lambda own, source, split: _encoded(own, source, tokenizer, split))
        log.info(
            "zero-shot validation: %s",
            ", ".join(f"{d} {len(c)} pairs" for d, (c, _) in zero_shot.items()) or "none (no text in both languages)",
        )
    return PreparedData(tokenizer, train, encoded.get("validation"), {**others, "train": joined}, directions, zero_shot)


def _encoded(cfg: DataConfig, source: SplitSource, tokenizer: Tokenizer, split: str) -> EncodedCorpus:
    """A prepared split: read if cached and whole, else prepared under the lock of `cfg`'s corpus."""
    corpus = encoded_split(source, tokenizer, cfg, split, build=False)
    if corpus is None:
        with preparation_lock(cfg):
            corpus = encoded_split(source, tokenizer, cfg, split)
    return corpus


def enable_augmentation(train: EncodedCorpus | MixedCorpus, cfg: DataConfig, tokenizer: Tokenizer, seed: int) -> None:
    """data.augment_* on the training split; in a mixture, each corpus by its own keys or else the run's,
    with its index in data.corpora telling its draws apart."""
    if isinstance(train, MixedCorpus):
        for stream, (part, corpus) in enumerate(zip(train.parts, cfg.corpora)):
            settings = AugmentSettings.of(corpus_config(cfg, corpus))
            if settings:
                part.enable_augmentation(tokenizer, settings, seed, stream)
        return
    settings = AugmentSettings.of(cfg)
    if settings:
        train.enable_augmentation(tokenizer, settings, seed)
