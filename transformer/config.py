"""The one config schema: these dataclasses hold every key, its type and its default.

They are registered in Hydra's ConfigStore (`schema`, and the default option of each group), so Hydra
itself rejects unknown keys and wrong types while composing; the YAML presets in `conf/` (shipped
inside the package) only override values. `Config.from_dict` builds the dataclasses from the composed
result (or a checkpoint's saved config) and rejects impossible values with an error that names the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from transformer.errors import ConfigError  # noqa: F401  (its home is errors.py; imported from here too)
from transformer.install import upgrade_hint

# Hydra's config tree, inside the package (absolute, so that any launcher finds it: -m, torchrun,
# console scripts, an installed wheel).
CONF_DIR = Path(__file__).resolve().parent / "conf"


# `model.attention`: what each one does is said in transformer/attention.py, which takes this list.
ATTENTION_BACKENDS = ("auto", "sdpa", "matmul", "math")


def setting(
    default: Any = dataclasses.MISSING,
    meaning: str = "",
    *,
    factory: Any = dataclasses.MISSING,
    shown_type: str | None = None,
    **more: Any,
) -> Any:
    """A schema key: its default (or default factory) and what it means, which `--help` and the README's
    key table show (`schema_keys`). `shown_type` replaces the annotation there where that says too little;
    `more`: further metadata (a decoding option's rule, `decode_setting`)."""
    metadata = {"help": meaning, "type": shown_type} if shown_type else {"help": meaning}
    return field(default=default, default_factory=factory, metadata={**metadata, **more})


@dataclass
class ModelConfig:
    """The network: model=tiny (these defaults) and the presets small, base, big."""

    name: str = setting("tiny", "the preset's name; names the run directory (runs/DATA/MODEL/...)")
    d_model: int = setting(128, "model width D (embeddings, residual stream)")
    n_heads: int = setting(4, "attention heads; must divide d_model")
    d_ff: int = setting(512, "feed-forward inner width")
    encoder_layers: int = setting(2, "encoder layers")
    decoder_layers: int = setting(2, "decoder layers")
    residual_free_layer: int = setting(
        0,
        "the encoder layer (1 = first) whose self-attention adds no residual: its output alone goes on, so "
        "the encoder's output is less tied to the source's positions and language, a lever for the directions "
        "no corpus trains (Liu et al. 2021 drop it in one middle layer); 0 = every layer keeps its residual",
    )
    dropout: float = setting(0.1, "residual, embedding and feed-forward dropout, in [0, 1)")
    attention_dropout: float = setting(0.0, "dropout on attention weights, in [0, 1)")
    src_word_dropout: float = setting(
        0.0,
        "in training, drop this share of whole source tokens (the embedding "
        "zeroed, the kept ones scaled up; Marian's --dropout-src), never the "
        "special tokens or language tags; in [0, 1)",
    )
    tgt_word_dropout: float = setting(0.0, "the same for the decoder's input tokens (Marian's --dropout-trg)")
    pre_norm: bool = setting(True, "true: LayerNorm before each sublayer (stable); false: after (the paper)")
    tie_embeddings: bool = setting(True, "share target embeddings with the output layer (and the source, if joint)")
    max_positions: int = setting(1024, "longest sequence the sinusoidal table covers; longer sources are truncated")
    attention: str = setting(
        "auto",
        "auto (on a CPU SDPA's fused kernel in float32, matmuls in bf16/fp16; SDPA's "
        "flash/efficient/math kernels on a GPU) | "
        "sdpa (PyTorch's pick, cuDNN included) | matmul | math (the reference "
        "formula); see transformer/attention.py",
    )

    def validate(self) -> None:
        _require_finite("model", self)
        for key in ("d_model", "n_heads", "d_ff", "encoder_layers", "decoder_layers", "max_positions"):
            _positive(f"model.{key}", getattr(self, key))
        _within_limits("model", self)
        if not 0 <= self.residual_free_layer <= self.encoder_layers:
            raise ConfigError(
                f"model.residual_free_layer={self.residual_free_layer} names no encoder layer of "
                f"model.encoder_layers={self.encoder_layers}: give 1 to {self.encoder_layers} (a middle one, e.g. "
                f"{(self.encoder_layers + 1) // 2}), or 0 to keep every residual"
            )
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                "choose n_heads that divides d_model (e.g. model.n_heads=8 for d_model=512)"
            )
        for key in ("dropout", "attention_dropout", "src_word_dropout", "tgt_word_dropout"):
            value = getattr(self, key)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"model.{key}={value} must be in [0, 1)")
        if self.attention not in ATTENTION_BACKENDS:
            raise ConfigError(f"model.attention={self.attention!r} must be one of {', '.join(ATTENTION_BACKENDS)}")


def _file_name(key: str, name: str) -> None:
    """A name that becomes part of directory and file names (the cache entries, runs/NAME/)."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise ConfigError(
            f"{key}={name!r} names directories and files: give a name that is not empty, . or .., "
            "without '/' or '\\' (e.g. web_crawl)"
        )


LANGUAGE_TAG_SIDES = ("source", "both", "decoder")  # data.language_tag
AUGMENT_SHARES = ("upper", "title", "typos", "nopunct", "merge")  # data.augment_<name>: a share of pairs


def _check_augmentation(where: str, cfg) -> None:
    """data.augment_* (or a corpus's own): shares in [0, 1], upper + title at most 1, a typo rate in (0, 1]."""
    for name in AUGMENT_SHARES:
        value = getattr(cfg, f"augment_{name}")
        if value is not None and not 0.0 <= value <= 1.0:
            raise ConfigError(f"{where}.augment_{name}={value} must be a share of pairs in [0, 1] (0 = off; e.g. 0.05)")
    upper, title = cfg.augment_upper or 0.0, cfg.augment_title or 0.0
    if upper + title > 1.0:
        raise ConfigError(
            f"{where}.augment_upper + augment_title = {upper + title:g}: a pair gets one case at most, so the two "
            "shares may add up to 1 at most"
        )
    rate = cfg.augment_typo_rate
    if rate is not None and not 0.0 < rate <= 1.0:
        raise ConfigError(f"{where}.augment_typo_rate={rate} must be in (0, 1] (e.g. 0.1: one word in ten)")


@dataclass
class CorpusConfig:
    """One training corpus of a mixture (`data.corpora`): where its text is, how much of each epoch it
    makes up. Validation and test come from data.path / data.hub_id, as for a single corpus."""

    path: str | None = setting(None, "local directory (or file) with its training split")
    hub_id: str | None = setting(None, "or a HuggingFace hub dataset id")
    hub_config: str | None = setting(None, "the hub dataset's configuration name, if it has several")
    name: str | None = setting(
        None,
        "names its prepared directory (default: the last part of path or hub_id); "
        "runs that list the same corpus share it",
    )
    weight: float = setting(1.0, "multiplies its size in the mixture (2 = as if it were twice as large)")
    train_split: str = setting("train", "its split trained on")
    local_splits: dict[str, str] = setting(factory=dict, meaning="file stem per split where it differs")
    src_lang: str | None = setting(None, "its source language (default: data.src_lang)")
    tgt_lang: str | None = setting(
        None,
        "its target language (default: data.tgt_lang); corpora into more than "
        "one target language train one multilingual model with target tags",
    )
    drop_duplicates: bool | None = setting(None, "its own cleaning rule (default: data.drop_duplicates)")
    drop_copies: bool | None = setting(None, "its own cleaning rule (default: data.drop_copies)")
    max_len_ratio: float | None = setting(None, "its own cleaning rule (default: data.max_len_ratio)")
    langid: bool | None = setting(
        None, "its own cleaning rule (default: data.langid): e.g. true for a crawled corpus only"
    )
    augment_upper: float | None = setting(None, "its own data.augment_upper (default: the run's)")
    augment_title: float | None = setting(None, "its own data.augment_title (default: the run's)")
    augment_typos: float | None = setting(None, "its own data.augment_typos (default: the run's)")
    augment_typo_rate: float | None = setting(None, "its own data.augment_typo_rate (default: the run's)")
    augment_nopunct: float | None = setting(None, "its own data.augment_nopunct (default: the run's)")
    augment_merge: float | None = setting(None, "its own data.augment_merge (default: the run's)")

    def label(self, data: DataConfig) -> str:
        """The corpus's name: given, or the last part of its path or hub id (and its languages, where it
        names its own: multi30k_fr_en)."""
        if self.name:
            return self.name
        where = (self.path or self.hub_id or "corpus").rstrip("/\\")
        base = Path(where).name.split(".")[0] or "corpus"
        if self.src_lang or self.tgt_lang:
            return f"{base}_{self.src_lang or data.src_lang}_{self.tgt_lang or data.tgt_lang}"
        return base


@dataclass
class DataConfig:
    """The corpus and its tokenizer: a data preset (toy, custom, multi30k_*, ...) fills these in. Where the
    text comes from, first match wins: path (local files), hub_id, embedded."""

    name: str = setting("custom", "names the run directory (runs/NAME/...) and the cache entries")
    path: str | None = setting(None, "local directory with {split}.{lang}, .tsv, .jsonl or .parquet files")
    hub_id: str | None = setting(None, "HuggingFace hub dataset id")
    hub_config: str | None = setting(None, "its configuration name, if it has several")
    embedded: bool = setting(False, "the generated corpus of transformer/data/toy.py (data=toy)")
    embedded_pairs: int = setting(12000, "training pairs generated for the embedded corpus")
    src_lang: str = setting("de", "source language code: file suffix, column or `translation` key")
    tgt_lang: str = setting("en", "target language code")
    train_split: str = setting("train", "the split trained on")
    valid_split: str = setting("validation", "the split validated on (loss, BLEU, best.pt)")
    test_split: str = setting("test", "the split translated and scored at the end")
    local_splits: dict[str, str] = setting(
        factory=dict,
        meaning="file stem per split where it differs from the split name, e.g. "
        "'{validation: dev, test: newstest2014}' (Multi30k: val, test_2016_flickr)",
    )
    max_len: int = setting(256, "drop training pairs longer than this many tokens on either side")
    drop_duplicates: bool = setting(
        True, "cleaning: keep the first of training pairs identical on both sides (whitespace at the ends aside)"
    )
    drop_copies: bool = setting(True, "cleaning: drop training pairs whose source equals their target")
    max_len_ratio: float = setting(
        9.0, "cleaning: drop training pairs where one side has more than this many times the other's tokens (0 = off)"
    )
    langid: bool = setting(
        False,
        "cleaning: drop training pairs whose source or target py3langid identifies as "
        "another language than data.src_lang / data.tgt_lang (found once per corpus, "
        "kept beside its prepared files)",
    )
    corpora: list[CorpusConfig] = setting(
        factory=list,
        shown_type="list of corpora",
        meaning="train on several corpora mixed: '[{path: DIR, weight: 1}, {path: DIR2, weight: 0.5}]' (keys: "
        "path, hub_id, hub_config, name, weight, train_split, local_splits, src_lang, tgt_lang: corpora "
        "into several target languages train one multilingual model; drop_duplicates, drop_copies, "
        "max_len_ratio, langid: its own cleaning rules); empty = the training split of data.path / "
        "data.hub_id",
    )
    temperature: float = setting(
        1.0,
        "mixing corpora: corpus i makes up a share of each epoch proportional to "
        "(weight_i x pairs_i)^(1/T); 1 = by size, larger flattens toward equal shares",
    )
    subword_sampling: float = setting(
        0.0,
        "subword regularization of training pairs, sampled afresh every "
        "epoch: BPE-dropout probability (bpe) or sampling alpha (unigram); "
        "0 = off (validation and test are never sampled)",
    )
    subword_nbest: int = setting(-1, "unigram sampling: from the n best segmentations (-1 = all, else at least 2)")
    augment_upper: float = setting(
        0.0, "training augmentation: share of pairs upper-cased, both sides, drawn afresh every epoch (0 = off)"
    )
    augment_title: float = setting(0.0, "training augmentation: share of pairs in Title Case, both sides")
    augment_typos: float = setting(0.0, "training augmentation: share of pairs whose source gets typos")
    augment_typo_rate: float = setting(0.1, "training augmentation: share of a noised source's words misspelt")
    augment_nopunct: float = setting(
        0.0, "training augmentation: share of pairs without their final punctuation, both sides"
    )
    augment_merge: float = setting(
        0.0, "training augmentation: share of pairs joined with the next one or two (within data.max_len)"
    )
    vocab_size: int = setting(8000, "SentencePiece pieces (per language unless joint_vocab)")
    tokenizer_type: str = setting("bpe", "bpe | unigram")
    joint_vocab: bool = setting(True, "one vocabulary for both languages (lets the model tie all embeddings)")
    language_tag: str = setting(
        "source",
        "a multilingual model's target-language tag: source (the first source token) | both (also the decoder's "
        "first input, in place of BOS) | decoder (the decoder's first input only)",
    )
    validate_zero_shot: bool = setting(
        False,
        "a multilingual run also validates the directions no corpus trains for which data.path holds text in "
        "both languages (val.de + val.fr), each logged with its off-target rate",
    )
    inline_case: bool = setting(
        False,
        "case as a marker piece after each lower-cased word (Hund -> hund+T, HUND -> hund+U), so that upper and "
        "title case share the words' pieces; undone on output",
    )
    usual_case: bool = setting(
        False,
        "with data.inline_case: the words usually written in Title case (counted in the training text with the "
        "vocabulary; German nouns) carry no marker in Title case, one in lower case: shorter sequences",
    )
    lowercase_source: bool = setting(
        False,
        "with data.inline_case: the source in lower case, a marker after each upper-case word and one at the end "
        "of a sentence all in upper or Title case (not one after each capitalised word): shorter German sources",
    )
    character_coverage: float = setting(1.0, "SentencePiece: share of characters covered by the vocabulary")
    tokenizer_sample: int = setting(
        1_000_000, "SentencePiece trains on a random sample of at most this many sentences (0 = all of them)"
    )
    cache_dir: str = setting("data", "SentencePiece models (spm/) and encoded corpora (cache/, corpus/) go here")

    def validate(self) -> None:
        _require_finite("data", self)
        _positive("data.max_len", self.max_len)
        if not 0.0 <= self.subword_sampling < 1.0:
            raise ConfigError(
                f"data.subword_sampling={self.subword_sampling} must be in [0, 1) (0 = off; "
                "e.g. 0.1 for BPE-dropout, 0.1-0.5 for unigram sampling)"
            )
        if self.subword_nbest != -1 and self.subword_nbest < 2:  # SentencePiece refuses 1 (nothing to sample)
            raise ConfigError(f"data.subword_nbest={self.subword_nbest} must be -1 (all) or at least 2")
        _check_augmentation("data", self)
        if self.usual_case and not self.inline_case:
            raise ConfigError(
                "data.usual_case=true leaves the usual titles out of inline casing: set data.inline_case=true too"
            )
        if self.lowercase_source and not self.inline_case:
            raise ConfigError(
                "data.lowercase_source=true writes the source's case as inline-casing markers and the target "
                "with inline casing: set data.inline_case=true too"
            )
        if self.subword_sampling and any(getattr(self, f"augment_{name}") for name in AUGMENT_SHARES):
            raise ConfigError(
                "data.subword_sampling and data.augment_* do not work together yet; set data.subword_sampling=0 "
                "or the data.augment_* keys to 0"
            )
        if self.max_len_ratio < 0 or 0 < self.max_len_ratio < 1:
            raise ConfigError(f"data.max_len_ratio={self.max_len_ratio} must be 0 (off) or at least 1")
        _positive("data.vocab_size", self.vocab_size)
        _file_name("data.name", self.name)
        if not str(self.cache_dir).strip():  # '' is the working directory: spm/ and corpus/ would land there
            raise ConfigError(
                f"data.cache_dir={self.cache_dir!r} is empty; give a directory (the default is data; "
                "data.cache_dir=. for the working directory)"
            )
        if self.tokenizer_type not in ("bpe", "unigram"):
            raise ConfigError(f"data.tokenizer_type={self.tokenizer_type!r} must be 'bpe' or 'unigram'")
        if self.embedded and (self.path or self.hub_id):
            given = f"data.path={self.path}" if self.path else f"data.hub_id={self.hub_id}"
            raise ConfigError(
                f"{given} is set but data={self.name} is the embedded corpus, which ignores it; for your own "
                f"corpus select the custom preset: make train data=custom {given} "
                f"data.src_lang={self.src_lang} data.tgt_lang={self.tgt_lang}"
            )
        if not (self.path or self.hub_id or self.embedded):
            raise ConfigError(
                f"data config {self.name!r} names no source: set data.path=DIR (local files), "
                "data.hub_id=NAME (HuggingFace hub) or data.embedded=true"
            )
        if self.src_lang == self.tgt_lang:
            raise ConfigError(f"data.src_lang and data.tgt_lang are both {self.src_lang!r}")
        self._validate_corpora()
        _within_limits("data", self)

    def _validate_corpora(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ConfigError(f"data.temperature={self.temperature} must be a positive number (1 = mix by size)")
        names = []
        for i, corpus in enumerate(self.corpora):
            key = f"data.corpora[{i}]"
            if not (corpus.path or corpus.hub_id):
                raise ConfigError(f"{key} names no source: give it a path (local files) or a hub_id")
            if not (math.isfinite(corpus.weight) and corpus.weight > 0):
                raise ConfigError(f"{key}.weight={corpus.weight} must be a positive number")
            if corpus.name is not None:
                _file_name(f"{key}.name", corpus.name)
            src, tgt = corpus.src_lang or self.src_lang, corpus.tgt_lang or self.tgt_lang
            if src == tgt:
                raise ConfigError(f"{key}: src_lang and tgt_lang are both {src!r}")
            ratio = corpus.max_len_ratio
            if ratio is not None and not (math.isfinite(ratio) and (ratio == 0 or ratio >= 1)):
                raise ConfigError(f"{key}.max_len_ratio={ratio} must be 0 (off) or at least 1")
            _check_augmentation(key, corpus)
            names.append(corpus.label(self))
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ConfigError(
                f"data.corpora: two corpora are named {repeated[0]!r}; give each a name "
                f"(data.corpora='[{{path: ..., name: {repeated[0]}_a}}, ...]')"
            )
        if len(self.target_languages()) > 1 and not self.joint_vocab:
            raise ConfigError(
                f"data.corpora translate into {', '.join(self.target_languages())}: a multilingual "
                "model needs one vocabulary for all languages; set data.joint_vocab=true"
            )
        if self.corpora and self.subword_sampling:
            raise ConfigError(
                "data.subword_sampling does not work with data.corpora yet; train a mixture with "
                "data.subword_sampling=0"
            )
        if self.language_tag not in LANGUAGE_TAG_SIDES:
            raise ConfigError(f"data.language_tag={self.language_tag!r} must be one of {', '.join(LANGUAGE_TAG_SIDES)}")
        if self.language_tag != "source" and not self.target_languages():
            raise ConfigError(
                f"data.language_tag={self.language_tag}: the run trains a model into one language "
                f"({self.tgt_lang}), which has no language tag; leave data.language_tag=source"
            )

    def validate_for_training(self) -> None:
        """What a new run (or a resumed one) is refused and a saved config is not: an older checkpoint
        whose config has these still loads to translate."""
        if not 0.98 <= self.character_coverage <= 1.0:  # SentencePiece's own bounds
            raise ConfigError(
                f"data.character_coverage={self.character_coverage} must be in [0.98, 1] (SentencePiece's "
                "range: 1 for alphabets, 0.9995 for Chinese or Japanese)"
            )
        if 0 < self.tokenizer_sample <= 100 or self.tokenizer_sample < 0:
            raise ConfigError(
                f"data.tokenizer_sample={self.tokenizer_sample} must be above 100 sentences "
                "(SentencePiece's minimum), or 0 for every sentence"
            )
        if self.path and not self.corpora and Path(self.path).expanduser().is_file():
            raise ConfigError(
                f"data.path={self.path}: one file can be a training split only, and a run needs a "
                "validation split too (best.pt is chosen on it); point data.path at a directory holding "
                "train.* and validation.* files (data.local_splits names other stems)"
            )
        splits = {"train": self.train_split, "validation": self.valid_split, "test": self.test_split}
        stems = {role: self.split_name(split) for role, split in splits.items()}
        for role in ("validation", "test"):
            if stems[role] == stems["train"] and not self.embedded:
                raise ConfigError(
                    f"data.local_splits: the {role} split reads the training files ({stems['train']}): "
                    f"{'best.pt would be chosen' if role == 'validation' else 'the test would be scored'} "
                    "on training data; give it its own files"
                )
        for owner, table, own in [("data", self.local_splits, self.train_split)] + [
            (f"data.corpora[{i}]", c.local_splits, c.train_split) for i, c in enumerate(self.corpora)
        ]:
            unknown = sorted(set(table) - {*splits.values(), own})
            if unknown:
                raise ConfigError(
                    f"{owner}.local_splits: {', '.join(map(repr, unknown))} is not a split of this run: "
                    f"its keys are the splits {', '.join(dict.fromkeys(splits.values()))} (data.train_split, "
                    "data.valid_split, data.test_split), its values the file stems, e.g. "
                    "'{validation: dev, test: newstest2014}'"
                )
        sources = {}
        for i, corpus in enumerate(self.corpora):
            src, tgt = corpus.src_lang or self.src_lang, corpus.tgt_lang or self.tgt_lang
            where = (
                str(Path(corpus.path).expanduser().resolve()) if corpus.path else f"{corpus.hub_id}/{corpus.hub_config}"
            )
            text = (where, src, tgt, corpus.local_splits.get(corpus.train_split, corpus.train_split))
            if text in sources:
                raise ConfigError(
                    f"data.corpora[{i}] reads the same text as data.corpora[{sources[text]}] "
                    f"({corpus.path or corpus.hub_id}, {src}-{tgt}): every pair would count twice; to "
                    "weigh a corpus more, give it a weight (weight: 2) instead"
                )
            sources[text] = i
        if self.subword_nbest != -1 and self.tokenizer_type != "unigram":  # BPE-dropout ignores it
            raise ConfigError(
                f"data.subword_nbest={self.subword_nbest} applies to unigram sampling only "
                f"(data.tokenizer_type=unigram); BPE-dropout (data.tokenizer_type="
                f"{self.tokenizer_type}) drops merges with probability data.subword_sampling: leave "
                "data.subword_nbest out"
            )
        if self.temperature != 1.0 and len(self.corpora) < 2:  # one share: nothing to flatten
            have = "one corpus in data.corpora" if self.corpora else "no data.corpora (one corpus: data.path)"
            raise ConfigError(
                f"data.temperature={self.temperature} flattens the shares of the corpora listed in "
                f"data.corpora, and there is {have}: nothing to mix; leave data.temperature out"
            )
        identified = [
            (c.src_lang or self.src_lang, c.tgt_lang or self.tgt_lang)
            for c in self.corpora
            if (self.langid if c.langid is None else c.langid)
        ]
        if identified or (self.langid and not self.corpora):  # known before any corpus is read
            from transformer.data.langid import check_known
            from transformer.errors import DataError

            try:
                check_known(lang for pair in identified or [(self.src_lang, self.tgt_lang)] for lang in pair)
            except DataError as error:
                raise ConfigError(str(error)) from None
        trained = self.directions()
        if self.corpora and (self.src_lang, self.tgt_lang) not in trained:
            listed = ", ".join(f"{src}-{tgt}" for src, tgt in trained)
            raise ConfigError(
                f"data.src_lang={self.src_lang} data.tgt_lang={self.tgt_lang}: the direction the test "
                f"at the end scores (and the model's default) is not one data.corpora trains ({listed}); "
                f"set data.src_lang={trained[0][0]} data.tgt_lang={trained[0][1]} or another of them"
            )

    def split_name(self, split: str) -> str:
        return self.local_splits.get(split, split)

    def directions(self) -> list[tuple[str, str]]:
        """The (source, target) language pairs trained on, in the order first listed."""
        pairs = [(c.src_lang or self.src_lang, c.tgt_lang or self.tgt_lang) for c in self.corpora]
        return list(dict.fromkeys(pairs or [(self.src_lang, self.tgt_lang)]))

    def languages(self) -> list[str]:
        """Every language of the directions trained on, in the order first listed."""
        return list(dict.fromkeys(language for pair in self.directions() for language in pair))

    def target_languages(self) -> list[str]:
        """A multilingual model's target languages (each gets a tag): those of the corpora and data.tgt_lang,
        when there is more than one; [] for a model into one language."""
        languages = sorted({tgt for _, tgt in self.directions()} | {self.tgt_lang})
        return languages if len(languages) > 1 else []

    def pivot_routes(self) -> dict[str, tuple[str, list[str]]]:
        """{target: (its one source language, [third languages])} for each target language that one language
        alone is trained into, with the languages that source is trained into and that are not trained into
        the target: the routes trainer.online_backtranslation_side=source makes zero-shot pairs along
        ({"de": ("en", ["cs", "fr"])} for a corpus through English)."""
        trained, languages = set(self.directions()), self.target_languages()
        routes = {}
        for target in languages:
            sources = {src for src, tgt in trained if tgt == target}
            if len(sources) != 1:
                continue
            (source,) = sources
            thirds = [
                third
                for third in languages
                if third not in (source, target) and (source, third) in trained and (third, target) not in trained
            ]
            if thirds:
                routes[target] = (source, thirds)
        return routes


ATTENTION_HEATMAPS = ("mean", "heads", "layers", "off")  # trainer.attention_heatmaps
LOGGERS = ("tensorboard", "jsonl", "mlflow", "wandb")  # trainer.loggers
BACKTRANSLATION_SIDES = ("target", "source")  # trainer.online_backtranslation_side
LOG_LEVELS = ("debug", "info", "warning", "error")  # trainer.log_level


SCHEDULES = ("inverse_sqrt", "cosine", "linear", "constant")


@dataclass
class TrainerConfig:
    """The training loop: trainer=default (these defaults); data presets and recipes set some keys.
    0 disables a limit or a feature where noted."""

    device: str = setting("auto", "auto | cpu | cuda | cuda:N  (auto = cuda when available)")
    precision: str = setting(
        "auto",
        "auto | bf16 | fp16 | fp32. auto = bf16 on a GPU that supports it (else "
        "fp16) and on CPUs with native bf16 (AVX512-BF16/AMX); fp32 on other CPUs. "
        "Parameters and optimizer state stay fp32 in every mode",
    )
    max_tokens: int = setting(4096, "token budget per batch: sentences x max(padded source, padded target length)")
    max_tokens_auto: bool = setting(
        False,
        "on CUDA, replace trainer.max_tokens at a new run's start by the largest budget whose longest batch "
        "(data.max_len sentences) fits in the GPU's memory with 10% left free (searched from trainer.max_tokens "
        "by doubling and bisecting, logged, kept by a resumed run); ignored with a warning on a CPU",
    )
    update_freq: int = setting(1, "gradient accumulation: batches per optimizer step")
    lr: float = setting(7e-4, "peak learning rate, reached at the end of warm-up")
    schedule: str = setting(
        "inverse_sqrt", "after warm-up: inverse_sqrt (lr ~ 1/sqrt(step)) | cosine | linear | constant"
    )
    warmup: int = setting(4000, "linear warm-up steps (every schedule)")
    min_lr: float = setting(0.0, "where cosine and linear end at max_steps")
    betas: list[float] = setting(factory=lambda: [0.9, 0.98], meaning="Adam betas")
    adam_eps: float = setting(1e-9, "Adam epsilon")
    weight_decay: float = setting(0.0, "decoupled (AdamW) weight decay")
    weight_decay_norm_bias: bool = setting(
        True,
        "weight decay on LayerNorm gains and biases too (fairseq's way); false: on weight matrices and embeddings only",
    )
    clip_norm: float = setting(1.0, "clip the gradient norm to this; 0 = no clipping")
    label_smoothing: float = setting(0.1, "label smoothing of the loss, in [0, 1)")
    rdrop: float = setting(
        0.0,
        "R-Drop (Liang et al. 2021): every batch runs twice under different dropout; "
        "the loss is the paper's CE1 + CE2 + rdrop x (KL(p||q) + KL(q||p)) / 2 per "
        "token pair (rdrop = its alpha, 5 in its translation runs), divided by 2. "
        "Twice the compute per step; recipe=multi30k_long uses 2 with dropout 0.2; 0 = off",
    )
    online_backtranslation: float = setting(
        0.0,
        "a multilingual model: share of each batch's pairs whose source is replaced by the model's own greedy "
        "translation of the target into another of its languages (random online backtranslation, Zhang et "
        "al. 2020: zero-shot directions learn from real targets); 0 = off",
    )
    online_backtranslation_from: int = setting(0, "the step trainer.online_backtranslation starts at")
    online_backtranslation_until: int = setting(
        0, "the step trainer.online_backtranslation stops at (0 = the end of the run): its generation is slow"
    )
    online_backtranslation_side: str = setting(
        "target",
        "what trainer.online_backtranslation translates: target = the pair's target, into any other language "
        "(Zhang et al. 2020; a zero-shot pair's source is the model's own zero-shot output); source = the "
        "pair's source, where one language alone is trained into the target (English, in a corpus through "
        "English), into a third language along a trained direction, so that every synthetic pair is a "
        "zero-shot direction with a source from a trained one",
    )
    max_steps: int = setting(100000, "stop after this many optimizer steps (0 = no limit)")
    max_epochs: int = setting(0, "stop after this many epochs (0 = no limit)")
    max_minutes: float = setting(0.0, "stop after this much wall-clock time, validation included (0 = no limit)")
    validate_every: int = setting(1000, "steps between validations (loss, BLEU, samples, best.pt)")
    checkpoint_every: int = setting(0, "steps between step_N.pt/last.pt; 0 = validate_every")
    val_beam_size: int = setting(1, "beam for validation BLEU (1 = greedy, fastest); the test uses decode.beam_size")
    val_max_sentences: int = setting(0, "decode only the first N validation sentences (0 = all)")
    select_zero_shot: bool = setting(
        False,
        "with data.validate_zero_shot: the zero-shot directions count in the mean BLEU that picks best.pt and "
        "drives trainer.patience (else they are logged only)",
    )
    val_augment: list[str] = setting(
        factory=list,
        meaning="noised copies of the validation sentences also decoded and scored at each validation, logged as "
        "bleu_<variant> (e.g. [upper,title,typos]; the variants of transformer-evaluate --augment)",
    )
    test_at_end: bool = setting(True, "translate the test split with the best checkpoint at the end; print BLEU")
    attention_heatmaps: str = setting(
        "mean",
        "TensorBoard's cross-attention pictures: mean (the last decoder "
        "layer, mean over heads) | heads (also each head of the last "
        "layer) | layers (also each layer, mean over heads) | off "
        "(none: drawing takes about a second per validation on a CPU)",
    )
    keep_last: int = setting(3, "step_N.pt files kept (0 = keep all)")
    full_checkpoints: bool = setting(
        False,
        "best.pt and step_N.pt hold the training state too (optimizer, schedule, "
        "scaler, random streams, data position, EMA), so that each can resume the "
        "run; false: the weights only (a third of last.pt, a quarter with an EMA), last.pt holds everything",
    )
    ema_decay: float = setting(
        0.0,
        "exponential moving average of the weights after every update (e.g. "
        "0.999; 0 = off); validation scores it too, best.pt keeps the best set. "
        "The decay warms up (trainer.ema_warmup): by default it reaches 0.998 at "
        "step 4,490 and 0.999 at 8,990, so a shorter run is the same with either",
    )
    ema_warmup: float = setting(
        10.0,
        "W of the EMA decay's warm-up min(D, (1+t)/(W+t)): until step "
        "(W*D-1)/(1-D) the EMA averages about the last t/(W-1) updates; a "
        "smaller W averages longer (must be above 1)",
    )
    average_last: int = setting(
        0,
        "at the end, average the last N step_N.pt (see checkpoint_every, keep_last; 0 = off); validation scores it too",
    )
    patience: int = setting(0, "stop after this many validations without a BLEU improvement (0 = never)")
    max_bad_steps: int = setting(20, "stop after this many consecutive non-finite steps (x10 under fp16)")
    compile: bool = setting(
        False,
        "torch.compile each encoder and decoder layer (regional compilation; the first "
        "steps of each batch shape class wait for the compiler; for GPUs: on a 2-core CPU it "
        "trained 45% slower than eager)",
    )
    seed: int = setting(1, "seeds parameters, dropout and the batch order")
    resume: Any = setting(
        False, "true = newest checkpoint in the run dir; or a checkpoint path", shown_type="bool | str"
    )
    init_from: str | None = setting(
        None, "fine-tune: this checkpoint's weights and tokenizer; fresh optimizer and step"
    )
    overwrite: bool = setting(False, "allow starting over in a run dir that already holds checkpoints")
    log_every: int = setting(50, "steps between train.log lines / TensorBoard points")
    log_level: str | None = setting(
        None,
        "debug | info | warning | error: the package's log on the console and in train.log; warning and error "
        "also hide the progress bars (transformer-train --quiet = warning); null = the level Hydra's "
        "job_logging gives (info; hydra.job_logging.root.level=WARNING changes it)",
    )
    loggers: list[str] = setting(
        factory=lambda: ["tensorboard"],
        meaning="where the run's numbers go (rank 0), any of: tensorboard (RUN/tb) | jsonl (RUN/metrics.jsonl, "
        "one JSON object a line) | mlflow (MLFLOW_TRACKING_URI, else sqlite:///RUN/mlflow.db; pip install "
        "mlflow-skinny sqlalchemy alembic) | wandb (RUN/wandb; offline without an API key; pip install wandb)",
    )
    num_threads: int = setting(0, "torch CPU threads (0 = PyTorch's default)")
    num_workers: int | None = setting(
        None, "DataLoader processes collating the next batches (null = 2 on CUDA, 0 on CPU)"
    )

    def validate(self) -> None:
        _require_finite("trainer", self)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"trainer.device={self.device!r} must be auto, cpu, cuda or cuda:N")
        if self.precision not in ("auto", "bf16", "fp16", "fp32"):
            raise ConfigError(f"trainer.precision={self.precision!r} must be auto, bf16, fp16 or fp32")
        for key in ("max_tokens", "update_freq", "validate_every", "log_every"):
            _positive(f"trainer.{key}", getattr(self, key))
        if self.lr <= 0:
            raise ConfigError(f"trainer.lr={self.lr} must be > 0 (e.g. trainer.lr=7e-4)")
        if not 0.0 <= self.online_backtranslation <= 1.0:
            raise ConfigError(
                f"trainer.online_backtranslation={self.online_backtranslation} must be a share of pairs in [0, 1] "
                "(0 = off; e.g. 0.25)"
            )
        if self.online_backtranslation_side not in BACKTRANSLATION_SIDES:
            raise ConfigError(
                f"trainer.online_backtranslation_side={self.online_backtranslation_side!r} must be one of "
                f"{', '.join(BACKTRANSLATION_SIDES)}"
            )
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"trainer.schedule={self.schedule!r} must be one of {', '.join(SCHEDULES)}")
        if self.attention_heatmaps not in ATTENTION_HEATMAPS:
            raise ConfigError(
                f"trainer.attention_heatmaps={self.attention_heatmaps!r} must be one of {', '.join(ATTENTION_HEATMAPS)}"
            )
        if self.log_level is not None and self.log_level not in LOG_LEVELS:
            raise ConfigError(
                f"trainer.log_level={self.log_level!r} must be one of {', '.join(LOG_LEVELS)} (or null: Hydra's level)"
            )
        if self.val_augment:
            from transformer.data.augment import variant_names  # no torch: a module of plain text functions

            try:
                variant_names(",".join(map(str, self.val_augment)))
            except ValueError as error:
                raise ConfigError(f"trainer.val_augment={list(self.val_augment)}: {error}") from None
        unknown = [name for name in self.loggers if name not in LOGGERS]
        if unknown or len(set(self.loggers)) != len(self.loggers):
            raise ConfigError(
                f"trainer.loggers={list(self.loggers)}: each of {', '.join(LOGGERS)} at most once "
                f"(e.g. trainer.loggers=[tensorboard,jsonl])"
            )
        if not 0.0 <= self.min_lr <= self.lr:
            raise ConfigError(f"trainer.min_lr={self.min_lr} must be in [0, trainer.lr={self.lr}]")
        if self.schedule in ("cosine", "linear") and self.max_steps <= self.warmup:
            raise ConfigError(
                f"trainer.schedule={self.schedule} decays from trainer.warmup={self.warmup} to trainer.max_steps="
                f"{self.max_steps}: set trainer.max_steps above the warm-up (it fixes where the decay ends)"
            )
        for key in (
            "warmup",
            "max_steps",
            "max_epochs",
            "keep_last",
            "patience",
            "checkpoint_every",
            "val_max_sentences",
            "num_threads",
            "weight_decay",
            "clip_norm",
            "max_minutes",
            "online_backtranslation_from",
            "online_backtranslation_until",
        ):
            if getattr(self, key) < 0:
                raise ConfigError(f"trainer.{key}={getattr(self, key)} must be >= 0 (0 disables it)")
        if 0 < self.online_backtranslation_until <= self.online_backtranslation_from:
            raise ConfigError(
                f"trainer.online_backtranslation_until={self.online_backtranslation_until} must come after "
                f"trainer.online_backtranslation_from={self.online_backtranslation_from} (or be 0: to the end)"
            )
        if self.num_workers is not None and self.num_workers < 0:
            raise ConfigError(f"trainer.num_workers={self.num_workers} must be >= 0 (or null: 2 on CUDA, 0 on a CPU)")
        _within_limits("trainer", self)
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"trainer.ema_decay={self.ema_decay} must be in [0, 1) (0 = no EMA; e.g. 0.999)")
        if not self.ema_warmup > 1.0:
            raise ConfigError(f"trainer.ema_warmup={self.ema_warmup} must be above 1 (the default is 10)")
        if self.average_last == 1 or self.average_last < 0:
            raise ConfigError(f"trainer.average_last={self.average_last} must be 0 (off) or at least 2")
        if self.average_last and self.keep_last and self.keep_last < self.average_last:
            raise ConfigError(
                f"trainer.average_last={self.average_last} needs that many step_N.pt files: set "
                f"trainer.keep_last={self.average_last} (now {self.keep_last})"
            )
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"trainer.label_smoothing={self.label_smoothing} must be in [0, 1)")
        if self.rdrop < 0:
            raise ConfigError(f"trainer.rdrop={self.rdrop} must be >= 0 (0 = off; the R-Drop paper uses 5)")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"trainer.betas={self.betas} must be two numbers in [0, 1)")
        _positive("trainer.val_beam_size", self.val_beam_size)
        _positive("trainer.max_bad_steps", self.max_bad_steps)
        if not (self.max_steps or self.max_epochs or self.max_minutes):
            raise ConfigError("no stopping rule: set trainer.max_steps, trainer.max_epochs or trainer.max_minutes")
        if not isinstance(self.resume, (bool, str)):
            raise ConfigError(f"trainer.resume={self.resume!r} must be true, false or a checkpoint path")
        if not self.adam_eps > 0:  # 0 divides by a zero second moment; a negative one flips the update
            raise ConfigError(f"trainer.adam_eps={self.adam_eps} must be > 0 (the default is 1e-9)")

    def validate_for_training(self) -> None:
        """What this machine can run, checked when a run starts (not for a saved config, which may come
        from a larger machine): processes and threads beyond a few per core only compete for the cores."""
        cpus = available_cpus()
        for key, what in (("num_workers", "DataLoader processes"), ("num_threads", "torch CPU threads")):
            value = getattr(self, key)
            if value is not None and value > 4 * cpus:
                raise ConfigError(
                    f"trainer.{key}={value} must be from 0 to {4 * cpus} on this machine: {what}, at most 4 per "
                    f"CPU core ({cpus} here)"
                )


# The most tokens of one batch, training (trainer.max_tokens) or decoding (decode.batch_tokens): 2**24
# tokens' activations outgrow a GPU's memory even for model=tiny (128 floats a token, a dozen tensors of them).
MAX_BATCH_TOKENS = 2**24
# The longest sequence (model.max_positions), for training and for every stored config a model is built from:
# 64 times the default, far over any sentence translated. The sinusoidal table is the one part of a model no
# stored weight records (65536 x d_model 1024 floats: 256 MiB), and attention over 65536 positions costs
# 2**32 scores a head.
MAX_POSITIONS = 65536
# The widest beam (decode.beam_size, decode.nbest, trainer.val_beam_size): beyond a few hundred a wider one
# finds no better translation, and every hypothesis is one more row of the decoder's batch.
MAX_BEAM = 1000


# Source tokens x beam per decoding batch. How much to decode at once depends on the machine, not the
# model, so `transformer-translate` uses this rather than the value saved in an older checkpoint.
DEFAULT_BATCH_TOKENS = 16384


def decode_setting(
    default: int | float, meaning: str, *, low: int, high: float = math.inf, flag: str | None = None, saved: bool = True
) -> Any:
    """A decoding option: a DecodeConfig key (decode.KEY), the keyword KEY of `Translator.translate` and a
    flag of transformer-translate and transformer-evaluate (`flag`, else --KEY with dashes), all three from
    this one definition (`DECODE_OPTIONS`). `low`, `high`: the values allowed. `saved`: a translation that
    leaves it out takes the checkpoint's decode.KEY (True) or this default (False: a property of the
    request or the machine, not the model)."""
    return setting(default, meaning, low=low, high=high, flag=flag, saved=saved)


@dataclass
class DecodeConfig:
    """Decoding: decode=beam (these defaults) and decode=greedy, for the end-of-training test, make
    evaluate, and transformer-translate's defaults (taken from the checkpoint's config)."""

    name: str = setting("beam", "the preset's name")
    beam_size: int = decode_setting(5, "hypotheses kept per sentence (1 = greedy)", low=1, high=MAX_BEAM, flag="--beam")
    alpha: float = decode_setting(
        0.6, "GNMT length penalty ((5 + len) / 6) ** alpha; 0 = raw log-probability", low=0, high=100
    )  # beyond, the penalty of a long hypothesis overflows
    alpha_by_language: dict[str, float] = setting(
        factory=dict,
        meaning="a multilingual model's length penalty per target language, in place of "
        "decode.alpha ({en: 2.5, de: 1.5}); a language left out takes decode.alpha; an alpha "
        "given to a translation (--alpha) wins over both",
    )
    max_len_a: float = decode_setting(1.2, "output length limit: max_len_a * source_len + max_len_b tokens", low=0)
    # (an output is cut at model.max_positions - 1 tokens: a larger constant is no limit)
    max_len_b: int = decode_setting(
        10, "the constant term of the output length limit (see max_len_a)", low=0, high=MAX_POSITIONS
    )
    batch_tokens: int = decode_setting(
        DEFAULT_BATCH_TOKENS,
        "source tokens x beam per decoding batch; smaller needs less memory",
        low=1,
        high=MAX_BATCH_TOKENS,
        saved=False,
    )
    nbest: int = decode_setting(1, "hypotheses returned per sentence (<= beam_size)", low=1, high=MAX_BEAM, saved=False)

    def validate(self) -> None:
        # Non-finite values first get the message every section's float keys give (with the default).
        _require_finite("decode", self)
        check_decode_options({option.key: getattr(self, option.key) for option in DECODE_OPTIONS}, "config")
        alpha = next(option for option in DECODE_OPTIONS if option.key == "alpha")
        for language, value in self.alpha_by_language.items():
            if not alpha.accepts(value):
                raise ConfigError(f"decode.alpha_by_language.{language}={value!r}: {alpha.rule}")

    def alpha_for(self, language: str | None) -> float:
        """The length penalty of translations into `language` (None: a bilingual model's)."""
        return self.alpha_by_language.get(language, self.alpha) if language else self.alpha

    def for_translation(self, **given: Any) -> DecodeConfig:
        """The options a translation with this (a checkpoint's) decode section uses: those `given` (None: left
        out), else this section's value or the schema's default (see `decode_setting`'s `saved`); checked
        as the Python API's keywords (ValueError naming the keyword)."""
        chosen = {
            option.key: given[option.key]
            if given.get(option.key) is not None
            else getattr(self, option.key)
            if option.saved
            else option.default
            for option in DECODE_OPTIONS
        }
        check_decode_options(chosen, "api")
        return dataclasses.replace(self, **chosen)


class DecodeOption(NamedTuple):
    """One decoding option, as `decode_setting` defines it on DecodeConfig."""

    key: str  # decode.KEY in the config, KEY= in the Python API
    flag: str  # the command lines' flag: --beam
    whole: bool  # a whole number (int), or a finite number (float)
    default: int | float
    low: int  # the smallest value allowed
    high: float  # the largest
    saved: bool  # left out of a translation: the checkpoint's decode.KEY, else `default`
    meaning: str

    @property
    def rule(self) -> str:
        if not math.isfinite(self.high):
            upper = ""
        else:  # a whole number in full (16777216, not 1.67772e+07)
            upper = f" and <= {int(self.high)}" if self.whole else f" and <= {self.high:g}"
        return f"must be a {'whole' if self.whole else 'finite'} number >= {self.low}{upper}"

    def accepts(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral if self.whole else numbers.Real):
            return False
        finite = isinstance(value, numbers.Integral) or math.isfinite(value)  # a huge int has no float
        return finite and self.low <= value <= self.high

    def spelled(self, value: Any, where: str) -> str:
        """The option and its value as `where` writes them: decode.alpha=nan ("config"), alpha=nan ("api"),
        --alpha nan ("cli")."""
        return {
            "config": f"decode.{self.key}={value!r}",
            "api": f"{self.key}={value!r}",
            "cli": f"{self.flag} {value!r}",
        }[where]


DECODE_OPTIONS = tuple(
    DecodeOption(
        spec.name,
        spec.metadata["flag"] or "--" + spec.name.replace("_", "-"),
        spec.type in ("int", int),
        spec.default,
        spec.metadata["low"],
        spec.metadata["high"],
        spec.metadata["saved"],
        spec.metadata["help"],
    )
    for spec in dataclasses.fields(DecodeConfig)
    if "low" in spec.metadata
)


def check_decode_options(values: dict[str, Any], where: str) -> None:
    """The one check of the decoding options, for the config (`where` "config": ConfigError naming
    decode.KEY), the Python API ("api": ValueError naming the keyword) and the command lines ("cli":
    ValueError naming the flag): each of `values` (KEY -> value; options left out are not checked) by its
    rule, then nbest against beam_size. One line: the option, its value and what it must be."""
    error = ConfigError if where == "config" else ValueError
    options = {option.key: option for option in DECODE_OPTIONS}
    for key, value in values.items():
        if not options[key].accepts(value):
            raise error(f"{options[key].spelled(value, where)}: {options[key].rule}")
    if "nbest" in values and "beam_size" in values and values["nbest"] > values["beam_size"]:
        raise error(
            f"{options['nbest'].spelled(values['nbest'], where)}: must be between 1 and the beam size "
            f"({options['beam_size'].spelled(values['beam_size'], where)})"
        )


# What the inference side checks before it loads anything (translator.py, and the command lines before
# they load torch): --quantize's values, and an ensemble's weights.
QUANTIZATIONS = ("int8",)


def device_name_error(device, knob: str = "device=") -> str | None:
    """Why `device` is no device name inference takes (auto, cpu, cuda, cuda:N), in one line naming it
    as `knob` does ("--device " or "device="); None for a good name. `runtime.inference_device_error`
    also asks whether this machine has it."""
    if isinstance(device, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        return None
    return f"{as_given(knob, device)}: must be auto, cpu, cuda or cuda:N"


def as_given(knob: str, value) -> str:
    """A setting as its user wrote it: `--device cuda` on a command line, `device='cuda'` in Python."""
    return f"{knob}{value!r}" if knob.endswith("=") else f"{knob}{value}"


def check_weights(weights, count: int) -> list[float]:
    """An ensemble's weights: one finite number >= 0 per model, not all 0."""
    if isinstance(weights, (str, bytes)):
        raise ValueError(f"weights={weights!r}: give a list of numbers, one per model (e.g. [1, 2])")
    weights = list(weights)
    if (
        len(weights) != count
        or not all(
            isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w) and w >= 0 for w in weights
        )
        or not sum(weights) > 0
    ):
        raise ValueError(f"weights={weights!r}: give one finite weight >= 0 per model ({count}), not all 0")
    return [float(w) for w in weights]


def normalised_weights(weights: list[float]) -> list[float]:
    """Finite weights >= 0, not all 0, scaled to sum to 1 without overflow: divided by the largest first,
    so that 1e308,1e308 is 0.5,0.5 (their sum is infinite) and 1e-320,1e-320 is too."""
    top = max(weights)
    scaled = [w / top for w in weights]
    total = sum(scaled)  # in [1, len(weights)]
    return [w / total for w in scaled]


@dataclass
class Config:
    """Top level: run_dir, and the sections model, data, trainer, decode."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    run_dir: str | None = setting(
        None, "checkpoints, TensorBoard events, train.log; null = hydra.run.dir (runs/DATA/MODEL/DATE_TIME)"
    )

    @classmethod
    def from_dict(cls, raw: dict, saved: bool = False) -> Config:
        """Build and validate from a plain dict (`OmegaConf.to_container(cfg, resolve=True)`, a checkpoint's
        saved config): the schema checks keys and types (keys missing from an older checkpoint take their
        defaults), `validate` the values; a config to train with (not `saved`) also
        `validate_for_training`."""
        from omegaconf import OmegaConf
        from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

        raw = {k: v for k, v in raw.items() if k != "hydra"}
        if saved:
            refuse_interpolations(raw)
        try:
            config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), raw))
        except ConfigKeyError as error:
            section = error.full_key.rpartition(".")[0]
            if "corpora[" in section:
                known = [f.name for f in dataclasses.fields(CorpusConfig)]
            else:
                known = (
                    [f.name for f in dataclasses.fields(cls)]
                    if not section
                    else [f.name for f in dataclasses.fields(type(getattr(cls(), section)))]
                )
            if saved:  # a checkpoint's or an export's: a key a later version of the package added
                raise ConfigError(
                    f"unknown config key {error.full_key}: the model was saved by a newer version of "
                    f"this package; to load it, upgrade this package: {upgrade_hint()}"
                ) from None
            raise ConfigError(f"unknown config key {error.full_key}; known keys: {', '.join(sorted(known))}") from None
        except OmegaConfBaseException as error:
            raise ConfigError(composition_error_line(error)) from None
        config.validate()
        if not saved:
            config.validate_for_training()
        return config

    def validate(self) -> None:
        self.model.validate()
        self.data.validate()
        self.trainer.validate()
        self.decode.validate()
        targets = self.data.target_languages()
        unknown = sorted(set(self.decode.alpha_by_language) - set(targets))
        if unknown and not targets:
            raise ConfigError(
                f"decode.alpha_by_language: this model translates into {self.data.tgt_lang} only; "
                "set its length penalty with decode.alpha"
            )
        if unknown:
            raise ConfigError(
                f"decode.alpha_by_language: {', '.join(unknown)} is not a target language of this "
                f"model; it translates into {', '.join(targets)}"
            )
        if self.trainer.online_backtranslation and not targets:
            raise ConfigError(
                f"trainer.online_backtranslation={self.trainer.online_backtranslation}: the run trains a model into "
                f"one language ({self.data.tgt_lang}), with no other language to translate its targets into; "
                "leave it at 0"
            )
        if (
            self.trainer.online_backtranslation
            and self.trainer.online_backtranslation_side == "source"
            and not self.data.pivot_routes()
        ):
            raise ConfigError(
                "trainer.online_backtranslation_side=source: no target language of this run is trained from one "
                "language alone that is also trained into a third ("
                + ", ".join(f"{src}-{tgt}" for src, tgt in self.data.directions())
                + "), so no pair's source can be translated into a zero-shot direction; use "
                "trainer.online_backtranslation_side=target"
            )
        # A training pair of data.max_len tokens takes one position more: the source its EOS, the
        # target input its BOS. (Decoding caps its output at model.max_positions - 1 tokens itself.)
        if self.model.max_positions < self.data.max_len + 1:
            raise ConfigError(
                f"model.max_positions={self.model.max_positions} is too small for data.max_len={self.data.max_len}: "
                f"a sentence of {self.data.max_len} tokens and its EOS (source) or BOS (target) take "
                f"{self.data.max_len + 1} positions; set model.max_positions={self.data.max_len + 1} or more, or "
                f"data.max_len={self.model.max_positions - 1} or less"
            )

    def validate_for_training(self) -> None:
        """What a run checks more than a saved config (`DataConfig.validate_for_training`,
        `TrainerConfig.validate_for_training`)."""
        self.data.validate_for_training()
        self.trainer.validate_for_training()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _require_finite(section: str, values) -> None:
    """Every float key of a config section (lists of floats too) holds a finite number: nan and inf
    pass comparisons such as `lr <= 0` unnoticed, then train nothing or make every weight non-finite."""
    for spec in dataclasses.fields(values):
        if "float" not in str(spec.type):
            continue
        value = getattr(values, spec.name)
        named = (
            [(f"{spec.name}.{key}", number) for key, number in value.items()]
            if isinstance(value, dict)
            else [(spec.name, number) for number in (value if isinstance(value, (list, tuple)) else [value])]
        )
        for name, number in named:
            if isinstance(number, float) and not math.isfinite(number):
                if isinstance(value, dict):  # one entry of a mapping: no default to point to
                    raise ConfigError(f"{section}.{name}={number} is not finite; give a finite number")
                default = spec.default if spec.default is not dataclasses.MISSING else spec.default_factory()
                raise ConfigError(
                    f"{section}.{name}={value} is not finite; give a finite number (the default is {default})"
                )


INT64_MAX = 2**63 - 1  # torch and numpy take no larger integer (an OverflowError, far from the setting)

# The range of each count and size key (issue 71): a value beyond these cannot be what was meant, and would
# exhaust the machine before the first step (memory, or a loop of hours) or overflow an int64 later.
# (low, high, why); every other int key of the schema is held to an int64 (`_within_limits`).
LIMITS = {
    "model.d_model": (1, 2**16, "one attention projection of 2**16 x 2**16 weights is 16 GiB"),
    "model.n_heads": (1, 2**16, "it divides model.d_model"),
    "model.d_ff": (1, 2**18, "big models use 4 x d_model, 4,096 to 16,384"),
    "model.encoder_layers": (1, 1000, "deep Transformers have 6 to 48 layers, each built before the first step"),
    "model.decoder_layers": (1, 1000, "deep Transformers have 6 to 48 layers, each built before the first step"),
    "model.max_positions": (1, MAX_POSITIONS, "attention over a sequence costs its length squared; 1,024 is common"),
    "data.max_len": (1, MAX_POSITIONS - 1, "a sentence and its EOS fit model.max_positions, at most 65,536"),
    "data.vocab_size": (1, 2**20, "the largest multilingual vocabularies hold 250,000 pieces"),
    "data.embedded_pairs": (1, 10**7, "the generated toy corpus: 10 million pairs take minutes and gigabytes"),
    "data.subword_nbest": (-1, 1000, "SentencePiece searches that many segmentations for every sentence"),
    "trainer.max_tokens": (1, MAX_BATCH_TOKENS, "2**24 tokens' activations outgrow a GPU's memory"),
    "trainer.update_freq": (1, 10**4, "an update collates its batches at once; big-batch recipes use 16 to 128"),
    "trainer.val_beam_size": (1, MAX_BEAM, "a wider beam finds no better translation"),
    "trainer.seed": (0, INT64_MAX, "torch's and numpy's generators take no negative seed"),
    # and at most 4 per CPU core of the machine that trains (`TrainerConfig.validate_for_training`)
    "trainer.num_workers": (0, 4096, "DataLoader processes"),
    "trainer.num_threads": (0, 4096, "torch CPU threads"),
}


def available_cpus() -> int:
    """The CPU cores this process may run on (its affinity: a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _spelled(number: int) -> str:
    return "2**63 - 1" if number == INT64_MAX else str(number)


def _within_limits(section: str, values) -> None:
    """Every int key of a config section within its range: `LIMITS`', else an int64's (None passes)."""
    for spec in dataclasses.fields(values):
        value = getattr(values, spec.name)
        if "int" not in str(spec.type) or not isinstance(value, int) or isinstance(value, bool):
            continue
        key = f"{section}.{spec.name}"
        low, high, why = LIMITS.get(key, (-INT64_MAX - 1, INT64_MAX, "a 64-bit integer"))
        if not low <= value <= high:
            if key not in LIMITS:
                raise ConfigError(f"{key}={value} is beyond a 64-bit integer: give at most 2**63 - 1")
            raise ConfigError(f"{key}={value} must be from {low} to {_spelled(high)} ({why})")


def _positive(key: str, value: int | float) -> None:
    if value <= 0:
        raise ConfigError(f"{key}={value} must be > 0")


def composition_error_line(error: BaseException) -> str:
    """One line from a Hydra composition error or an OmegaConf error: the message with its full key."""
    cause = error.__cause__ or error
    key = getattr(cause, "full_key", None)
    message = str(getattr(cause, "msg", None) or cause).splitlines()[0]
    head = str(error).splitlines()[0]
    if key and key not in message:
        message = f"{key}: {message}"
    line = message if cause is error else f"{head}: {message}"
    # A preset that is not there: Hydra lists the group's options on the lines below, one a line.
    listed = re.search(r"\n(Available options in '[^']+'):\n((?:\t.*\n)+)", str(error))
    if listed:
        line += (
            f"; {listed[1][0].lower()}{listed[1][1:]}: {', '.join(listed[2].split())} (presets of your own: "
            "--config-dir DIR, with DIR/GROUP/NAME.yaml)"
        )
    if "Cannot merge DictConfig with ListConfig" in line and "corpora" in str(error):
        line += "; data.corpora is a list, one {...} per corpus: data.corpora='[{path: DIR, weight: 2}]'"
    if "not in 'CorpusConfig'" in line:
        line += f"; a corpus of data.corpora takes {', '.join(f.name for f in dataclasses.fields(CorpusConfig))}"
    unknown = re.search(r"Key '([^']+)' not in '(ModelConfig|DataConfig|TrainerConfig|DecodeConfig)'", line)
    if unknown:  # a misspelt key: the nearest one of its section (Hydra suggests '+KEY', which fails)
        section = {
            "ModelConfig": ("model", ModelConfig),
            "DataConfig": ("data", DataConfig),
            "TrainerConfig": ("trainer", TrainerConfig),
            "DecodeConfig": ("decode", DecodeConfig),
        }[unknown[2]]
        names = [f.name for f in dataclasses.fields(section[1])]
        near = difflib.get_close_matches(unknown[1], names, n=1, cutoff=0.6)
        line += (
            f"; did you mean {section[0]}.{near[0]}?"
            if near
            else f"; `transformer-train --help` lists the {section[0]} keys"
        )
    return line


def refuse_interpolations(saved: dict, prefix: str = "") -> None:
    """A saved config (a checkpoint's, an export's config.json) holds plain values: a run resolves every
    interpolation before it saves one. One that holds `${...}` was written or edited by hand, and resolving
    it would run OmegaConf's resolvers on the file's say (`${oc.env:TOKEN}` copies an environment
    variable into what is exported): refused with a ConfigError naming the key."""
    for key, value in saved.items() if isinstance(saved, dict) else ():
        name = f"{prefix}{key}"
        values = value if isinstance(value, list) else [value]
        for item in values:
            if isinstance(item, dict):
                refuse_interpolations(item, f"{name}.")
            elif isinstance(item, str) and "${" in item:
                raise ConfigError(
                    f"{name}={item!r}: a saved config holds plain values, not interpolations (a run resolves "
                    "them before it saves); this one was written by hand and is not resolved: remove it"
                )
