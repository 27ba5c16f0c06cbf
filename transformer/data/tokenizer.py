"""SentencePiece vocabularies: trained once per corpus and settings, cached under `data/spm/`.

The special ids come from special.py, which this module trains into every model. A `Tokenizer` holds
the source and target models (the same one for a joint vocabulary) and serialises to bytes that travel
inside every checkpoint.
"""

from __future__ import annotations

import functools
import hashlib
import io
import itertools
import json
import logging
import os
import re
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

from transformer.console import bars_disabled
from transformer.data import augment, casing
from transformer.data.cache import bytes_record, check_bytes, read_cached_bytes, read_record, sealed, write_failure
from transformer.errors import CacheDamage, DataError
from transformer.special import BOS_ID, EOS_ID, PAD_ID, UNK_ID  # noqa: F401 (also imported from here)

if TYPE_CHECKING:  # the corpus readers: only for the annotation, not loaded by translating
    from transformer.data.sources import SplitSource

USUAL_CASE_LINES = 2_000_000  # lines (of both sides) that data.usual_case's table is counted from
CACHE_VERSION = 2  # 2: each cached model's size and CRC-32 recorded beside it
# A multilingual model's target-language tag: a piece of its own in SentencePiece (a user-defined
# symbol, never split), put at the start of every source sentence.
LANGUAGE_TAG = "<2{}>"
_TAG_PATTERN = re.compile(r"<2([^<>\s]+)>")

log = logging.getLogger(__name__)


# `<` and the characters NFKC folds into it (full-width, small form): where a written tag may hide.
ANGLE_FORMS = ("<", "\uff1c", "\ufe64")


class Tokenizer:
    def __init__(self, src_model: bytes, tgt_model: bytes | None = None, titles: bytes | None = None):
        """`titles`: inline casing's table of usual titles (data.usual_case), one lower-case word a line."""
        self.src_model_bytes = src_model
        self.tgt_model_bytes = tgt_model if tgt_model is not None else src_model
        self.joint = tgt_model is None or tgt_model == src_model
        self.src = spm.SentencePieceProcessor(model_proto=self.src_model_bytes)
        self.tgt = self.src if self.joint else spm.SentencePieceProcessor(model_proto=self.tgt_model_bytes)
        # Inline casing (casing.py): a model trained with data.inline_case holds both markers as pieces.
        self.inline_case = all(self.src.piece_to_id(marker) != UNK_ID for marker in casing.MARKERS)
        # ... and one trained with data.lowercase_source the sentence markers too: its sources in lower case.
        # A source ending in one is translated with a case marker after every word (`Search.doubled_by`).
        marker_ids = tuple(self.src.piece_to_id(marker) for marker in casing.SOURCE_MARKERS)
        self.lowercase_source = self.inline_case and UNK_ID not in marker_ids
        self.sentence_marker_ids = marker_ids if self.lowercase_source else ()
        self.titles_bytes = titles or b""
        self.titles = frozenset(self.titles_bytes.decode().split("\n")) - {""}
        if self.titles and any(sp.piece_to_id(casing.LOWER) == UNK_ID for sp in (self.src, self.tgt)):
            raise ValueError("a table of usual titles needs a vocabulary with inline casing's three markers")

    @property
    def src_vocab_size(self) -> int:
        return self.src.get_piece_size()

    @property
    def tgt_vocab_size(self) -> int:
        return self.tgt.get_piece_size()

    @property
    def target_languages(self) -> list[str]:
        """The languages a multilingual model translates into (its `<2xx>` pieces); [] for a bilingual one."""
        if not hasattr(self, "_languages"):
            self._languages = {}
            for i in range(self.src.get_piece_size()):
                match = _TAG_PATTERN.fullmatch(self.src.id_to_piece(i))
                if match:
                    self._languages[match[1]] = i
        return sorted(self._languages)

    @property
    def protected_ids(self) -> int:
        """Ids below this are the special tokens and a multilingual model's language tags (user-defined
        pieces, which SentencePiece numbers right after the special ones): word dropout keeps them all."""
        return 1 + max([EOS_ID, *(self.tag_id(language) for language in self.target_languages)])

    @property
    def tag_ids(self) -> tuple[int, int]:
        """[first, end): the ids of the language tags (user-defined pieces numbered one after another)."""
        ids = sorted(self.tag_id(language) for language in self.target_languages)
        if not ids:
            return (0, 0)
        assert ids == list(range(ids[0], ids[-1] + 1)), "language tags are numbered one after another"
        return (ids[0], ids[-1] + 1)

    def tag_id(self, language: str) -> int:
        """The id of `language`'s tag; ValueError naming the languages there are."""
        if language not in self.target_languages:
            known = ", ".join(self.target_languages) or "none: a bilingual model has no language tags"
            raise ValueError(f"{language!r} is not a target language of this model (it knows {known})")
        return self._languages[language]

    def encode_src(self, lines: Sequence[str], num_threads: int = 1, tgt_lang: str | None = None) -> list[list[int]]:
        """Source ids; with `tgt_lang` (a multilingual model), each starting with that language's tag."""
        ids = self.src.encode(self._as_text(lines, "src"), num_threads=num_threads)
        if tgt_lang is None:
            return ids
        tag = self.tag_id(tgt_lang)
        return [[tag, *sentence] for sentence in ids]

    def encode_tgt(self, lines: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        return self.tgt.encode(self._as_text(lines, "tgt"), num_threads=num_threads)

    def _as_text(self, lines: Sequence[str], side: str) -> list[str]:
        """`lines` of `side` ('src' or 'tgt') as SentencePiece takes them: case written inline when the model
        has inline casing (a source in lower case when it has data.lowercase_source), language tags written
        in the text escaped (`_tags_escaped`)."""
        if side == "src" and self.lowercase_source:  # escaped after: `<2FR>` in lower case is a tag
            return self._tags_escaped([casing.encode_source(line) for line in lines])
        lines = self._tags_escaped(lines)
        return [casing.encode(line, self.titles) for line in lines] if self.inline_case else lines

    def as_model_text(self, line: str, side: str) -> str:
        """One line of `side` as SentencePiece takes it (for callers that run SentencePiece themselves)."""
        return self._as_text([line], side)[0]

    def _tags_escaped(self, lines: Sequence[str]) -> list[str]:
        """`lines`, where a language tag written in the text (`<2de>`) is kept from becoming the tag:
        SentencePiece matches its user-defined pieces in raw text, so a sentence could choose the target
        language. A word joiner after the `<` breaks the match; SentencePiece's normalization drops it.
        A line with a `<` in any form is NFKC-normalised first, as SentencePiece's normalization would do
        anyway, so that a tag spelled in full-width or small forms (`＜２ｆｒ＞`, `﹤2fr﹥`), which that
        normalization folds into `<2fr>`, is escaped too."""
        lines = list(lines)
        if self._written_tag is None:
            return lines
        return [self._escaped(line) if any(form in line for form in ANGLE_FORMS) else line for line in lines]

    def _escaped(self, line: str) -> str:
        line = unicodedata.normalize("NFKC", line)
        return self._written_tag.sub("<\u2060", line) if "<2" in line else line

    @functools.cached_property
    def _written_tag(self) -> re.Pattern | None:
        """A language tag of this model written in text (`<2de>`); None for a bilingual model. Built once:
        `_as_text` runs on every chunk encoded."""
        if not self.target_languages:
            return None
        return re.compile("<(?=2(?:" + "|".join(map(re.escape, self.target_languages)) + ")>)")

    def fingerprint(self) -> str:
        """Identifies the model(s): part of the key of every corpus encoded with them."""
        parts = [self.src_model_bytes, self.tgt_model_bytes] + ([self.titles_bytes] if self.titles_bytes else [])
        return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]

    # Decoding runs on one thread: SentencePiece's pool costs more to start than a batch takes to decode.
    def decode_tgt(self, ids: Sequence[Sequence[int]]) -> list[str]:
        return self._cased(self.tgt.decode([list(x) for x in ids], num_threads=1))

    def decode_src(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """Source text of source ids (without a language tag: the caller strips it); with a lower-case
        source, in the case its markers give (casing.decode_source)."""
        texts = self.src.decode([list(x) for x in ids], num_threads=1)
        return [casing.decode_source(text) for text in texts] if self.lowercase_source else self._cased(texts)

    def target_ids_as_source(self, ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """Target-side ids (a target, or a translation the model wrote; no tag) as the source side writes the
        same text: the ids themselves in a joint vocabulary, except with a lower-case source
        (data.lowercase_source), whose pieces are not the target's inline casing (online back-translation
        turns targets and translations into sources)."""
        if not self.lowercase_source:
            return [list(x) for x in ids]
        return self.encode_src(self.decode_tgt(ids))

    def _cased(self, texts: list[str]) -> list[str]:
        return [casing.decode(text, self.titles) for text in texts] if self.inline_case else texts

    def state_dict(self) -> dict:
        """Plain bytes, loadable with `torch.load(weights_only=True)`."""
        state = {"src": self.src_model_bytes, "tgt": None if self.joint else self.tgt_model_bytes}
        return {**state, "titles": self.titles_bytes} if self.titles_bytes else state

    @classmethod
    def from_state_dict(cls, state: dict) -> Tokenizer:
        tgt, titles = state.get("tgt"), state.get("titles")
        return cls(bytes(state["src"]), None if tgt is None else bytes(tgt), None if titles is None else bytes(titles))


def train_sentencepiece(
    lines: Iterable[str],
    vocab_size: int,
    model_type: str,
    character_coverage: float,
    sample: int,
    where: str = "the training split",
    symbols: Sequence[str] = (),
) -> bytes:
    """Train one SentencePiece model in memory and return its serialised bytes.

    The lines are streamed: SentencePiece keeps a uniform random sample of at most `sample` of them
    (its input_sentence_size / shuffle_input_sentence), so its time and memory do not grow with the
    corpus beyond reading it once. `symbols` (language tags) become pieces of their own. On a terminal a bar
    counts the lines read; a log line says when
    SentencePiece has them all and trains (which it does without reporting progress).
    """
    model = io.BytesIO()
    read, usable, failure = [0], [0], []

    def counted():
        try:
            with tqdm(
                lines,
                desc="SentencePiece: reading",
                unit=" lines",
                unit_scale=True,
                disable=bars_disabled(),
                leave=False,
            ) as bar:
                for line in bar:  # tqdm's iterator updates the bar far more cheaply than update(1)
                    read[0] += 1
                    if line.strip():
                        usable[0] += 1
                    yield line
            log.info(
                "SentencePiece: read %d lines of %s (%s trains it); training",
                read[0],
                where,
                f"a sample of at most {sample}" if sample > 0 else "every line",
            )
        except (DataError, KeyboardInterrupt) as error:  # SentencePiece would wrap it in "INTERNAL: ..."
            failure.append(error)
            raise

    try:
        _train(counted(), model, vocab_size, model_type, character_coverage, sample, symbols)
    except RuntimeError as error:
        if failure:
            raise failure[0] from None
        if usable[0] == 0:
            raise DataError(
                f"{where}: no usable sentence to train the tokenizer on (every line is empty); "
                "check the files of the training split"
            ) from None
        raise DataError(f"{where}: SentencePiece training failed: {str(error).splitlines()[0]}") from None
    return model.getvalue()


def _train(sentences, model, vocab_size, model_type, character_coverage, sample, symbols=()) -> None:
    extra = {"user_defined_symbols": list(symbols)} if symbols else {}
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences,
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        # Small corpora (tests, the embedded one) cannot fill a large vocabulary; allow fewer pieces.
        hard_vocab_limit=False,
        input_sentence_size=sample,
        shuffle_input_sentence=True,
        num_threads=os.cpu_count() or 1,
        minloglevel=2,
        **extra,
    )


def build_tokenizer(
    source: SplitSource,
    *,
    vocab_size: int,
    model_type: str = "bpe",
    joint: bool = True,
    character_coverage: float = 1.0,
    sample: int = 1_000_000,
    cache_dir: str | Path = "data",
    build: bool = True,
    languages: Sequence[str] = (),
    augment: dict | None = None,
    inline_case: bool = False,
    usual_case: bool = False,
    lowercase_source: bool = False,
) -> Tokenizer | None:
    """Load the cached tokenizer for this training split (by its fingerprint) and these settings, or
    train and cache it, streaming the split. With `build=False`, None when nothing (whole) is cached.

    The cache is `spm/<key>.joint.model` (or `.src.model` + `.tgt.model`) and `spm/<key>.json`, which
    records each model's size and CRC-32: a damaged or missing model is trained again, with a warning.
    `languages`: the target languages of a multilingual model, each with a tag piece (joint only).
    `augment`: the training augmentation's shares of upper case, title case and typos (and the typo rate):
    the sample's lines are noised in the same shares (`augmented_sample`), so that the vocabulary holds
    pieces for upper-case words instead of shredding them into letters.
    `inline_case`: every line is trained on as `casing.encode` writes it, the case markers pieces of their own;
    `usual_case` too: with a table of the words usually in Title case (`casing.usual_titles` of the same
    lines, both sides, at most USUAL_CASE_LINES of them), cached beside the models as `<key>.titles.txt`;
    `lowercase_source`: the vocabulary also holds the sentence markers of a lower-case source
    (`casing.encode_source`), which makes the tokenizer write sources that way. The sample stays written
    as `casing.encode` writes it: the words' pieces are the same, in lower case either way."""
    inline_case = inline_case or usual_case or lowercase_source  # kinds of inline casing
    settings = {
        "vocab_size": vocab_size,
        "model_type": model_type,
        "joint": joint,
        "character_coverage": character_coverage,
        "sample": sample,
        **({"languages": sorted(languages)} if languages else {}),
        **({"augment": augment} if augment and any(augment[k] for k in ("upper", "title", "typos")) else {}),
        **({"inline_case": "usual" if usual_case else True} if inline_case else {}),
        **({"lowercase_source": True} if lowercase_source else {}),
    }
    key = hashlib.sha256(
        json.dumps({**settings, "corpus": source.fingerprint(), "cache": CACHE_VERSION}, sort_keys=True).encode()
    ).hexdigest()[:16]
    folder = Path(cache_dir) / "spm"
    paths = [folder / f"{key}.{name}.model" for name in (["joint"] if joint else ["src", "tgt"])]
    paths += [folder / f"{key}.titles.txt"] if usual_case else []
    record_path = folder / f"{key}.json"
    try:
        models = _read_cached(record_path, paths)
        log.info("SentencePiece: using cached %s", ", ".join(str(p) for p in paths))
    except CacheDamage as damage:
        if not build:
            return None
        if record_path.exists() or any(p.exists() for p in paths):  # damaged, not simply never trained
            log.warning("%s; training SentencePiece again", damage)
        log.info(
            "SentencePiece: training %s %s vocabulary of %d pieces",
            "joint" if joint else "separate",
            model_type,
            vocab_size,
        )
        train = dict(
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            where=source.where,
            # the tags first: they stay next to the special ids (Tokenizer.protected_ids)
            symbols=[LANGUAGE_TAG.format(language) for language in sorted(languages)]
            + (list(casing.ALL_MARKERS if usual_case else casing.MARKERS) if inline_case else [])
            + (list(casing.SOURCE_MARKERS) if lowercase_source else []),
        )
        words = []
        if usual_case:
            lines, _ = _training_lines(source, ("src", "tgt"), sample)
            words = casing.usual_titles(itertools.islice(lines, USUAL_CASE_LINES))
            log.info("inline casing: %d words usually written in Title case carry no marker", len(words))
        titles = frozenset(words)
        models = []
        for sides in [("src", "tgt")] if joint else [("src",), ("tgt",)]:
            lines, reservoir = _training_lines(source, sides, sample)
            if "augment" in settings:
                lines = augmented_sample(lines, augment)
            if inline_case:
                lines = (casing.encode(line, titles) for line in lines)
            models.append(train_sentencepiece(lines, sample=reservoir, **train))
        if usual_case:
            models.append("".join(f"{word}\n" for word in words).encode())
        _write_cached(record_path, paths, models, {**settings, "corpus": source.where})
    tokenizer = Tokenizer(models[0], None if joint else models[1], models[-1] if usual_case else None)
    sizes = f"{tokenizer.src_vocab_size}" if joint else f"{tokenizer.src_vocab_size} + {tokenizer.tgt_vocab_size}"
    if max(tokenizer.src_vocab_size, tokenizer.tgt_vocab_size) < vocab_size:
        log.warning(
            "SentencePiece: the vocabulary has %s pieces, fewer than data.vocab_size=%d: the corpus supports no more",
            sizes,
            vocab_size,
        )
    else:
        log.info("SentencePiece: the vocabulary has %s pieces", sizes)
    return tokenizer


AUGMENTED_SAMPLE_SEED = 73  # the tokenizer sample's noise: the same lines noised alike in every process


def augmented_sample(lines: Iterable[str], shares: dict) -> Iterator[str]:
    """The tokenizer's sample with each line, in the training augmentation's shares, upper-cased or in title
    case (one of the two), and misspelt at its typo rate; drawn in order from one seeded generator."""
    rng = np.random.default_rng(AUGMENTED_SAMPLE_SEED)
    for line in lines:
        case, typo = rng.random(2)
        if case < shares["upper"]:
            line = augment.upper(line)
        elif case < shares["upper"] + shares["title"]:
            line = augment.title(line)
        if typo < shares["typos"]:
            line = augment.typos(line, rng, rate=shares["typo_rate"])
        yield line


def _training_lines(source: SplitSource, sides: tuple[str, ...], sample: int):
    """(lines, sample) for `train_sentencepiece`: the source's own sample of `sample` lines when it draws one
    (a large plain-text corpus: the same lines every time, so the same vocabulary, and only those lines read
    and decoded), else every line, streamed, for SentencePiece's reservoir of `sample` (random per process)."""
    sampled = source.sample_lines(sides, sample) if sample > 0 else None
    if sampled is not None:
        log.info("SentencePiece: a sample of %d lines of %s (data.tokenizer_sample)", len(sampled), source.where)
        return sampled, 0
    return source.lines(*sides), sample


def _read_cached(record_path: Path, paths: list[Path]) -> list[bytes]:
    """The cached models once they match their record; CacheDamage naming the first that does not."""
    record = read_record(record_path)
    models = []
    for path in paths:
        if not isinstance(record.get("models"), dict) or path.name not in record["models"]:
            raise CacheDamage(record_path, f"unreadable metadata (no record of {path.name})")
        data = read_cached_bytes(path)
        check_bytes(data, path, record["models"][path.name])
        models.append(data)
    return models


def _write_cached(record_path: Path, paths: list[Path], models: list[bytes], about: dict) -> None:
    """Each model, then the record of them all, each into a temporary file renamed into place: a
    reader finds a model that matches the record or one it knows to be damaged."""
    record = sealed({**about, "models": {path.name: bytes_record(model) for path, model in zip(paths, models)}})
    temporary = []
    try:
        record_path.parent.mkdir(parents=True, exist_ok=True)
        for path, content in [*zip(paths, models), (record_path, record.encode())]:
            temporary.append(path.with_name(f".{path.name}.tmp{os.getpid()}"))
            temporary[-1].write_bytes(content)
            os.replace(temporary[-1], path)
    except OSError as error:  # a full disk, a read-only cache: one line, not a traceback
        raise write_failure(error, "the SentencePiece model", record_path.parent) from None
    finally:
        for tmp in temporary:  # on any failure (Ctrl-C included): no temporary file left
            tmp.unlink(missing_ok=True)
