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


TITLES = frozenset(["hund", "mann", "straße", "i"])


@pytest.mark.parametrize(
    "text, encoded",
    [
        ("Ein Hund läuft.", f"ein{TITLE} hund läuft."),  # a usual title: no marker
        ("ein hund", f"ein hund{casing.LOWER}"),  # a usual title in lower case: marked
        ("EIN HUND", f"ein{UPPER} hund{UPPER}"),
        ("Der Mann und I", f"der{TITLE} mann und i"),  # "I" is one capital: title case
        ("Straße, STRASSE, eBay", f"straße, strasse{UPPER}, eBay"),
        ("", ""),
    ],
)
def test_with_a_table_of_usual_titles_only_the_words_off_their_usual_case_are_marked(text, encoded):
    assert casing.encode(text, TITLES) == encoded
    assert casing.decode(encoded, TITLES) == text


def test_the_round_trip_holds_with_a_table_for_every_spelling_of_every_word():
    words = ["hund", "Hund", "HUND", "hUnd", "mann", "Mann", "katze", "Katze", "KATZE", "i", "I", "a", "A", "ß"]
    for first in words:
        for second in words:
            text = f"{first} {second}-{first}, 5{second}."
            assert casing.decode(casing.encode(text, TITLES), TITLES) == text
            assert casing.decode(casing.encode(text)) == text  # and without one


def test_a_stray_marker_in_the_output_of_a_model_with_a_table_is_dropped():
    lower = casing.LOWER
    assert casing.decode(f"hund {TITLE}{lower}katze{lower} mann{UPPER}", TITLES) == "Hund katze MANN"


def test_usual_titles_counts_words_after_the_first_and_keeps_those_title_cased_more_often_than_not():
    lines = [
        "Ein Hund und ein Mann.",
        "Der Hund läuft, ein Mann geht.",
        "Hund Katze KATZE katze Katze",
        "Laufen laufen",
        "Der Hund.",
    ]
    # "Hund": title 3 times after the first word (first in line 3: not counted); "Ein", "Der", "Laufen" only
    # first; "Mann" twice; "Katze" twice title, once lower; "KATZE" counts for neither
    assert casing.usual_titles(lines) == ["hund", "katze", "mann"]
    assert casing.usual_titles(lines, min_count=3) == ["hund"]


@pytest.fixture(scope="module")
def german():
    """Lines that write their nouns in Title case, each starting with a capital."""
    nouns, words = ["Hund", "Mann", "Straße", "Hut"], ["ein", "läuft", "über", "die", "der", "trägt", "einen", "roten"]
    lines = []
    for i in range(600):
        body = [words[(i + k) % len(words)] if k % 2 else nouns[(i + k) % len(nouns)] for k in range(1, 7)]
        lines.append(" ".join([words[i % len(words)].capitalize(), *body]) + ".")
    return lines


@pytest.fixture(scope="module")
def usual(german, tmp_path_factory):
    cache = tmp_path_factory.mktemp("spm")
    return build_tokenizer(
        InMemory(german, german, "g"), vocab_size=120, cache_dir=cache, inline_case=True, usual_case=True
    )


def test_a_vocabulary_with_usual_case_marks_only_the_first_word_of_a_clean_german_line(usual, german, tmp_path):
    assert usual.inline_case and usual.titles == {"hund", "mann", "straße", "hut"}
    every = build_tokenizer(InMemory(german, german, "g"), vocab_size=120, cache_dir=tmp_path, inline_case=True)
    markers = {usual.src.piece_to_id(m) for m in casing.ALL_MARKERS}
    line = german[5]
    (ids,) = usual.encode_src([line])
    assert sum(i in markers for i in ids) == 1  # the capital of the first word; the nouns need none
    assert len(every.encode_src([line])[0]) >= len(ids) + 3  # marking every noun: three pieces longer at least
    variants = [line, line.upper(), line.lower(), line.title()]
    assert usual.decode_src(usual.encode_src(variants)) == usual.decode_tgt(usual.encode_tgt(variants)) == variants


def test_the_table_travels_in_the_state_dict_the_cache_and_the_fingerprint(usual, german, tmp_path_factory):
    restored = Tokenizer.from_state_dict(usual.state_dict())
    assert restored.titles == usual.titles and restored.fingerprint() == usual.fingerprint()
    assert Tokenizer(usual.src_model_bytes).fingerprint() != usual.fingerprint()
    assert Tokenizer(usual.src_model_bytes).encode_src(["der Hund"]) != usual.encode_src(["der Hund"])
    cache = tmp_path_factory.mktemp("again")
    first = build_tokenizer(InMemory(german, german, "g"), vocab_size=120, cache_dir=cache, usual_case=True)
    (table,) = (cache / "spm").glob("*.titles.txt")
    assert table.read_text() == "hund\nhut\nmann\nstraße\n"
    cached = build_tokenizer(InMemory(german, german, "g"), vocab_size=120, cache_dir=cache, usual_case=True)
    assert cached.titles == first.titles and cached.state_dict() == first.state_dict()
    with pytest.raises(ValueError, match="three markers"):
        Tokenizer(
            build_tokenizer(InMemory(german, german, "g"), vocab_size=120, cache_dir=cache).src_model_bytes,
            titles=b"hund\n",
        )


def test_an_exported_model_directory_keeps_the_table(usual, tmp_path):
    from transformer.config import Config, DataConfig
    from transformer.inference.pretrained import load_pretrained, save_pretrained
    from transformer.model import build_model

    config = Config(data=DataConfig(name="unit", embedded=True, inline_case=True, usual_case=True))
    model = build_model(config.model, usual.src_vocab_size, usual.tgt_vocab_size, True)
    out = save_pretrained(model, usual, config, tmp_path / "exported")
    assert (out / "titles.txt").read_bytes() == usual.titles_bytes
    loaded = load_pretrained(out)[1]
    assert loaded.titles == usual.titles and loaded.encode_src(["ein hund"]) == usual.encode_src(["ein hund"])


SU, ST = casing.SENTENCE_UPPER, casing.SENTENCE_TITLE


@pytest.mark.parametrize(
    "text, encoded, decoded",
    [
        ("Ein Hund läuft über die Straße.", "ein hund läuft über die straße.", "ein hund läuft über die straße."),
        ("Ein HUND läuft.", f"ein hund{UPPER} läuft.", "ein HUND läuft."),  # an upper-case word keeps its marker
        ("EIN HUND LÄUFT.", f"ein hund läuft.{SU}", "EIN HUND LÄUFT."),  # one marker for the sentence
        ("Ein Hund Läuft Über Die USA.", f"ein hund läuft über die usa{UPPER}.{ST}", "Ein Hund Läuft Über Die USA."),
        ('Ein "Hund" (Saftig-grün) 3 Mal', f'ein "hund" (saftig-grün) 3 mal{ST}', 'Ein "Hund" (Saftig-grün) 3 Mal'),
        ("Zwei Hunde", "zwei hunde", "zwei hunde"),  # too short to be taken for Title case
        ("iPhone, A380", "iphone, a380", "iphone, a380"),  # mixed case and single capitals: lower case
        ("OK", f"ok{SU}", "OK"),
        (f"Ein{UPPER} Hund{ST}", "ein hund", "ein hund"),  # markers in the input are dropped
        ("", "", ""),
        # a lower case that would not come back is kept as written: `İ` (its lower case adds a combining dot,
        # a piece no vocabulary of the text holds), `ẞ` in an upper-case word (it would come back `SS`)
        ("Zwei Männer in İstanbul.", "zwei männer in İstanbul.", "zwei männer in İstanbul."),
        ("İSTANBUL IST GROSS", f"İSTANBUL ist gross{SU}", "İSTANBUL IST GROSS"),
        ("DIE GROẞE STRAẞE", f"die GROẞE STRAẞE{SU}", "DIE GROẞE STRAẞE"),
        ("Die GROẞE Straße ist leer", "die GROẞE straße ist leer", "die GROẞE straße ist leer"),
        # letters without case (Japanese, Arabic): an acronym among them is an upper-case word (a run of
        # letters: in Japanese, the whole run), not a sentence in upper case
        ("東京でAIを学ぶ", f"東京でaiを学ぶ{UPPER}", "東京でAIを学ぶ"),
        ("أنا أحب NASA", f"أنا أحب nasa{UPPER}", "أنا أحب NASA"),
    ],
)
def test_a_lower_case_source_marks_upper_case_words_and_whole_sentences_only(text, encoded, decoded):
    assert casing.encode_source(text) == encoded
    assert casing.decode_source(encoded) == decoded
    assert casing.encode_source(decoded) == encoded  # the normalised text is written the same way


@pytest.mark.parametrize(
    "text, case",
    [
        ("EIN HUND", "upper"),
        ("STRASSE 12!", "upper"),
        ("A", "as written"),  # one capital letter is no upper-case sentence
        ("Der Hund Läuft", "title"),
        ("(Der) Hund 3 Läuft", "title"),  # leading marks skipped, a word starting with a digit not counted
        ("Der Hund läuft", "as written"),
        ("Der Hund", "as written"),
        ("1 2 3", "as written"),
        ("美国GDP增长了3%。", "as written"),  # letters without case: not every letter is upper case
        ("ΕΝΑΣ ΣΚΎΛΟΣ", "upper"),
    ],
)
def test_sentence_case_tells_upper_and_title_case_sentences_from_the_rest(text, case):
    assert casing.sentence_case(text) == case


def test_a_target_never_shows_a_sentence_marker_a_model_wrote():
    assert casing.decode(f"hund{TITLE} läuft.{SU}{ST}") == "Hund läuft."


@pytest.fixture(scope="module")
def lower_source(sentences, tmp_path_factory):
    cache = tmp_path_factory.mktemp("spm")
    return build_tokenizer(
        InMemory(sentences, sentences, "u"), vocab_size=124, cache_dir=cache, inline_case=True, lowercase_source=True
    )


def test_a_lower_case_source_costs_no_marker_for_capitals_and_one_for_a_sentence_in_upper_or_title_case(
    lower_source, cased
):
    assert lower_source.inline_case and lower_source.lowercase_source and not cased.lowercase_source
    line = "Der Mann trägt einen roten Hut."
    variants = [line, line.upper(), line.title(), line.lower()]
    ids = lower_source.encode_src(variants)
    sentence_markers = [lower_source.src.piece_to_id(m) for m in casing.SOURCE_MARKERS]
    assert ids[0] == ids[3]  # the capitals of a clean sentence cost nothing
    assert ids[1] == ids[3] + [sentence_markers[0]] and ids[2] == ids[3] + [sentence_markers[1]]
    assert len(cased.encode_src([line])[0]) == len(ids[0]) + 3  # inline casing marks the three capitals
    assert lower_source.decode_src(ids) == [line.lower(), line.upper(), line.title(), line.lower()]
    # the target keeps inline casing: every variant is written back exactly
    assert lower_source.decode_tgt(lower_source.encode_tgt(variants)) == variants
    assert lower_source.src.piece_to_id(TITLE) not in sum(ids, [])


def test_a_lower_case_source_travels_in_the_model_bytes_and_its_samples_are_lower_case_too(lower_source):
    import numpy as np

    from transformer.data.subword import SubwordSampling

    restored = Tokenizer.from_state_dict(lower_source.state_dict())
    assert restored.lowercase_source and restored.encode_src(["EIN HUT."]) == lower_source.encode_src(["EIN HUT."])

    class Stored:
        pair_index = np.arange(2)

        def text(self, side, pairs):
            return ["DER MANN TRÄGT", "Ein Hut"]

    sampling = SubwordSampling(lower_source.state_dict(), alpha=0.1, nbest=-1, seed=1, max_len=None)
    src, tgt = sampling.segment(Stored(), np.arange(2), epoch=0)
    assert lower_source.decode_src(src) == ["DER MANN TRÄGT", "ein hut"]
    assert lower_source.decode_tgt(tgt) == ["DER MANN TRÄGT", "Ein Hut"]


def test_the_ctranslate2_export_says_how_to_write_a_source_and_read_an_output(cased, lower_source, usual):
    from transformer.inference.ctranslate2 import casing_instructions

    assert casing_instructions(lower_source).count("casing.encode_source(text) (data.lowercase_source=true)") == 1
    assert "casing.encode(text) before" in casing_instructions(cased) and "titles" not in casing_instructions(cased)
    with_table = casing_instructions(usual)
    assert "casing.encode(text), with the words of the exported titles.txt" in with_table
    assert "casing.decode, with the words of the exported titles.txt" in with_table


def test_a_lower_case_source_needs_inline_casing():
    from transformer.config import ConfigError, DataConfig

    with pytest.raises(ConfigError, match="data.inline_case=true"):
        DataConfig(name="unit", embedded=True, lowercase_source=True).validate()
    DataConfig(name="unit", embedded=True, lowercase_source=True, inline_case=True).validate()


def test_a_tag_written_in_upper_case_in_a_lower_case_source_stays_text(sentences, tmp_path):
    tok = build_tokenizer(
        InMemory(sentences, sentences, "u"),
        vocab_size=140,
        cache_dir=tmp_path,
        languages=["de", "fr"],
        inline_case=True,
        lowercase_source=True,
    )
    assert tok.lowercase_source and min(tok.src.piece_to_id(m) for m in casing.SOURCE_MARKERS) >= tok.protected_ids
    for line in ["<2FR> EIN HUND.", "<2fr> Ein Hund.", "＜２ＦＲ＞ EIN HUT."]:
        (ids,) = tok.encode_src([line], tgt_lang="de")
        assert ids[0] == tok.tag_id("de") and tok.tag_id("fr") not in ids, line


def test_the_translator_gives_a_sentence_in_upper_case_twice_its_sources_length(lower_source):
    import torch

    from transformer.config import Config, DataConfig
    from transformer.inference.request import DecodeRequest
    from transformer.inference.translator import Translator
    from transformer.model import build_model

    config = Config(data=DataConfig(name="unit", embedded=True, inline_case=True, lowercase_source=True))
    torch.manual_seed(0)
    model = build_model(config.model, lower_source.src_vocab_size, lower_source.tgt_vocab_size, True).eval()
    translator = Translator(model, lower_source, config, torch.device("cpu"))
    assert translator.search(DecodeRequest(), None, 1).doubled_by == lower_source.sentence_marker_ids
    lines = ["der mann trägt", "DER MANN TRÄGT"]  # 3 pieces, and 4 with the sentence's marker
    request = DecodeRequest(beam_size=1, max_len_a=1.0, max_len_b=0)
    lengths = [len(hyps[0].tokens) for hyps in translator.hypotheses(lines, request)]
    assert lengths[0] <= 3 and 4 < lengths[1] <= 8  # an untrained model writes until the limit stops it
    translator.max_length = 6  # a source cut to the model's positions keeps its sentence's marker
    with pytest.warns(UserWarning, match="1 source sentence"):
        cut, whole = translator.encode_sources(["DER MANN TRÄGT EINEN ROTEN HUT UND", "der mann"])
    assert len(cut) == 6 and cut[-1] in lower_source.sentence_marker_ids
    assert cut[:5] == lower_source.encode_src(["DER MANN TRÄGT EINEN ROTEN HUT UND"])[0][:5]
    assert whole == lower_source.encode_src(["der mann"])[0]
