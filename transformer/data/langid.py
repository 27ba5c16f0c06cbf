"""Language identification with py3langid (a naive Bayes model over byte n-grams that ships inside its
wheel: nothing is downloaded; about 30,000 short sentences a second on one core). Two uses:

- `off_target`: the share of translations in another language than the one asked for, identified
  among the model's own languages (`transformer-evaluate` reports it for a multilingual model);
- `language_flags`: the cleaning rule `data.langid`, which drops training pairs whose source or target
  is identified (among all of py3langid's languages) as another language than the corpus says.

Close languages get confused on short sentences (Czech read as Slovak: 1% of Multi30k's validation
captions), which is why the off-target rate chooses among the model's languages only.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
from collections import Counter, deque
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from transformer.errors import DataError

WRONG_SOURCE, WRONG_TARGET = 1, 2  # language_flags: the source / the target is in another language
PARALLEL_FROM = 50_000  # lines: fewer are identified in this process, more by one process per core
BATCH_LINES = 20_000  # lines per task of the process pool


def code(lang: str) -> str:
    """py3langid's code for a language code of ours: 'pt_BR' and 'zh-Hans' are 'pt' and 'zh'."""
    return lang.replace("_", "-").split("-")[0].lower()


@functools.cache
def identifier():
    """py3langid's identifier (loaded once: about half a second)."""
    try:
        from py3langid.langid import MODEL_FILE, LanguageIdentifier
    except ImportError:
        raise DataError(
            "language identification needs py3langid, which is not installed: pip install py3langid"
        ) from None
    return LanguageIdentifier.from_model_file(MODEL_FILE)


def known_languages() -> list[str]:
    identifier().set_languages(None)
    return identifier().labels


def unknown(languages: Iterable[str]) -> list[str]:
    """The `languages` py3langid cannot identify."""
    labels = set(known_languages())
    return [lang for lang in languages if code(lang) not in labels]


def check_known(languages: Iterable[str]) -> None:
    """DataError naming the `languages` py3langid cannot identify (and the codes it knows), if any."""
    missing = list(dict.fromkeys(unknown(languages)))
    if missing:
        raise DataError(
            f"langid: py3langid does not know the language code(s) {', '.join(missing)} (the "
            "corpus's src_lang / tgt_lang: data.src_lang / data.tgt_lang, or its data.corpora entry's); "
            f"it knows {', '.join(sorted(known_languages()))}. Use one of those codes, or turn the rule "
            "off for that corpus (data.langid=false, or langid: false in its data.corpora entry)"
        )


def identify(texts: list[str], languages: Iterable[str] | None = None) -> list[str]:
    """The language of each text (py3langid codes), among `languages` or all py3langid knows; '' for a
    blank text."""
    chosen = identifier()
    chosen.set_languages(sorted({code(lang) for lang in languages}) if languages else None)
    return [chosen.classify(text)[0] if text.strip() else "" for text in texts]


def off_target(hypotheses: list[str], tgt_lang: str, languages: Iterable[str]) -> dict | None:
    """How many `hypotheses` are in another of the model's `languages` than `tgt_lang`: {"off_target": % of
    the non-blank ones, "off_target_count", "off_target_languages": {lang: count}, "off_target_among"};
    None when py3langid cannot tell these languages apart (one of them unknown to it, or only one)."""
    among = sorted({code(lang) for lang in languages} | {code(tgt_lang)})
    if len(among) < 2 or unknown(among):
        return None
    found = [lang for lang in identify(hypotheses, among) if lang]
    wrong = Counter(lang for lang in found if lang != code(tgt_lang))
    count = sum(wrong.values())
    return {
        "off_target": round(100.0 * count / max(len(found), 1), 2),
        "off_target_count": count,
        "off_target_languages": dict(wrong.most_common()),
        "off_target_among": among,
    }


def _flags(pairs: tuple[list[str], list[str], str, str]) -> np.ndarray:
    """language_flags of one batch of pairs (a process-pool task)."""
    src, tgt, src_lang, tgt_lang = pairs
    flags = np.zeros(len(src), dtype=np.uint8)
    for lines, lang, flag in ((src, src_lang, WRONG_SOURCE), (tgt, tgt_lang, WRONG_TARGET)):
        wrong = np.fromiter((found not in ("", lang) for found in identify(lines)), dtype=bool, count=len(lines))
        flags[wrong] |= flag
    return flags


def language_flags(
    chunks: Iterable[tuple[list[str], list[str]]], src_lang: str, tgt_lang: str, total: int, progress=None
) -> np.ndarray:
    """Per pair of `chunks` (source lines, target lines; `total` pairs in all): WRONG_SOURCE when the source
    is identified as another language than `src_lang`, WRONG_TARGET likewise; blank lines are never
    flagged. From PARALLEL_FROM pairs on, one process per core (spawned: a fork of a process running
    PyTorch's threads can hang), at most two batches per process in flight, so a corpus of millions of
    lines is never all in memory. `progress(n)` is called with each batch's pairs."""
    check_known([src_lang, tgt_lang])
    batches = (
        (src[i : i + BATCH_LINES], tgt[i : i + BATCH_LINES], code(src_lang), code(tgt_lang))
        for src, tgt in chunks
        for i in range(0, len(src), BATCH_LINES)
    )
    results = []
    if total < PARALLEL_FROM:
        for batch in batches:
            results.append(_flags(batch))
            if progress:
                progress(len(batch[0]))
    else:
        workers = min(os.cpu_count() or 1, 8)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            pending = deque()
            for batch in batches:
                pending.append((len(batch[0]), pool.submit(_flags, batch)))
                while len(pending) >= 2 * workers or (pending and pending[0][1].done()):
                    results.append(_collect(pending, progress))
            while pending:
                results.append(_collect(pending, progress))
    return np.concatenate(results) if results else np.zeros(0, dtype=np.uint8)


def _collect(pending: deque, progress) -> np.ndarray:
    size, future = pending.popleft()
    flags = future.result()
    if progress:
        progress(size)
    return flags
