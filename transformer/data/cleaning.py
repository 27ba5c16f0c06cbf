"""The cleaning of a training split: each pair's properties found once, when it is encoded (`pair_properties`:
blank, NUL, a copy of its source, a duplicate) or, for its languages, when data.langid first asks
(`identify_languages`), and the rules that drop pairs by them at load time (`Cleaning`): changing a rule
prepares nothing again."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from transformer.config import DataConfig
from transformer.console import bars_disabled
from transformer.data.cache import check_file, file_record, read_record, sealed, write_failure
from transformer.data.langid import WRONG_SOURCE, WRONG_TARGET, language_flags
from transformer.data.sources import DataError, SplitSource
from transformer.errors import CacheDamage

if TYPE_CHECKING:  # torch comes with it: imported where batches are made, not to prepare
    pass

log = logging.getLogger("transformer.data.corpus")  # said as the preparation's own lines

# Each pair's properties, one bit each, in the prepared split's flags.npy.
FLAG_BLANK, FLAG_NUL, FLAG_COPY, FLAG_DUPLICATE = 1, 2, 4, 8


@dataclass(frozen=True)
class Cleaning:
    """The cleaning rules of a training split (`data.drop_duplicates`, `data.drop_copies`,
    `data.max_len_ratio`: 0 = no ratio rule; `data.langid`: the file of language flags beside the
    prepared split, or None)."""

    duplicates: bool
    copies: bool
    max_len_ratio: float
    langid: str | None = None

    @classmethod
    def of(cls, cfg: DataConfig) -> Cleaning:
        return cls(
            cfg.drop_duplicates,
            cfg.drop_copies,
            cfg.max_len_ratio,
            f"langid.{cfg.src_lang}-{cfg.tgt_lang}.npy" if cfg.langid else None,
        )

    def masks(
        self, flags: np.ndarray, src_lens: np.ndarray, tgt_lens: np.ndarray, language: np.ndarray | None
    ) -> dict[str, np.ndarray]:
        """The pairs each rule drops, by rule name, in the order the rules apply, for pairs with these flags,
        lengths and (with data.langid) language flags (each (P,), a chunk of a split's pairs)."""
        masks = {}
        if self.duplicates:
            masks["duplicate"] = (flags & FLAG_DUPLICATE) != 0
        if self.copies:
            masks["copy"] = (flags & FLAG_COPY) != 0
        if self.max_len_ratio:
            longer, shorter = np.maximum(src_lens, tgt_lens), np.maximum(np.minimum(src_lens, tgt_lens), 1)
            masks["length ratio"] = longer > self.max_len_ratio * shorter
        if self.langid:
            masks["language"] = language != 0
        return masks

    def __str__(self) -> str:
        # the corpus's own rules: data.KEY, or its data.corpora entry's KEY where it sets one
        return f"drop_duplicates={self.duplicates}, drop_copies={self.copies}, max_len_ratio={self.max_len_ratio:g}" + (
            ", langid=true" if self.langid else ""
        )


def pair_properties(src: list[str], tgt: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per pair of a chunk: its flags (blank, NUL, copy) and a 64-bit key of its stripped text, equal
    for equal pairs within this process (Python's string hash; a collision between two different pairs
    among millions is about as likely as winning a lottery, and would drop one pair)."""
    flags = np.zeros(len(src), dtype=np.uint8)
    keys = np.zeros(len(src), dtype=np.int64)
    for i, (s, t) in enumerate(zip(src, tgt)):
        s_stripped, t_stripped = s.strip(), t.strip()
        if not s_stripped or not t_stripped:
            flags[i] = FLAG_BLANK
        elif s_stripped == t_stripped:
            flags[i] = FLAG_COPY
        if "\0" in s or "\0" in t:
            flags[i] |= FLAG_NUL
        keys[i] = hash((s_stripped, t_stripped))
    return flags, keys


def languages_identified(path: Path, pairs: int, say_damage: bool = True) -> bool:
    """Whether `path` holds the language flags of `pairs` pairs (data.langid), as its record beside it
    (`flags_record`) says: size and CRC-32. Flags that are missing, cut short by a killed run, or damaged
    (a warning naming the file, with `say_damage`: by whoever identifies them again) are not."""
    try:
        record = read_record(flags_record(path))
        if record.get("pairs") != pairs or not isinstance(record.get("file"), dict):
            raise CacheDamage(flags_record(path), f"records {record.get('pairs')} pairs, not {pairs}")
        check_file(path, record["file"])
        return True
    except CacheDamage as damage:
        if say_damage and path.exists():  # damaged, not simply never identified
            log.warning("%s; data.langid: identifying the languages again", damage)
        return False
    except (KeyError, TypeError):  # a sealed record of another shape
        return False


def flags_record(path: Path) -> Path:
    """The sealed record (size, CRC-32, pairs) of the language flags `path`: langid.SRC-TGT.json."""
    return path.with_suffix(".json")


def identify_languages(path: Path, source: SplitSource, cfg: DataConfig, desc: str, pairs: int) -> None:
    """The language flags of every pair of `source` (transformer/data/langid.py), saved as `path` beside the
    prepared split, written under another name and renamed. Called under the preparation lock."""
    started = time.perf_counter()
    with tqdm(
        total=pairs,
        desc=f"identifying languages {desc}",
        unit=" pairs",
        unit_scale=True,
        disable=bars_disabled(),
        leave=False,
    ) as bar:
        flags = language_flags(source.chunks(), cfg.src_lang, cfg.tgt_lang, pairs, bar.update)
    if len(flags) != pairs:
        raise DataError(
            f"{source.where}: {len(flags)} pairs now, {pairs} when it was prepared into "
            f"{path.parent}; was it changed meanwhile? Run again"
        )
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.npy")
    tmp_record = tmp.with_suffix(".json")
    try:
        np.save(tmp, flags)
        tmp_record.write_text(sealed({"pairs": pairs, "file": file_record(tmp)}))
        os.replace(tmp, path)  # the record last: flags without a (matching) record are identified again
        os.replace(tmp_record, flags_record(path))
    except OSError as error:
        raise write_failure(error, "the language flags (data.langid)", path) from None
    finally:
        tmp.unlink(missing_ok=True)
        tmp_record.unlink(missing_ok=True)
    log.info(
        "%s: identified the languages of %d pairs in %.1f s (data.langid, py3langid): %d sources not %s, "
        "%d targets not %s",
        desc,
        pairs,
        time.perf_counter() - started,
        int(((flags & WRONG_SOURCE) != 0).sum()),
        cfg.src_lang,
        int(((flags & WRONG_TARGET) != 0).sum()),
        cfg.tgt_lang,
    )
