"""Text modifiers that make noised copies of sentence pairs (issue 73): upper case, title case, typos, removed
end punctuation, merged pairs; the variants the evaluation scores (`VARIANTS`), and the seeding that makes a
pair's draws a pure function of (seed, epoch, pair) (`rng_for`).

Each modifier is a pure function of its text (or pair) and a numpy Generator; those that draw nothing take
one too, so that every modifier is called alike. Text that is a token rather than words is never changed: a
language tag (`<2fr>`, tokenizer.LANGUAGE_TAG) and a special piece's text (`<unk>`, `<s>`, `</s>`, `<pad>`),
that is any `<...>` without a space inside, is copied through as it is.

Decisions, each for a reason:
- Title case upper-cases the first letter of each word (a run of non-spaces; leading marks such as `(` or
  `"` skipped, a word starting with a digit left alone) and keeps the rest, so `USA` stays `USA`: it is
  how people type Title Case, and it makes `title(title(x)) == title(x)`.
- Typos hit only words of more than three letters (a word: a run of letters, so punctuation and digits are
  never touched), each with probability `rate`, by one of five kinds: two neighbouring letters swapped (the
  case stays with the position: `Hund` -> `Uhnd`), a letter dropped, a neighbouring key inserted after a
  letter, a letter repeated, a letter replaced by a neighbouring key. The keyboard is the union of QWERTY
  and German QWERTZ (with ü, ö, ä), since the project's first corpora are English and German. An
  inserted letter takes the case of the word (upper in an upper-case word, else lower).
- End punctuation: the run of sentence-final marks (`. ! ? … ; :` and their CJK forms) at the very end,
  with the spaces before it; a sentence ending in a quote or bracket keeps its marks. A pair loses the
  reference's final marks whenever the source lost its own, whichever marks the reference ends with (a
  translation may end `!` where the source ends `.`): a source without end punctuation then asks for a
  translation without it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from transformer.data import casing

Pair = tuple[str, str]
Generator = np.random.Generator

# A token in the text (a language tag, a special piece): a capture group, so that re.split keeps it.
_TOKEN = re.compile(r"(<[^<>\s]+>)")
_LEADING_TAG = re.compile(r"\s*(<2[^<>\s]+>)\s*")
_WORD = re.compile(r"[^\W\d_]+")  # a run of letters
_END_PUNCTUATION = re.compile(r"\s*[.!?…;:。！？；：]+\s*$")

TYPO_KINDS = ("swap", "drop", "insert", "repeat", "neighbour")
EVALUATION_TYPO_RATE = 0.1  # the evaluation's fixed rate: 10% of the words longer than three letters
EVALUATION_SEED = 1  # transformer-evaluate --augment-seed: the same noised copies unless told otherwise
MERGE_SIZES = (2, 3)

_LAYOUTS = {
    "qwerty": ("qwertyuiop", "asdfghjkl", "zxcvbnm"),
    "qwertz": ("qwertzuiopü", "asdfghjklöä", "yxcvbnm"),
}


def _neighbour_keys() -> dict[str, str]:
    """Each key's neighbours on either layout: left and right in its row, the two keys above it and the
    two below (rows are staggered: key i touches keys i and i+1 of the row above, i-1 and i below)."""
    neighbours: dict[str, set[str]] = {}
    for rows in _LAYOUTS.values():
        for r, row in enumerate(rows):
            for i, key in enumerate(row):
                near = [(r, i - 1), (r, i + 1), (r - 1, i), (r - 1, i + 1), (r + 1, i - 1), (r + 1, i)]
                for row_index, key_index in near:
                    if 0 <= row_index < len(rows) and 0 <= key_index < len(rows[row_index]):
                        neighbours.setdefault(key, set()).add(rows[row_index][key_index])
    return {key: "".join(sorted(near - {key})) for key, near in neighbours.items()}  # sorted: draws repeat


NEIGHBOUR_KEYS = _neighbour_keys()


def rng_for(seed: int, epoch: int, pair: int, stream: int = 0) -> Generator:
    """The Generator of one pair's augmentation: a pure function of (seed, epoch, pair), whatever order
    pairs are drawn in, whichever worker or rank draws them, and after a resume. `stream` tells apart the
    corpora of a mixture (0: the first, or a corpus alone)."""
    for name, value in (("seed", seed), ("epoch", epoch), ("pair", pair), ("stream", stream)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"rng_for: {name}={value!r}; give a whole number of 0 or more")
    return np.random.default_rng([int(seed), int(epoch), int(pair)] + ([int(stream)] if stream else []))


def _on_words(text: str, change: Callable[[str], str]) -> str:
    """`change` applied to the text between tokens (tags, special pieces); the tokens kept as they are."""
    parts = _TOKEN.split(text)  # [text, token, text, token, ..., text]
    return "".join(part if i % 2 else change(part) for i, part in enumerate(parts))


def upper(text: str, rng: Generator | None = None) -> str:
    """The text in upper case, tokens kept."""
    return _on_words(text, str.upper)


def title(text: str, rng: Generator | None = None) -> str:
    """Each word's first letter in upper (title) case, the rest as it was; tokens kept."""
    return _on_words(text, casing.title_words)


def typos(text: str, rng: Generator, rate: float = EVALUATION_TYPO_RATE, kinds: Sequence[str] = TYPO_KINDS) -> str:
    """Each word of more than three letters misspelt with probability `rate`, by one of `kinds` (drawn;
    another where the drawn one cannot change the word, e.g. no letter of it is on the keyboard)."""
    if not 0 <= rate <= 1:
        raise ValueError(f"typos: rate={rate!r}; give a probability between 0 and 1")
    unknown = [kind for kind in kinds if kind not in _TYPO]
    if unknown or not kinds:
        raise ValueError(f"typos: kinds={list(kinds)!r}; give some of {', '.join(TYPO_KINDS)}")

    def misspell(match: re.Match) -> str:
        word = match[0]
        if len(word) <= 3 or rng.random() >= rate:
            return word
        for kind in rng.permutation(list(kinds)):
            changed = _TYPO[str(kind)](word, rng)
            if changed is not None:
                return changed
        return word

    return _on_words(text, lambda part: _WORD.sub(misspell, part))


def _like(letter: str, model: str) -> str:
    """`letter` in the case of `model` (a letter or a word): upper where it is upper case, else lower; as
    it is where that case is not one letter (`ß`.upper() is `SS`), so a typo never adds two letters."""
    changed = letter.upper() if model.isupper() else letter.lower()
    return changed if len(changed) == 1 else letter


def _swap(word: str, rng: Generator) -> str | None:
    positions = [i for i in range(len(word) - 1) if word[i].lower() != word[i + 1].lower()]
    if not positions:
        return None
    i = positions[rng.integers(len(positions))]
    return word[:i] + _like(word[i + 1], word[i]) + _like(word[i], word[i + 1]) + word[i + 2 :]


def _drop(word: str, rng: Generator) -> str:
    i = rng.integers(len(word))
    return word[:i] + word[i + 1 :]


def _key_and_neighbour(word: str, rng: Generator) -> tuple[int, str] | None:
    """A position of `word` whose letter is on the keyboard, and one of that key's neighbours (lower case)."""
    positions = [i for i, letter in enumerate(word) if letter.lower() in NEIGHBOUR_KEYS]
    if not positions:
        return None
    i = positions[rng.integers(len(positions))]
    near = NEIGHBOUR_KEYS[word[i].lower()]
    return i, near[rng.integers(len(near))]


def _insert(word: str, rng: Generator) -> str | None:
    picked = _key_and_neighbour(word, rng)
    if picked is None:
        return None
    i, near = picked
    return word[: i + 1] + _like(near, word) + word[i + 1 :]


def _repeat(word: str, rng: Generator) -> str:
    i = rng.integers(len(word))
    return word[: i + 1] + _like(word[i], word) + word[i + 1 :]


def _neighbour(word: str, rng: Generator) -> str | None:
    picked = _key_and_neighbour(word, rng)
    if picked is None:
        return None
    i, near = picked
    return word[:i] + _like(near, word[i]) + word[i + 1 :]


_TYPO: dict[str, Callable[[str, Generator], str | None]] = {
    "swap": _swap,
    "drop": _drop,
    "insert": _insert,
    "repeat": _repeat,
    "neighbour": _neighbour,
}


def nopunct(text: str, rng: Generator | None = None) -> str:
    """The text without its final punctuation marks (and the spaces around them); a text ending in a token
    or without such marks is returned unchanged."""
    return _END_PUNCTUATION.sub("", text)  # a token ends in `>`, never in one of these marks


def merge(pairs: Sequence[Pair], limit: int | Callable[[Pair], bool]) -> Pair | None:
    """Two or more consecutive pairs joined into one, each side's sentences with a space between, or None
    when the result breaks `limit`: a number of characters neither side may exceed, or a callable that says
    whether a merged pair is acceptable (one counting tokens, say). Sources that start with a language tag
    keep the first one only; pairs into different languages are never merged (None)."""
    if len(pairs) < 2:
        raise ValueError(f"merge: {len(pairs)} pair(s); give two or more consecutive pairs")
    tags = [_LEADING_TAG.match(src) for src, _ in pairs]
    if len({tag[1] if tag else None for tag in tags}) > 1:
        return None
    sources = [src[tag.end() :] if tag and i else src for i, (tag, (src, _)) in enumerate(zip(tags, pairs))]
    merged = (" ".join(s.strip() for s in sources), " ".join(ref.strip() for _, ref in pairs))
    fits = limit(merged) if callable(limit) else max(map(len, merged)) <= limit
    return merged if fits else None


def merge_consecutive(
    pairs: Sequence[Pair],
    rng: Generator,
    probability: float,
    limit: int | Callable[[Pair], bool],
    sizes: Sequence[int] = MERGE_SIZES,
) -> list[Pair]:
    """`pairs` in order, where each pair with probability `probability` starts a merge of the next few (a
    number drawn from `sizes`; fewer where that many would break `limit`, the pair alone where even two
    would). Every input pair is in the output exactly once, alone or merged."""
    if not 0 <= probability <= 1:
        raise ValueError(f"merge: probability={probability!r}; give a probability between 0 and 1")
    out, i = [], 0
    while i < len(pairs):
        taken = 1
        if rng.random() < probability:
            for size in range(int(sizes[rng.integers(len(sizes))]), 1, -1):
                merged = merge(pairs[i : i + size], limit) if i + size <= len(pairs) else None
                if merged is not None:
                    out.append(merged)
                    taken = size
                    break
        if taken == 1:
            out.append(pairs[i])
        i += taken
    return out


@dataclass(frozen=True)
class Variant:
    """A noised copy of a pair: `source` changes the source, `reference` the reference (None: kept as it
    is); with `follows_source`, the reference is changed only where the source was."""

    name: str
    source: Callable[[str, Generator], str]
    reference: Callable[[str, Generator], str] | None = None
    follows_source: bool = False

    def __call__(self, pair: Pair, rng: Generator) -> Pair:
        src, ref = pair
        noised = self.source(src, rng)
        if self.reference is not None and (noised != src or not self.follows_source):
            ref = self.reference(ref, rng)
        return noised, ref


@dataclass(frozen=True)
class Mix:
    """Each pair noised by one of `variants`, drawn per pair."""

    name: str
    variants: tuple[Variant, ...]

    def __call__(self, pair: Pair, rng: Generator) -> Pair:
        return self.variants[rng.integers(len(self.variants))](pair, rng)


_SINGLE = (
    Variant("upper", upper, upper),
    Variant("title", title, title),
    Variant("typos", typos),  # the evaluation's rate; the reference is what the clean source means
    Variant("nopunct", nopunct, nopunct, follows_source=True),
)
VARIANTS: dict[str, Variant | Mix] = {variant.name: variant for variant in _SINGLE} | {"mix": Mix("mix", _SINGLE)}


def variant_names(text: str) -> list[str]:
    """`upper,title,typos` -> the names, each once; ValueError naming a bad one and the known ones."""
    names = [name.strip() for name in text.split(",")]
    for name in names:
        if name not in VARIANTS:
            raise ValueError(f"{name!r} is not a variant; the variants: {', '.join(VARIANTS)}")
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice:
        raise ValueError(f"{twice!r} is given twice; give each variant once")
    return names


def augment_pairs(sources: Sequence[str], references: Sequence[str], name: str, seed: int) -> tuple[list, list]:
    """Noised copies of a split by the variant `name`: pair i drawn from `rng_for(seed, 0, i)`, so the same
    seed gives the same copy, and a pair's copy does not depend on the pairs around it."""
    variant = VARIANTS[name]
    noised = [variant(pair, rng_for(seed, 0, i)) for i, pair in enumerate(zip(sources, references))]
    return [src for src, _ in noised], [ref for _, ref in noised]
