"""Inline casing (data.inline_case): the text transform, and a tokenizer that applies it on the way in and out."""

import pytest

from transformer.data import casing
from transformer.data.casing import TITLE, UPPER
from transformer.data.sources import InMemory
from transformer.data.tokenizer import Tokenizer, build_tokenizer


@pytest.mark.parametrize(
    "text, encoded",
    [
        ("Ein HUND läuft.", f"ein{TITLE} hund{UPPER} läuft."),
        ("I am A DOG", f"i{TITLE} am a{TITLE} dog{UPPER}"),  # one capital letter is title case
        ("DON'T", f"don{UPPER}'t{TITLE}"),
        ("A380 und B-52", f"a{TITLE}380 und b{TITLE}-52"),  # letters only: digits and hyphens end a word
        ("iPhone McDonald", "iPhone McDonald"),  # mixed case: kept as written
        ("Straße STRASSE ß", f"straße{TITLE} strasse{UPPER} ß"),
        ("ÜBER Äpfel", f"über{UPPER} äpfel{TITLE}"),
        ("ΔΈΛΤΑ Δέλτα 中文", f"δέλτα{UPPER} δέλτα{TITLE} 中文"),  # other scripts; caseless letters alone
        ("<2fr> Hallo", f"<2fr> hallo{TITLE}"),  # a language tag is lower case: untouched
        ("", ""),
    ],
)
def test_encode_writes_each_words_case_after_it_in_lower_case_and_decode_restores_it(text, encoded):
    assert casing.encode(text) == encoded
    assert casing.decode(encoded) == text


def test_a_case_that_changes_a_words_length_or_mixes_is_kept_as_written():
    # 'İ' lower-cases to two characters; 'ǅ' (title-case digraph) is neither upper nor lower
    for word in ("İstanbul", "ǅemal", "eBay", "HeLLo"):
        assert casing.encode(word) == word and casing.decode(word) == word


def test_markers_written_in_the_input_are_dropped_and_stray_ones_in_the_output_too():
    assert casing.encode(f"Ein{UPPER} Hund{TITLE}x") == f"ein{TITLE} hundx{TITLE}"
    # a model may write a marker after a space or punctuation, or two in a row: no letters, nothing to case
    assert casing.decode(f"hund{TITLE}{UPPER} {TITLE}, 5{UPPER}") == "Hund , 5"


def test_decoded_text_in_nfd_is_normalised_first_so_accents_stay_on_their_letters():
    decomposed = "E\u0301crit"  # É written as E + combining acute
    assert casing.encode(decomposed) == f"écrit{TITLE}"


@pytest.fixture(scope="module")
def sentences():
    words = ["ein", "Hund", "läuft", "über", "die", "Straße", "der", "Mann", "trägt", "einen", "roten", "Hut"]
    lines = [" ".join(words[(i + k) % len(words)] for k in range(6)).capitalize() + "." for i in range(600)]
    return lines


@pytest.fixture(scope="module")
def cased(sentences, tmp_path_factory):
    cache = tmp_path_factory.mktemp("spm")
    return build_tokenizer(InMemory(sentences, sentences, "u"), vocab_size=120, cache_dir=cache, inline_case=True)


def test_upper_and_title_case_share_the_clean_sentences_pieces_and_differ_by_markers(cased, sentences):
    assert cased.inline_case
    markers = {cased.src.piece_to_id(m) for m in casing.MARKERS}
    line = "Der Mann trägt einen roten Hut."
    variants = [line, line.upper(), line.title(), line.lower()]
    ids = cased.encode_src(variants)
    words = [[i for i in sentence if i not in markers] for sentence in ids]
    assert words[1:] == words[:1] * 3  # the same pieces whatever the case
    assert len(ids[1]) == len(ids[3]) + 6 and len(ids[0]) == len(ids[3]) + 3  # a marker for each cased word
    assert cased.decode_tgt(ids) == variants
    assert cased.decode_src(ids) == variants


def test_the_vocabulary_holds_no_upper_case_letters_of_cased_words_and_the_markers_once(cased):
    pieces = [cased.src.id_to_piece(i) for i in range(cased.src_vocab_size)]
    assert pieces.count(TITLE) == pieces.count(UPPER) == 1
    assert not any(piece != piece.lower() for piece in pieces if piece not in ("<unk>", "<s>", "</s>", "<pad>"))


def test_inline_casing_travels_in_the_model_bytes_and_a_cased_model_has_none(cased, sentences, tmp_path):
    restored = Tokenizer.from_state_dict(cased.state_dict())
    assert restored.inline_case and restored.encode_src(["EIN HUND."]) == cased.encode_src(["EIN HUND."])
    plain = build_tokenizer(InMemory(sentences, sentences, "u"), vocab_size=120, cache_dir=tmp_path)
    assert not plain.inline_case
    assert plain.decode_tgt(plain.encode_tgt(["Ein Hund."])) == ["Ein Hund."]


def test_a_multilingual_inline_cased_vocabulary_keeps_its_tags_next_to_the_special_ids(sentences, tmp_path):
    tok = build_tokenizer(
        InMemory(sentences, sentences, "u"),
        vocab_size=140,
        cache_dir=tmp_path,
        languages=["de", "fr"],
        inline_case=True,
    )
    assert tok.target_languages == ["de", "fr"] and tok.inline_case
    assert tok.protected_ids == 1 + tok.tag_id("fr")  # the markers come after: word dropout may drop them
    assert min(tok.src.piece_to_id(m) for m in casing.MARKERS) >= tok.protected_ids
    (ids,) = tok.encode_src(["EIN <2de> Hund."], tgt_lang="fr")
    assert ids[0] == tok.tag_id("fr") and tok.tag_id("de") not in ids  # a written tag stays text
    (ids,) = tok.encode_src(["EIN Hund."], tgt_lang="fr")
    assert tok.decode_src([ids[1:]]) == ["EIN Hund."]


def test_sampled_segmentations_are_written_with_inline_case_too(cased):
    import numpy as np

    from transformer.data.subword import SubwordSampling

    class Stored:
        pair_index = np.arange(2)

        def text(self, side, pairs):
            return ["DER MANN trägt", "Ein Hut"]

    sampling = SubwordSampling(cased.state_dict(), alpha=0.1, nbest=-1, seed=1, max_len=None)
    src, tgt = sampling.segment(Stored(), np.arange(2), epoch=0)
    assert cased.decode_src(src) == cased.decode_tgt(tgt) == ["DER MANN trägt", "Ein Hut"]
    assert cased.src.piece_to_id(UPPER) in src[0] and cased.src.piece_to_id(TITLE) in tgt[1]


def test_the_transformers_export_refuses_an_inline_cased_model_in_one_line(cased):
    from transformer.config import Config
    from transformer.inference.hf_export import refusal

    assert "data.inline_case=true" in refusal(Config(), cased)
