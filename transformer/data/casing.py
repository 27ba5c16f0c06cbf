"""Inline casing (`data.inline_case`): case as a marker piece after the word, the word itself in lower case.

A cased vocabulary holds `▁Hund`, `▁hund` and (if it saw enough of them) `▁HUND` as unrelated pieces, so a
model that learnt from sentence-cased text meets an upper-cased sentence as a string of letters it never
saw (issue 73: 0.0 BLEU). Written the inline-casing way (Bérard et al., 2019, the WMT robustness task),
every word is lower-cased and followed by a marker of its case when it had one, so the three spellings share
one piece and differ by one marker:

    "Ein HUND läuft."  ->  "ein\\ue0a1 hund\\ue0a2 läuft."     (pieces: ▁ein ⓣ ▁hund ⓤ ▁läuft .)

A word is a run of letters; a run in Title case (`Hund`, `A`) gets `TITLE`, one in upper case of two letters
or more (`HUND`) gets `UPPER`, a lower-case run nothing. A run of mixed case (`iPhone`, `McDonald`) or one
whose case does not map back exactly (`ß`, whose upper case is `SS`) is kept as written, so `decode(encode(s))`
equals `s` for every text in NFC form. The markers are private-use characters that SentencePiece keeps as
pieces of their own (user-defined symbols, never split or merged); a marker written in the input is
dropped. The tokenizer applies this before SentencePiece and undoes it after, so checkpoints and the
`Translator` need nothing else: a model has inline casing when its vocabulary holds the two markers.
"""

from __future__ import annotations

import re
import unicodedata

TITLE = "\ue0a1"  # after a word written with its first letter in upper case: `hund` + TITLE -> `Hund`
UPPER = "\ue0a2"  # after a word of two letters or more written in upper case: `hund` + UPPER -> `HUND`
MARKERS = (TITLE, UPPER)

_LETTERS = re.compile(r"[^\W\d_]+")  # a run of letters (Unicode \w without digits and the underscore)
_MARKED = re.compile(rf"([^\W\d_]*)([{TITLE}{UPPER}])")  # a run (maybe empty) and the marker after it
_ANY_MARKER = re.compile(f"[{TITLE}{UPPER}]")


def _marked(match: re.Match) -> str:
    word = match.group()
    lower = word.lower()
    if lower == word or len(lower) != len(word):  # lower case already, or a case that changes the length
        return word
    if lower.upper() == word and len(word) > 1:
        return lower + UPPER
    if lower[0].upper() + lower[1:] == word:
        return lower + TITLE
    return word  # mixed case: kept as written


def encode(text: str) -> str:
    """`text` with every cased word lower-cased and followed by its marker (markers in `text` dropped)."""
    if TITLE in text or UPPER in text:
        text = _ANY_MARKER.sub("", text)
    return _LETTERS.sub(_marked, unicodedata.normalize("NFC", text))


def _cased(match: re.Match) -> str:
    word, marker = match.groups()
    if not word:
        return ""  # a marker after no letters (a model may generate one): dropped
    return word.upper() if marker == UPPER else word[0].upper() + word[1:]


def decode(text: str) -> str:
    """The cased text: each marked word in its case, markers after no word dropped."""
    if TITLE not in text and UPPER not in text:
        return text
    return _MARKED.sub(_cased, text)
