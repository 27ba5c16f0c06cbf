"""The text modifiers of data/augment.py on hand-made sentences (what each changes and what it must leave
alone: tokens, short words, digits and punctuation, the length limit of a merge), the variants the evaluation
scores, and the seeding that makes a pair's draws a pure function of (seed, epoch, pair)."""

import re

import pytest

from transformer.data.augment import (
    NEIGHBOUR_KEYS,
    VARIANTS,
    augment_pairs,
    merge,
    merge_consecutive,
    nopunct,
    rng_for,
    title,
    typos,
    upper,
    variant_names,
)
from transformer.data.tokenizer import LANGUAGE_TAG

TAG = LANGUAGE_TAG.format("fr")  # <2fr>
SENTENCE = f"{TAG} Der große Hund rennt über die grüne Wiese, 2024 <unk> mal!"


def rngs(count: int, seed: int = 7):
    return [rng_for(seed, 0, pair) for pair in range(count)]


def test_upper_changes_every_letter_but_not_tags_or_special_pieces_and_is_idempotent():
    text = f"{TAG} ein hund <unk> läuft über </s> die straße <s> <pad>"
    assert upper(text) == f"{TAG} EIN HUND <unk> LÄUFT ÜBER </s> DIE STRASSE <s> <pad>"
    assert upper(upper(text)) == upper(text)
    assert upper("a < b > c") == "A < B > C"  # angle brackets with spaces inside are text, not a token


def test_title_upper_cases_each_words_first_letter_and_keeps_the_rest():
    text = f'{TAG} ein (kleiner) hund, "sagt" er: 2nd USA l\'homme <unk> iPhone'
    assert title(text) == f'{TAG} Ein (Kleiner) Hund, "Sagt" Er: 2nd USA L\'homme <unk> IPhone'
    assert title(title(text)) == title(text)
    assert title("über äpfel") == "Über Äpfel"


def _one_edit(before: str, after: str) -> str | None:
    """The kind of the single typo that makes `after` from `before`, None when it is not one."""
    if len(after) == len(before) - 1 and any(before[:i] + before[i + 1 :] == after for i in range(len(before))):
        return "drop"
    if len(after) == len(before) + 1:
        for i in range(len(before)):
            if after[: i + 1] + after[i + 2 :] == before:
                added, previous = after[i + 1].lower(), before[i].lower()
                if added == previous:
                    return "repeat"
                if added in NEIGHBOUR_KEYS.get(previous, ""):
                    return "insert"
        return None
    if len(after) != len(before):
        return None
    differ = [i for i in range(len(before)) if before[i] != after[i]]
    if len(differ) == 1 and after[differ[0]].lower() in NEIGHBOUR_KEYS.get(before[differ[0]].lower(), ""):
        return "neighbour"
    if len(differ) == 2 and differ[1] == differ[0] + 1:
        i = differ[0]
        if (before[i].lower(), before[i + 1].lower()) == (after[i + 1].lower(), after[i].lower()):
            return "swap"
    return None


def test_typos_at_rate_one_misspell_each_long_word_once_and_nothing_else():
    words = SENTENCE.split(" ")
    kinds = set()
    for rng in rngs(60):
        noised = typos(SENTENCE, rng, rate=1.0).split(" ")
        assert len(noised) == len(words)
        for before, after in zip(words, noised):
            letters = re.sub(r"[^\w]|\d", "", before)
            if before in (TAG, "<unk>") or len(letters) <= 3:  # the tags, Der, die, 2024, mal!
                assert after == before
            else:
                core, mark = (before[:-1], before[-1]) if before.endswith(",") else (before, "")
                assert after.endswith(mark), (before, after)  # punctuation is not a letter
                kind = _one_edit(core, after.removesuffix(mark) if mark else after)
                assert kind is not None, (before, after)
                kinds.add(kind)
    assert kinds == {"swap", "drop", "insert", "repeat", "neighbour"}


def test_each_kind_of_typo_on_its_own():
    def results(kind):
        return {typos("Hund", rng, rate=1.0, kinds=[kind]) for rng in rngs(80)}

    assert results("swap") == {"Uhnd", "Hnud", "Hudn"}  # the capital stays in front
    assert results("drop") == {"und", "Hnd", "Hud", "Hun"}
    assert results("repeat") == {"Hhund", "Huund", "Hunnd", "Hundd"}
    assert all(_one_edit("Hund", result) == "insert" for result in results("insert"))
    neighbours = results("neighbour")
    assert len(neighbours) > 4 and all(_one_edit("Hund", result) == "neighbour" for result in neighbours)
    firsts = {result[0] for result in neighbours}
    assert firsts - {"H"} and all(first.isupper() for first in firsts)  # a capital's neighbour is a capital
    assert typos("HUND", rng_for(1, 0, 0), 1.0, ["repeat"]).isupper()


def test_typos_leave_words_they_cannot_change_and_refuse_bad_settings():
    greek = "Ωμέγα λέξη"  # no key of these is on the keyboards
    assert typos(greek, rng_for(1, 0, 0), rate=1.0, kinds=["neighbour", "insert"]) == greek
    assert typos("Aaaa", rng_for(1, 0, 0), rate=1.0, kinds=["swap"]) == "Aaaa"  # no two letters differ
    assert typos(SENTENCE, rng_for(1, 0, 0), rate=0.0) == SENTENCE
    with pytest.raises(ValueError, match=r"^typos: rate=1.5; give a probability between 0 and 1$"):
        typos(SENTENCE, rng_for(1, 0, 0), rate=1.5)
    with pytest.raises(ValueError, match=r"^typos: kinds=\['swaps'\]; give some of swap, drop, insert"):
        typos(SENTENCE, rng_for(1, 0, 0), kinds=["swaps"])


def test_the_evaluation_rate_misspells_about_one_long_word_in_ten():
    text = " ".join(["Straße", "Hund", "Katze", "Wiese", "ein", "der"] * 400)  # 1,600 long words
    noised = typos(text, rng_for(3, 0, 0)).split(" ")
    changed = sum(a != b for a, b in zip(text.split(" "), noised))
    assert 0.08 < changed / 1600 < 0.12
    assert all(a == b for a, b in zip(text.split(" "), noised) if len(a) <= 3)


def test_the_keyboard_is_qwerty_and_qwertz_together():
    assert NEIGHBOUR_KEYS["a"] == "qswyz"  # z below a on QWERTY, y on QWERTZ
    assert NEIGHBOUR_KEYS["ö"] == "lpäü"
    assert "z" in NEIGHBOUR_KEYS["t"] and "y" in NEIGHBOUR_KEYS["t"]
    assert all(key not in near for key, near in NEIGHBOUR_KEYS.items())


def test_nopunct_removes_the_final_marks_only():
    assert nopunct("Ein Hund rennt.") == "Ein Hund rennt"
    assert nopunct("Was ist das ?!") == "Was ist das"
    assert nopunct("Und dann ...") == "Und dann"
    assert nopunct("Er sagt: „Hallo.“") == "Er sagt: „Hallo.“"  # ends in a quote
    assert nopunct("Ein Hund, eine Katze") == "Ein Hund, eine Katze"
    assert nopunct(f"{TAG} Un chien.") == f"{TAG} Un chien"
    assert nopunct("Ende </s>") == "Ende </s>"
    assert nopunct(nopunct("Ja.")) == "Ja"


def test_the_nopunct_variant_removes_the_references_marks_where_the_sources_were_removed():
    variant = VARIANTS["nopunct"]
    rng = rng_for(1, 0, 0)
    assert variant(("Ein Hund.", "A dog!"), rng) == ("Ein Hund", "A dog")  # whichever marks the reference has
    assert variant(("Ein Hund", "A dog."), rng) == ("Ein Hund", "A dog.")  # the source had none: kept


def test_merge_joins_pairs_within_the_limit():
    pairs = [("Ein Hund.", "A dog."), ("Eine Katze.", "A cat."), ("Ein Vogel.", "A bird.")]
    assert merge(pairs[:2], 40) == ("Ein Hund. Eine Katze.", "A dog. A cat.")
    assert merge(pairs, 40) == ("Ein Hund. Eine Katze. Ein Vogel.", "A dog. A cat. A bird.")
    assert merge(pairs, 31) is None  # the source would be 32 characters
    assert merge(pairs, 32) is not None
    assert merge(pairs, lambda pair: len(pair[1].split()) <= 4) is None  # a limit in words
    assert merge(pairs[:2], lambda pair: len(pair[1].split()) <= 4) == ("Ein Hund. Eine Katze.", "A dog. A cat.")
    with pytest.raises(ValueError, match="give two or more consecutive pairs"):
        merge(pairs[:1], 100)


def test_merge_keeps_one_language_tag_and_never_mixes_target_languages():
    fr = [(f"{TAG} A dog.", "Un chien."), (f"{TAG} A cat.", "Un chat.")]
    assert merge(fr, 100) == (f"{TAG} A dog. A cat.", "Un chien. Un chat.")
    assert merge([fr[0], ("<2de> A cat.", "Eine Katze.")], 100) is None
    assert merge([fr[0], ("A cat.", "Un chat.")], 100) is None


def test_merge_consecutive_keeps_every_pair_once_in_order_within_the_limit():
    pairs = [(f"Satz {i}.", f"Sentence {i}.") for i in range(40)]
    for limit in (10_000, 30):
        merged = merge_consecutive(pairs, rng_for(5, 0, 0), probability=0.5, limit=limit)
        assert " ".join(src for src, _ in merged) == " ".join(src for src, _ in pairs)
        assert " ".join(ref for _, ref in merged) == " ".join(ref for _, ref in pairs)
        assert all(len(src) <= limit and len(ref) <= limit for src, ref in merged)
        sizes = [src.count(".") for src, _ in merged]
        assert set(sizes) <= {1, 2, 3} and any(size > 1 for size in sizes)
    always = merge_consecutive(pairs, rng_for(5, 0, 0), probability=1.0, limit=10_000)
    assert {src.count(".") for src, _ in always[:-1]} <= {2, 3}
    assert merge_consecutive(pairs, rng_for(5, 0, 0), probability=0.0, limit=10_000) == pairs
    assert merge_consecutive(pairs, rng_for(5, 0, 0), probability=1.0, limit=5) == pairs  # nothing fits


def test_a_pairs_draws_are_a_function_of_seed_epoch_and_pair():
    pair = (SENTENCE, "The big dog runs over the green meadow, 2024 times!")
    for name, variant in VARIANTS.items():
        assert variant(pair, rng_for(1, 2, 3)) == variant(pair, rng_for(1, 2, 3)), name
    draws = rng_for(1, 2, 3).random(8).tolist()
    assert draws == rng_for(1, 2, 3).random(8).tolist()
    for other in ((1, 2, 4), (1, 3, 3), (2, 2, 3)):
        assert rng_for(*other).random(8).tolist() != draws, other
    assert len({typos(SENTENCE, rng_for(1, 2, pair), 0.5) for pair in range(10)}) > 5  # each pair its own draws
    with pytest.raises(ValueError, match=r"^rng_for: epoch=-1; give a whole number of 0 or more$"):
        rng_for(1, -1, 0)


def test_the_variants_noise_the_reference_as_the_target_side_would_be():
    source, reference = "der hund läuft schnell weg.", "the dog runs away quickly."
    rng = rng_for(1, 0, 0)
    assert VARIANTS["upper"]((source, reference), rng) == (source.upper(), reference.upper())
    assert VARIANTS["title"]((source, reference), rng) == (
        "Der Hund Läuft Schnell Weg.",
        "The Dog Runs Away Quickly.",
    )
    assert VARIANTS["typos"]((source, reference), rng)[1] == reference
    sources, references = augment_pairs([source] * 60, [reference] * 60, "mix", seed=4)
    seen = set()
    for src, ref in zip(sources, references):
        if ref == reference.upper():
            assert src == source.upper()
            seen.add("upper")
        elif ref == "The Dog Runs Away Quickly.":
            assert src == "Der Hund Läuft Schnell Weg."
            seen.add("title")
        elif ref == reference.removesuffix("."):
            assert src == source.removesuffix(".")
            seen.add("nopunct")
        else:  # typos: the reference as it was
            assert ref == reference and src.endswith(".") and src.islower()
            seen.add("typos")
    assert seen == {"upper", "title", "nopunct", "typos"}


def test_a_noised_split_repeats_with_its_seed_and_each_pair_on_its_own():
    sources = [f"Der große Hund Nummer {i} rennt über die Wiese." for i in range(30)]
    references = [f"The big dog number {i} runs over the meadow." for i in range(30)]
    first = augment_pairs(sources, references, "mix", seed=1)
    assert augment_pairs(sources, references, "mix", seed=1) == first
    assert augment_pairs(sources, references, "mix", seed=2) != first
    head = augment_pairs(sources[:10], references[:10], "mix", seed=1)
    assert head == (first[0][:10], first[1][:10])  # a pair's copy does not depend on the pairs after it


def test_variant_names_are_checked():
    assert variant_names("upper, title,mix") == ["upper", "title", "mix"]
    assert list(VARIANTS) == ["upper", "title", "typos", "nopunct", "mix"]
    with pytest.raises(ValueError, match=r"^'caps' is not a variant; the variants: upper, title, typos, nopunct, mix$"):
        variant_names("upper,caps")
    with pytest.raises(ValueError, match=r"^'upper' is given twice; give each variant once$"):
        variant_names("upper,upper")
