"""Prepared corpora: the SentencePiece model and every split's token ids in memory-mapped files.

`make prepare` (`transformer-prepare`, the same Hydra config as training) builds them; `make train`
builds whatever is missing. A split is stored under `data.cache_dir/corpus/<data.name>.<split>.<key>/`
(the key hashes the source's content and the tokenizer) as

    src.ids, tgt.ids            every pair's token ids, one flat uint16 (int32 for > 65536 pieces) array
    src.offsets.npy, ...        int64, pairs + 1: pair i is ids[offsets[i] : offsets[i + 1]]
    flags.npy                   uint8 per pair: 1 = a side is blank, 2 = a NUL byte, 4 = source equals
                                target, 8 = the same pair came earlier in the split
    langid.SRC-TGT.npy          with data.langid (training split): uint8 per pair, 1 = the source, 2 = the
                                target identified as another language (found once, on first use)
    langid.SRC-TGT.json         its size, CRC-32 and pair count (a damaged file is identified again)
    src.text, tgt.text, ...     with data.subword_sampling (training split only): every line's UTF-8
    src.text_offsets.npy, ...   bytes and int64 offsets, re-segmented with sampling batch by batch
    meta.json                   counts, dtype, where the text came from, every file's size and CRC-32

written into a temporary directory that is renamed into place, so a killed preparation leaves nothing
half-written. Readers memory-map the files: N processes or ranks share one copy in the page cache.
Before a split is used its files are checked against meta.json (sizes and CRC-32, transformer/data/cache.py):
a damaged split is prepared again, with one warning that names the file and what was wrong.
When something is missing or damaged, preparation takes a file lock, so concurrent runs and torchrun
ranks prepare a corpus once (the others wait on the lock, outside any collective, however long it
takes) and then read it; when everything is cached, every process reads it at once without the lock.
Filtering is a vectorised mask applied at load time: blank, NUL and longer than `data.max_len` always;
on the training split, the cleaning rules `data.drop_duplicates`, `data.drop_copies`,
`data.max_len_ratio` and `data.langid` (each pair's properties are found once, when it is encoded or,
for its languages, when data.langid first asks: changing a rule prepares nothing again). The log
counts what each rule dropped.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from transformer.config import DataConfig
from transformer.console import bars_disabled
from transformer.data.arrays import CHUNK_PAIRS, ColumnWriter, compact, index_dtype, repeated_keys
from transformer.data.augmented_pairs import AugmentSettings, PairAugmentation
from transformer.data.cache import check_file, file_record, read_record, sealed, write_failure
from transformer.data.cleaning import (
    FLAG_BLANK,
    FLAG_DUPLICATE,
    FLAG_NUL,
    Cleaning,
    identify_languages,
    languages_identified,
    pair_properties,
)
from transformer.data.sources import DataError, SplitSource
from transformer.data.subword import SubwordSampling
from transformer.data.tokenizer import Tokenizer, build_tokenizer
from transformer.errors import CacheDamage

if TYPE_CHECKING:  # torch comes with it: imported where batches are made, not to prepare
    from transformer.data.batching import Batch


log = logging.getLogger(__name__)


FORMAT_VERSION = 3  # 2: meta.json records every file's size and CRC-32; 3: copy, duplicate flags


DATA_FILES = ("src.ids", "tgt.ids", "src.offsets.npy", "tgt.offsets.npy", "flags.npy")


TEXT_FILES = ("src.text", "tgt.text", "src.text_offsets.npy", "tgt.text_offsets.npy")


class EncodedCorpus:
    """A prepared split, memory-mapped, with the pairs that pass the filters.

    Positions 0..len-1 index the kept pairs; `src_lens` / `tgt_lens` are their lengths without
    specials. Pickles as its directory (DataLoader workers re-open the files, never copy them).
    """

    def __init__(self, directory: Path, max_len: int | None, name: str, cleaning: Cleaning | None = None):
        self.directory, self.max_len, self.name, self.cleaning = Path(directory), max_len, name, cleaning
        self.sampling: SubwordSampling | None = None
        self.augmentation: PairAugmentation | None = None
        self._open()

    def _open(self) -> None:
        try:  # sizes only: the checksums were checked by prepare()
            meta = check_prepared(self.directory, checksums=False)
        except CacheDamage as damage:  # damaged since (a DataLoader worker re-opening it)
            raise DataError(
                f"{damage}: the prepared corpus was damaged after it was checked; run `make prepare` again"
            ) from None
        self.meta = meta
        for side in ("src", "tgt"):
            ids, offsets = _mapped(
                self.directory / f"{side}.ids", self.directory / f"{side}.offsets.npy", meta["dtype"]
            )
            setattr(self, f"_{side}_ids", ids)
            setattr(self, f"_{side}_offsets", offsets)
        self._keep_pairs()

    def _keep_pairs(self) -> None:
        """The kept pairs and their lengths, a chunk of stored pairs at a time: what stays for the run is
        8 bytes a kept pair (kept position -> stored pair in uint32, and the kept pairs' lengths in uint16
        up to data.max_len 65,534), and nothing of the size of the corpus is made on the way."""
        flags = np.load(self.directory / "flags.npy", mmap_mode="r")  # (pairs,) uint8
        language = None  # data.langid's flags, (pairs,) uint8
        if self.cleaning and self.cleaning.langid:
            language = np.load(self.directory / self.cleaning.langid, mmap_mode="r")
        total = len(flags)
        longest = 0 if self.max_len is None else self.max_len
        if self.max_len is None:
            for side in ("src", "tgt"):
                longest = max([longest] + [int(chunk.max(initial=0)) for chunk in self._stored_lengths(side)])
        length_type = compact(np.array([longest])).dtype
        self.pair_index = np.empty(total, dtype=index_dtype(total))  # filled up to `kept`: pages untouched after
        self.src_lens, self.tgt_lens = np.empty(total, dtype=length_type), np.empty(total, dtype=length_type)
        self.dropped = {"empty": 0, "NUL byte": 0, "too long": 0}
        kept = 0
        for start, src_all, tgt_all in zip(
            range(0, total, CHUNK_PAIRS), self._stored_lengths("src"), self._stored_lengths("tgt")
        ):
            stop = start + len(src_all)
            chunk_flags = np.asarray(flags[start:stop])
            rules = {  # each pair counted under the first rule that drops it
                "empty": ((chunk_flags & FLAG_BLANK) != 0) | (src_all == 0) | (tgt_all == 0),
                "NUL byte": (chunk_flags & FLAG_NUL) != 0,
            }
            if self.max_len is not None:
                rules["too long"] = (src_all > self.max_len) | (tgt_all > self.max_len)
            if self.cleaning:
                chunk_language = None if language is None else np.asarray(language[start:stop])
                rules.update(self.cleaning.masks(chunk_flags, src_all, tgt_all, chunk_language))
            dropped = np.zeros(len(chunk_flags), dtype=bool)
            for rule, mask in rules.items():
                mask &= ~dropped
                self.dropped[rule] = self.dropped.get(rule, 0) + int(mask.sum())
                dropped |= mask
            keep = np.flatnonzero(~dropped)  # (K,) within the chunk
            self.pair_index[kept : kept + len(keep)] = start + keep
            self.src_lens[kept : kept + len(keep)] = src_all[keep]
            self.tgt_lens[kept : kept + len(keep)] = tgt_all[keep]
            kept += len(keep)
        self.pair_index, self.src_lens, self.tgt_lens = (
            a[:kept] for a in (self.pair_index, self.src_lens, self.tgt_lens)
        )
        self.total_pairs = total

    def _stored_lengths(self, side: str):
        """The lengths of every stored pair of `side`, CHUNK_PAIRS at a time (uint32)."""
        offsets = getattr(self, f"_{side}_offsets")
        for start in range(0, len(offsets) - 1, CHUNK_PAIRS):
            yield np.diff(offsets[start : start + CHUNK_PAIRS + 1]).astype(np.uint32)

    def __getstate__(self):
        return {
            "directory": self.directory,
            "max_len": self.max_len,
            "name": self.name,
            "cleaning": self.cleaning,
            "sampling": self.sampling,
            "augmentation": self.augmentation,
        }

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return len(self.pair_index)

    def collate(self, positions, key: tuple[int, int] | None = None) -> Batch:
        """The batch of kept pairs `positions`. With subword sampling enabled and a `key` (epoch, batch
        number), the pairs in that epoch's sampled segmentation."""
        from transformer.data.batching import make_batch

        positions = np.asarray(positions, dtype=np.int64)
        pairs = self.pair_index[positions]
        if self.sampling is not None and key is not None:
            return self.sampling.batch(self, pairs, epoch=key[0])
        if self.augmentation is not None and key is not None:
            return self.augmentation.batch(self, positions, epoch=key[0])
        return make_batch(
            self._src_ids,
            self._src_offsets[pairs],
            self.src_lens[positions],
            self._tgt_ids,
            self._tgt_offsets[pairs],
            self.tgt_lens[positions],
        )

    def enable_subword_sampling(self, tokenizer: Tokenizer, alpha: float, nbest: int, seed: int) -> None:
        """Segment training batches afresh with SentencePiece sampling (`SubwordSampling`); needs the
        text that a preparation with data.subword_sampling > 0 keeps."""
        if not (self.directory / TEXT_FILES[0]).exists():
            raise DataError(
                f"{self.directory}: prepared without its text; data.subword_sampling needs it "
                "(prepare with data.subword_sampling > 0)"
            )
        self.sampling = SubwordSampling(tokenizer.state_dict(), alpha, nbest, seed, self.max_len)
        log.info(
            "%s: every training batch re-segmented with SentencePiece sampling (data.subword_sampling=%g%s), "
            "seeded by trainer.seed, epoch and pair",
            self.name,
            alpha,
            f", data.subword_nbest={nbest}" if nbest != -1 else "",
        )

    def enable_augmentation(self, tokenizer: Tokenizer, settings: AugmentSettings, seed: int, stream: int = 0) -> None:
        """Noise training batches with data.augment_* (`PairAugmentation`), drawn per (trainer.seed, corpus
        `stream`, epoch, pair)."""
        self.augmentation = PairAugmentation(settings, tokenizer.state_dict(), seed, self.max_len, stream)
        log.info(
            "%s: training pairs augmented (%s), drawn afresh every epoch from trainer.seed, epoch and pair",
            self.name,
            settings.describe(),
        )

    @property
    def varies_by_epoch(self) -> bool:
        """Whether the pairs' ids (and lengths) change from epoch to epoch: subword sampling, augmentation."""
        return self.sampling is not None or self.augmentation is not None

    def epoch_lengths(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Source and target lengths of the kept pairs in `epoch` (sampled segmentation, augmentation): the
        batch sampler packs by them."""
        if self.sampling is not None:
            return self.sampling.lengths(self, epoch)
        if self.augmentation is not None:
            return self.augmentation.lengths(self, epoch)
        return self.src_lens, self.tgt_lens

    def epoch_sides(self, positions: np.ndarray, epoch: int) -> tuple[list, list] | None:
        """(source ids, target ids) of kept `positions` in `epoch` where augmentation changes them; None
        where the stored ids hold (a mixture gathers those itself)."""
        if self.augmentation is None:
            return None
        return self.augmentation.sides(self, positions, epoch)

    def text(self, side: str, pairs: np.ndarray) -> list[str]:
        """The original lines of stored pairs `pairs` on `side` (src, tgt), from the kept text."""
        if not hasattr(self, "_text"):
            self._text = {
                each: _mapped(self.directory / f"{each}.text", self.directory / f"{each}.text_offsets.npy", np.uint8)
                for each in ("src", "tgt")
            }
        data, offsets = self._text[side]
        return [data[offsets[p] : offsets[p + 1]].tobytes().decode("utf-8") for p in pairs]

    @property
    def identity(self) -> str:
        """Names this training data in a checkpoint (`{data.name}.{split}.{content hash}`)."""
        return self.directory.name

    def stored(self, side: str) -> tuple[np.ndarray, np.ndarray]:
        """(flat ids, offsets) of `side` (src, tgt) as stored: kept position k is stored pair pair_index[k]."""
        return getattr(self, f"_{side}_ids"), getattr(self, f"_{side}_offsets")

    def ids(self, position: int) -> tuple[list[int], list[int]]:
        """(source ids, target ids) of one kept pair (tests, debugging)."""
        pair = self.pair_index[position]
        return (
            self._src_ids[self._src_offsets[pair] : self._src_offsets[pair + 1]].tolist(),
            self._tgt_ids[self._tgt_offsets[pair] : self._tgt_offsets[pair + 1]].tolist(),
        )

    def report(self) -> None:
        """Log what the filters dropped (a warning for unusable pairs, information for the cleaning rules);
        refuse a split with nothing left."""
        total = sum(self.dropped.values())
        if total:
            unusable = any(self.dropped[k] for k in ("empty", "NUL byte", "too long"))
            rules = f"max_len={self.max_len}" + (f", {self.cleaning}" if self.cleaning else "")
            log.log(
                logging.WARNING if unusable else logging.INFO,
                "%s: dropped %d of %d pairs (%s; %s)",
                self.name,
                total,
                self.total_pairs,
                ", ".join(f"{k}: {v}" for k, v in self.dropped.items() if v),
                rules,
            )
        if not len(self):
            raise DataError(
                f"{self.name} ({self.meta['source']}): no usable sentence pairs left after filtering "
                f"(all empty, longer than data.max_len={self.max_len} or dropped by the cleaning "
                "rules: see the line above)"
            )


def _mapped(data: Path, offsets: Path, dtype) -> tuple[np.ndarray, np.ndarray]:
    """A prepared flat array and its int64 offsets, both memory-mapped (the ids empty when there are none)."""
    bounds = np.load(offsets, mmap_mode="r")
    flat = np.memmap(data, dtype=dtype, mode="r", shape=(int(bounds[-1]),)) if bounds[-1] else np.zeros(0, dtype=dtype)
    return flat, bounds


def check_prepared(directory: Path, checksums: bool = True) -> dict:
    """The metadata of the prepared split in `directory` once its files match it (sizes and, with
    `checksums`, CRC-32); CacheDamage naming the first file that does not."""
    meta = read_record(directory / "meta.json")
    files = meta.get("files")
    expected = set(DATA_FILES) | (set(TEXT_FILES) if meta.get("text") else set())
    if meta.get("format") != FORMAT_VERSION or not isinstance(files, dict) or set(files) != expected:
        raise CacheDamage(directory / "meta.json", "unreadable metadata (not this version's layout)")
    for name in sorted(expected):
        check_file(directory / name, files[name], checksum=checksums)
    return meta


def _remove_leftovers(directory: Path) -> None:
    """Temporary and damaged copies of `directory` left by killed preparations (under the lock)."""
    for leftover in directory.parent.glob(f".{directory.name}.*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _move_aside(directory: Path, damage: CacheDamage) -> None:
    """Take a damaged split out of the way (under the lock): processes that still have its files
    memory-mapped keep reading them; the next ones find the split missing and wait for the lock."""
    aside = directory.with_name(f".{directory.name}.damaged{os.getpid()}")
    try:
        os.rename(directory, aside)
    except OSError as error:
        raise DataError(
            f"{damage}, and {directory} cannot be moved aside to prepare it again ({error.strerror}); delete it"
        ) from None
    shutil.rmtree(aside, ignore_errors=True)


def _encode_to(
    directory: Path, source: SplitSource, tokenizer: Tokenizer, desc: str, text: bool = False, tag: str | None = None
) -> dict:
    """Encode `source` chunk by chunk (SentencePiece on every core) into the files of `directory`,
    written in a temporary directory renamed into place. Called under the preparation lock."""
    tmp = directory.with_name(f".{directory.name}.tmp{os.getpid()}")
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(directory)
        tmp.mkdir()
        meta = _write_split(tmp, source, tokenizer, desc, text, tag)
        changed = source.changed_since_fingerprint()
        if changed:  # what was read mixes old and new lines; kept, it would pass for the old content
            raise DataError(
                f"{changed[0]}: changed while it was being prepared (its size or modification time "
                "moved); nothing was kept: run again once it is written"
            )
        os.rename(tmp, directory)
    except OSError as error:  # a full disk, a read-only cache: one line, not a traceback
        raise write_failure(error, "the prepared corpus", directory) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # on any failure (Ctrl-C included): nothing half-written
    log.info(
        "%s: %d pairs, %d + %d tokens -> %s", desc, meta["pairs"], meta["src_tokens"], meta["tgt_tokens"], directory
    )
    return meta


def _write_split(
    tmp: Path, source: SplitSource, tokenizer: Tokenizer, desc: str, text: bool = False, tag: str | None = None
) -> dict:
    """`text`: also keep every line's UTF-8 bytes (for subword sampling); `tag`: the target language whose
    tag starts every source sentence (a multilingual model)."""
    vocab = max(tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.int32)
    # Every per-pair column streams to its file a chunk at a time: preparing holds one chunk, not the corpus.
    closing = contextlib.ExitStack()
    offsets = {side: ColumnWriter(tmp / f"{side}.offsets.npy", offsets=True) for side in ("src", "tgt")}
    text_offsets = (
        {side: ColumnWriter(tmp / f"{side}.text_offsets.npy", offsets=True) for side in ("src", "tgt")} if text else {}
    )
    text_files = (
        {side: closing.enter_context(open(tmp / f"{side}.text", "wb")) for side in ("src", "tgt")} if text else {}
    )
    flags = ColumnWriter(tmp / "flags.npy", np.uint8)
    keys = ColumnWriter(tmp / "keys.npy", np.int64)  # each pair's text hash, for the duplicate flags; removed
    threads = os.cpu_count() or 1
    with (
        closing,
        open(tmp / "src.ids", "wb") as src_file,
        open(tmp / "tgt.ids", "wb") as tgt_file,
        tqdm(desc=f"encoding {desc}", unit=" pairs", unit_scale=True, disable=bars_disabled(), leave=False) as bar,
    ):
        for src, tgt in source.chunks():
            for side, lines, out in (("src", src, src_file), ("tgt", tgt, tgt_file)):
                ids = (
                    tokenizer.encode_src(lines, num_threads=threads, tgt_lang=tag)
                    if side == "src"
                    else tokenizer.encode_tgt(lines, num_threads=threads)
                )
                lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
                out.write(np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lens.sum())).tobytes())
                offsets[side].append(lens)
                if text:
                    encoded = [line.encode("utf-8") for line in lines]
                    text_files[side].write(b"".join(encoded))
                    text_offsets[side].append(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)))
            chunk_flags, chunk_keys = pair_properties(src, tgt)
            flags.append(chunk_flags)
            keys.append(chunk_keys)
            bar.update(len(src))
    for writer in (*offsets.values(), *text_offsets.values(), flags, keys):
        writer.close()
    counts = {f"{side}_tokens": offsets[side].total for side in ("src", "tgt")}
    flag_array = np.load(tmp / "flags.npy")  # (pairs,) uint8
    flag_array[repeated_keys(np.load(tmp / "keys.npy", mmap_mode="r"))] |= FLAG_DUPLICATE  # all but the first
    (tmp / "keys.npy").unlink()
    np.save(tmp / "flags.npy", flag_array)
    meta = {
        "format": FORMAT_VERSION,
        "pairs": len(flag_array),
        **counts,
        "dtype": dtype.name,
        "source": source.where,
        "src_vocab": tokenizer.src_vocab_size,
        "tgt_vocab": tokenizer.tgt_vocab_size,
        "text": text,
        "files": {name: file_record(tmp / name) for name in DATA_FILES + (TEXT_FILES if text else ())},
    }
    (tmp / "meta.json").write_text(sealed(meta))
    return meta


def encoded_split(
    source: SplitSource, tokenizer: Tokenizer, cfg: DataConfig, split: str, build: bool = True
) -> EncodedCorpus | None:
    """The prepared split for this source and tokenizer: read from the cache once its files are checked,
    or encoded now (or None when it is missing or damaged and `build` is false). With `build`, call it
    under `preparation_lock`: a damaged split is moved aside and encoded again."""
    text = split == "train" and cfg.subword_sampling > 0  # the text kept for subword sampling
    tag = cfg.tgt_lang if tokenizer.target_languages else None  # a multilingual model: sources tagged
    if tag is not None and tag not in tokenizer.target_languages:
        raise DataError(
            f"{source.where}: translates into {tag!r}, which is not a target language of the "
            f"model's tokenizer (it knows {', '.join(tokenizer.target_languages)})"
        )
    key = hashlib.sha256(
        json.dumps(
            {
                "source": source.fingerprint(),
                "tokenizer": tokenizer.fingerprint(),
                "format": FORMAT_VERSION,
                **({"text": True} if text else {}),
                **({"tag": tag} if tag else {}),
            }
        ).encode()
    ).hexdigest()[:16]
    name = f"{cfg.name}.{split}"
    directory = Path(cfg.cache_dir) / "corpus" / f"{name}.{key}"
    try:
        meta = check_prepared(directory)
        log.info("%s: prepared corpus %s", name, directory)
    except CacheDamage as damage:
        if not build:
            return None
        if directory.exists():  # damaged, not simply never prepared
            log.warning("%s; preparing %s again", damage, name)
            _move_aside(directory, damage)
        meta = _encode_to(directory, source, tokenizer, name, text, tag)
    cleaning = Cleaning.of(cfg) if split == "train" else None
    flags = directory / cleaning.langid if cleaning and cleaning.langid else None
    if flags and not languages_identified(flags, meta["pairs"], say_damage=build):
        if not build:
            return None
        identify_languages(flags, source, cfg, name, meta["pairs"])
    return EncodedCorpus(directory, cfg.max_len, name, cleaning)


@contextlib.contextmanager
def preparation_lock(cfg: DataConfig):
    """An exclusive lock per corpus name and cache directory, released when the process ends."""
    folder = Path(cfg.cache_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / f".prepare.{cfg.name}.lock", "a+")
    except OSError as error:
        raise write_failure(error, "the preparation lock", folder) from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is preparing %s in %s: waiting for it", cfg.name, folder)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


@dataclass
class PreparedData:
    tokenizer: Tokenizer
    train: EncodedCorpus
    valid: EncodedCorpus | None
    sources: dict[str, SplitSource]  # the splits' text (validation and test are scored from it)
    # A multilingual mixture: each direction's validation split and its text ("fr-en": (corpus, source));
    # `valid` and sources["validation"] are then data.src_lang -> data.tgt_lang's (else the first's).
    directions: dict[str, tuple[EncodedCorpus, SplitSource]] = field(default_factory=dict)
    # data.validate_zero_shot: the directions no corpus trains that data.path has validation text for ("de-fr")
    zero_shot: dict[str, tuple[EncodedCorpus, SplitSource]] = field(default_factory=dict)


def train_tokenizer(cfg: DataConfig, source: SplitSource, build: bool = True) -> Tokenizer | None:
    return build_tokenizer(
        source,
        vocab_size=cfg.vocab_size,
        model_type=cfg.tokenizer_type,
        joint=cfg.joint_vocab,
        character_coverage=cfg.character_coverage,
        sample=cfg.tokenizer_sample,
        cache_dir=cfg.cache_dir,
        build=build,
        languages=cfg.target_languages(),
        augment=_tokenizer_augmentation(cfg),
        inline_case=cfg.inline_case,
        usual_case=cfg.usual_case,
        lowercase_source=cfg.lowercase_source,
    )


MAX_NOISED_SAMPLE = 0.5  # the largest share of the tokenizer's sample in upper / title case (and with typos)


def _tokenizer_augmentation(cfg: DataConfig) -> dict:
    """The shares the tokenizer's sample is noised in: the run's data.augment_*, or in a mixture the largest
    share any corpus trains with, so that the vocabulary covers every corpus's noise."""
    shares = AugmentSettings.of(cfg).for_tokenizer()
    for corpus in cfg.corpora:
        for name in shares:
            own = getattr(corpus, f"augment_{name}")
            if own is not None and (name != "typo_rate" or corpus.augment_typos):
                shares[name] = max(shares[name], own)
    # Validation, test and users' input are clean: at most half the sample is noised, so that clean text keeps
    # its pieces even where a corpus trains on noised pairs only.
    case = shares["upper"] + shares["title"]
    if case > MAX_NOISED_SAMPLE:
        shares["upper"], shares["title"] = (MAX_NOISED_SAMPLE * shares[k] / case for k in ("upper", "title"))
    shares["typos"] = min(shares["typos"], MAX_NOISED_SAMPLE)
    return shares
