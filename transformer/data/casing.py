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

With a table of the words usually written in Title case (`data.usual_case`: learnt from the training text
with the vocabulary, `usual_titles`), such a word carries no marker when it is in Title case and `LOWER`
when it is not; every other word is marked as above. German writes every noun in Title case: marking them
all made a German sentence of 11 words 4.5 pieces longer, and a batch of the same token budget held a
quarter fewer pairs. With the table, `decode(encode(s, titles), titles) == s` still holds.

With a lower-case source (`data.lowercase_source`, `encode_source`), the source side is written without the
Title-case markers: every word in lower case, a word in upper case followed by `UPPER` as above, and a
sentence written wholly in upper case or in Title case (`sentence_case`) ends with one marker that says so
(`SENTENCE_UPPER`, `SENTENCE_TITLE`) instead of a marker for each word. The target keeps inline casing, so the
model still writes cased text; the source of a German sentence is then as long as it is without casing
(14.5 pieces a Multi30k sentence against 18.9 with a marker for each noun). What the source loses: the case
of a word that is neither upper case nor in a sentence that is (`Essen` and `essen` read alike, as do
`iPhone` and `iphone`). A word whose lower case would not come back (`İstanbul`, `GROẞE`) is kept as
written, as `encode` keeps it. `decode_source` gives the text back in that normalised case.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Iterable

TITLE = "\ue0a1"  # after a word written with its first letter in upper case: `hund` + TITLE -> `Hund`
UPPER = "\ue0a2"  # after a word of two letters or more written in upper case: `hund` + UPPER -> `HUND`
LOWER = "\ue0a3"  # with a table of usual titles: after a word in it written in lower case
SENTENCE_UPPER = "\ue0a4"  # at the end of a lower-case source: the whole sentence was in upper case
SENTENCE_TITLE = "\ue0a5"  # at the end of a lower-case source: every word started with a capital
MARKERS = (TITLE, UPPER)  # a vocabulary with both has inline casing; LOWER too where it has a table
ALL_MARKERS = (TITLE, UPPER, LOWER)
SOURCE_MARKERS = (SENTENCE_UPPER, SENTENCE_TITLE)  # a vocabulary with both writes its sources in lower case
MIN_TITLE_WORDS = 3  # a sentence of fewer words is never taken for Title case (`Zwei Hunde` is German as usual)

_LETTERS = re.compile(r"[^\W\d_]+")  # a run of letters (Unicode \w without digits and the underscore)
# a run of letters and the marker after it, either maybe missing (never both: the lookahead wants one)
_RUN_AND_MARKER = re.compile(rf"(?=[^\W\d_]|[{TITLE}{UPPER}{LOWER}])([^\W\d_]*)([{TITLE}{UPPER}{LOWER}]?)")
EVERY_MARKER = ALL_MARKERS + SOURCE_MARKERS
_ANY_MARKER = re.compile(f"[{''.join(EVERY_MARKER)}]")
_SENTENCE_MARKER = re.compile(f"[{''.join(SOURCE_MARKERS)}]")
# a word (a run of non-spaces): its leading marks (`(`, `"`), then its first letter, where Title case puts a capital
_WORD_START = re.compile(r"(?<!\S)([^\w\s]*)([^\W\d_])")
NO_TITLES: frozenset[str] = frozenset()


def _case_of(word: str) -> str:
    """'lower', 'upper' (two letters or more), 'title' or 'as written' (mixed case, or a case whose lower
    case changes the word's length)."""
    lower = word.lower()
    if len(lower) != len(word):
        return "as written"
    if lower == word:
        return "lower"
    if lower.upper() == word and len(word) > 1:
        return "upper"
    if lower[0].upper() + lower[1:] == word:
        return "title"
    return "as written"


def encode(text: str, titles: frozenset[str] = NO_TITLES) -> str:
    """`text` with every cased word lower-cased and followed by its marker (markers in `text` dropped);
    a word of `titles` (lower case) in Title case unmarked, in lower case marked `LOWER`."""

    def marked(match: re.Match) -> str:
        word = match.group()
        case = _case_of(word)
        if case == "lower":
            return word + LOWER if word in titles else word
        if case == "as written":
            return word
        lower = word.lower()
        if case == "upper":
            return lower + UPPER
        return lower if lower in titles else lower + TITLE

    return _LETTERS.sub(marked, unicodedata.normalize("NFC", _without_markers(text)))


def decode(text: str, titles: frozenset[str] = NO_TITLES) -> str:
    """The cased text: each marked word in its case, markers after no word dropped; with `titles`, an
    unmarked word of them in Title case."""

    def cased(match: re.Match) -> str:
        word, marker = match.groups()
        if not marker:
            return word[0].upper() + word[1:] if word in titles else word
        if not word or marker == LOWER:
            return word  # a marker after no letters (a model may generate one): dropped
        return word.upper() if marker == UPPER else word[0].upper() + word[1:]

    if not titles and not any(marker in text for marker in EVERY_MARKER):
        return text
    text = _SENTENCE_MARKER.sub("", text)  # a sentence's marker (of a source) means nothing in a target
    return _RUN_AND_MARKER.sub(cased, text)


def _without_markers(text: str) -> str:
    """`text` without any marker written in it (the input's own are dropped, never read)."""
    return _ANY_MARKER.sub("", text) if any(marker in text for marker in EVERY_MARKER) else text


def title_words(text: str) -> str:
    """Each word's first letter (after its leading marks; a word starting with a digit left alone) in title
    case, the rest as it was: Title Case as people type it, `USA` kept."""
    return _WORD_START.sub(lambda start: start[1] + start[2].title(), text)


def sentence_case(text: str) -> str:
    """'upper' (two letters or more, every one in upper case: a letter without case, as in Chinese or Arabic,
    makes a sentence with an acronym no upper-case sentence), 'title' (not upper; at least MIN_TITLE_WORDS
    words start with a letter and each of them with a capital) or 'as written'."""
    letters = [c for c in text if c.isalpha()]
    if len(letters) >= 2 and all(c.isupper() for c in letters):
        return "upper"
    firsts = [start[2] for start in _WORD_START.finditer(text)]
    if len(firsts) >= MIN_TITLE_WORDS and all(c.isupper() for c in firsts):
        return "title"
    return "as written"


def encode_source(text: str) -> str:
    """`text` in lower case, each upper-case word followed by `UPPER`, and a sentence in upper case or Title
    case followed by `SENTENCE_UPPER` or `SENTENCE_TITLE` instead (markers in `text` dropped):

        "Ein HUND läuft."  ->  "ein hund\ue0a2 läuft."      "EIN HUND LÄUFT."  ->  "ein hund läuft.\ue0a4"
    """

    def marked(match: re.Match) -> str:
        word = match.group()
        return _source_word(word) + (UPPER if _case_of(word) == "upper" else "")

    text = unicodedata.normalize("NFC", _without_markers(text))
    case = sentence_case(text)
    if case == "upper":
        return _LETTERS.sub(lambda match: _source_word(match.group()), text) + SENTENCE_UPPER
    return _LETTERS.sub(marked, text) + (SENTENCE_TITLE if case == "title" else "")


def _source_word(word: str) -> str:
    """A word of a lower-case source: in lower case, except where that would not come back as it was
    written: a lower case of another length (`İ` is `i` and a combining dot, which no vocabulary of the
    sentence-cased text holds) or, in a word without a lower-case letter, one whose upper case differs
    (`GROẞE` would come back `GROSSE`). Those are kept as written, as `encode` keeps them."""
    lower = word.lower()
    if len(lower) != len(word) or (lower.upper() != word and not any(c.islower() for c in word)):
        return word
    return lower


def decode_source(text: str) -> str:
    """A lower-case source's text in the case `encode_source` wrote it with: upper-case words and sentences
    in upper case, a Title-case sentence with a capital at the start of each word, the rest in lower case."""
    sentence = text[-1:] if text[-1:] in SOURCE_MARKERS else ""
    text = decode(_SENTENCE_MARKER.sub("", text))
    if sentence == SENTENCE_UPPER:
        return text.upper()
    if sentence == SENTENCE_TITLE:
        return title_words(text)
    return text


def usual_titles(lines: Iterable[str], min_count: int = 2) -> list[str]:
    """The words (in lower case, sorted) that `lines` write in Title case at least `min_count` times and
    more often than in lower case, each line's first word not counted (a sentence starts with a capital
    whatever the word). Upper-case and mixed-case spellings count for neither."""
    title, lower = Counter(), Counter()
    for line in lines:
        for n, match in enumerate(_LETTERS.finditer(unicodedata.normalize("NFC", line))):
            if n == 0:
                continue
            word = match.group()
            case = _case_of(word)
            if case == "title":
                title[word.lower()] += 1
            elif case == "lower":
                lower[word] += 1
    return sorted(word for word, count in title.items() if count >= min_count and count > lower[word])
