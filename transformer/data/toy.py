"""The embedded default corpus: a small German-to-English grammar generated in code.

It is a real translation task in miniature, not copying: German words map to different English words
(many-to-one: der/die/das/den -> the, großer/große/großen -> big), nouns carry gender and case, and
the word order differs (German verb-final subordinate clauses, the perfect participle at the end,
verb-second inversion after an adverb). A model must learn vocabulary, agreement and reordering.
Sentences are drawn with a fixed seed; the held-out splits contain no training sentence.
"""

from __future__ import annotations

import random

# noun: (German, gender, English)
NOUNS = [
    ("Hund", "m", "dog"),
    ("Mann", "m", "man"),
    ("Vogel", "m", "bird"),
    ("Junge", "m", "boy"),
    ("Lehrer", "m", "teacher"),
    ("Koch", "m", "cook"),
    ("Bauer", "m", "farmer"),
    ("Fisch", "m", "fish"),
    ("Katze", "f", "cat"),
    ("Frau", "f", "woman"),
    ("Maus", "f", "mouse"),
    ("Ärztin", "f", "doctor"),
    ("Kuh", "f", "cow"),
    ("Königin", "f", "queen"),
    ("Ente", "f", "duck"),
    ("Schwester", "f", "sister"),
    ("Pferd", "n", "horse"),
    ("Kind", "n", "child"),
    ("Mädchen", "n", "girl"),
    ("Schaf", "n", "sheep"),
    ("Baby", "n", "baby"),
    ("Huhn", "n", "chicken"),
    ("Kaninchen", "n", "rabbit"),
    ("Schwein", "n", "pig"),
]
# adjective: (German stem, English)
ADJECTIVES = [
    ("groß", "big"),
    ("klein", "small"),
    ("alt", "old"),
    ("jung", "young"),
    ("rot", "red"),
    ("schnell", "fast"),
    ("müde", "tired"),
    ("glücklich", "happy"),
    ("hungrig", "hungry"),
    ("braun", "brown"),
    ("weiß", "white"),
    ("laut", "loud"),
    ("still", "quiet"),
    ("stark", "strong"),
]
# verb: (German 3rd person, German participle, English 3rd person, English participle, English base)
VERBS = [
    ("sieht", "gesehen", "sees", "seen", "see"),
    ("hört", "gehört", "hears", "heard", "hear"),
    ("findet", "gefunden", "finds", "found", "find"),
    ("sucht", "gesucht", "seeks", "sought", "seek"),
    ("mag", "gemocht", "likes", "liked", "like"),
    ("kennt", "gekannt", "knows", "known", "know"),
    ("ruft", "gerufen", "calls", "called", "call"),
    ("trifft", "getroffen", "meets", "met", "meet"),
    ("malt", "gemalt", "paints", "painted", "paint"),
    ("fängt", "gefangen", "catches", "caught", "catch"),
    ("füttert", "gefüttert", "feeds", "fed", "feed"),
    ("wäscht", "gewaschen", "washes", "washed", "wash"),
]
PLACES = [
    ("im Park", "in the park"),
    ("im Garten", "in the garden"),
    ("am Fluss", "by the river"),
    ("im Haus", "in the house"),
    ("auf dem Feld", "on the field"),
    ("in der Stadt", "in the town"),
]
ADVERBS = [("heute", "today"), ("morgen", "tomorrow"), ("oft", "often"), ("gestern", "yesterday")]
CLAUSES = [("ich glaube", "I think"), ("sie sagt", "she says"), ("wir wissen", "we know")]

ARTICLE = {
    ("m", "nom"): "der",
    ("m", "acc"): "den",
    ("f", "nom"): "die",
    ("f", "acc"): "die",
    ("n", "nom"): "das",
    ("n", "acc"): "das",
}


def _adjective_ending(gender: str, case: str) -> str:
    # Weak declension after the definite article: -en only for masculine accusative.
    return "en" if (gender, case) == ("m", "acc") else "e"


def _noun_phrase(rng: random.Random, case: str) -> tuple[list[str], list[str]]:
    german, gender, english = rng.choice(NOUNS)
    de, en = [ARTICLE[gender, case]], ["the"]
    if rng.random() < 0.5:
        stem, adjective = rng.choice(ADJECTIVES)
        ending = _adjective_ending(gender, case)
        de.append(stem + ("" if stem.endswith("e") and ending == "e" else ending))
        en.append(adjective)
    return de + [german], en + [english]


def _sentence(rng: random.Random) -> tuple[str, str]:
    subj_de, subj_en = _noun_phrase(rng, "nom")
    obj_de, obj_en = _noun_phrase(rng, "acc")
    present_de, participle_de, present_en, participle_en, base_en = rng.choice(VERBS)
    perfect = rng.random() < 0.4
    # Negation: German "nicht" closes the middle field; English inserts "does not" / "has not".
    negated = rng.random() < 0.25
    nicht = ["nicht"] if negated else []
    if perfect:
        verb_en = ["has", "not", participle_en] if negated else ["has", participle_en]
    else:
        verb_en = ["does", "not", base_en] if negated else [present_en]
    place_de, place_en = rng.choice(PLACES) if rng.random() < 0.3 else ("", "")
    place_de, place_en = place_de.split(), place_en.split()
    form = rng.random()
    if form < 0.35:  # subordinate clause: German verb last, English stays SVO
        intro_de, intro_en = rng.choice(CLAUSES)
        verb_de = [participle_de, "hat"] if perfect else [present_de]
        de = intro_de.split() + [",", "dass"] + subj_de + obj_de + place_de + nicht + verb_de
        en = intro_en.split() + ["that"] + subj_en + verb_en + obj_en + place_en
    elif form < 0.6:  # adverb first: German inverts verb and subject (verb second)
        adverb_de, adverb_en = rng.choice(ADVERBS)
        finite_de, final_de = ("hat", [participle_de]) if perfect else (present_de, [])
        de = [adverb_de, finite_de] + subj_de + obj_de + place_de + nicht + final_de
        en = [adverb_en] + subj_en + verb_en + obj_en + place_en
    else:  # main clause: the participle goes to the end in German
        finite_de, final_de = ("hat", [participle_de]) if perfect else (present_de, [])
        de = subj_de + [finite_de] + obj_de + place_de + nicht + final_de
        en = subj_en + verb_en + obj_en + place_en
    return _finish(de), _finish(en)


def _finish(words: list[str]) -> str:
    text = " ".join(words).replace(" ,", ",") + "."
    return text[0].upper() + text[1:]


def generate(num_train: int, num_valid: int = 500, num_test: int = 500, seed: int = 1234):
    """Return {"train"|"validation"|"test": (src_lines, tgt_lines)}, held-out splits disjoint from train."""
    rng = random.Random(seed)
    seen: set[str] = set()
    splits = {}
    for split, count in (("test", num_test), ("validation", num_valid), ("train", num_train)):
        src, tgt = [], []
        attempts = 0
        while len(src) < count:
            attempts += 1
            if attempts > 50 * count + 1000:
                raise RuntimeError(f"embedded corpus cannot produce {count} distinct {split} sentences")
            de, en = _sentence(rng)
            if split != "train" and de in seen:
                continue
            if split != "train":
                seen.add(de)
            elif de in seen:
                continue
            src.append(de)
            tgt.append(en)
        splits[split] = (src, tgt)
    return splits
