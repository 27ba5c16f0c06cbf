"""Scores of translations: sacreBLEU and chrF on NFC text (`score`), and the literature's tokenized
lowercased BLEU (`tokenized_lowercased_bleu`, sacremoses)."""

from __future__ import annotations

import functools
import logging
import unicodedata

import sacrebleu

log = logging.getLogger(__name__)


@functools.cache
def bleu_metric(tgt_lang: str | None) -> sacrebleu.metrics.BLEU:
    """Cased sacreBLEU with the tokenizer sacreBLEU chooses for the target language: 13a for most,
    zh for Chinese, ja-mecab / ko-mecab for Japanese / Korean. Those two need sacrebleu's extras;
    without them the score falls back to character tokenization (said once, and in the signature)."""
    try:
        return sacrebleu.metrics.BLEU(trg_lang=tgt_lang or "")
    except RuntimeError:
        log.warning(
            "BLEU for target language %r: sacreBLEU's tokenizer for it needs `pip install "
            "sacrebleu[%s]`; scoring with character tokenization instead (tok:char)",
            tgt_lang,
            tgt_lang,
        )
        return sacrebleu.metrics.BLEU(tokenize="char")


# Appended to both signatures: hypotheses and references were put in Unicode NFC before scoring.
NORMALIZATION_SIGNATURE = "|norm:nfc"


def score(hypotheses: list[str], references: list[str], tgt_lang: str | None = None) -> dict:
    """Corpus sacreBLEU (cased; tokenized for `tgt_lang`, see `bleu_metric`) and chrF with their signatures:
    the one scoring function of validation, the test at the end of training, `transformer-evaluate` and
    the bench. Hypotheses and references are both put in Unicode NFC first, so that the same text scores
    the same whichever normalization form a corpus was written in (an accented letter as one code
    point or as a letter and a combining mark); the signatures end in `|norm:nfc` to say so."""
    hypotheses, references = nfc(hypotheses), nfc(references)
    bleu = bleu_metric(tgt_lang)
    chrf = sacrebleu.metrics.CHRF()
    bleu_score = bleu.corpus_score(hypotheses, [references])
    chrf_score = chrf.corpus_score(hypotheses, [references])
    return {
        "bleu": bleu_score.score,
        "chrf": chrf_score.score,
        "bleu_signature": str(bleu.get_signature()) + NORMALIZATION_SIGNATURE,
        "chrf_signature": str(chrf.get_signature()) + NORMALIZATION_SIGNATURE,
    }


def literature_tokenize(lines: list[str], lang: str) -> list[str]:
    """Multi30k's task1-tokenize.sh (`lowercase | normalize-punctuation -l L | tokenizer -l L`) in Python
    with sacremoses, escaping & ' " < > as the Perl tokenizer does. On the references of val and
    test_2016_flickr in en, de, fr and cs it reproduces the dataset's tok/*.lc.norm.tok.* files on 8,049
    of their 8,052 lines (the other three: quirks of an older normalize-punctuation)."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    normalizer, tokenizer = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
    return [tokenizer.tokenize(normalizer.normalize(line.lower()), return_str=True, escape=True) for line in lines]


def tokenized_lowercased_bleu(hypotheses: list[str], tokenized_references: list[str], tgt_lang: str) -> dict:
    """BLEU the way the Multi30k literature reports it: our detokenized hypotheses lowercased, normalized
    and Moses-tokenized (`literature_tokenize`), scored against references tokenized the same way (the
    dataset's *.lc.norm.tok.* files) with sacreBLEU's tokenize=none. Always reported beside the cased
    detokenized score (`score`), never instead of it: the two are not comparable."""
    # lowercase=True changes nothing (both sides are lowercased already) but makes the signature say case:lc
    bleu = sacrebleu.metrics.BLEU(tokenize="none", lowercase=True, force=True)
    result = bleu.corpus_score(literature_tokenize(nfc(hypotheses), tgt_lang), [nfc(tokenized_references)])
    return {
        "bleu_tokenized_lc": result.score,
        "bleu_tokenized_lc_signature": f"{bleu.get_signature()}|hyp:moses-lc-norm-tok-{tgt_lang}",
    }


def nfc(lines: list[str]) -> list[str]:
    return [unicodedata.normalize("NFC", line) for line in lines]
