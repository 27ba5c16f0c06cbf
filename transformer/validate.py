"""Validation and scoring: loss and token accuracy on a split, sacreBLEU/chrF, and the cross-attention
weights that TensorBoard's heatmaps draw (`transformer.monitor`). Decoding a split goes through `transformer.translator.Translator`."""

from __future__ import annotations

import functools
import logging
import unicodedata

import numpy as np
import sacrebleu
import torch

from transformer.batching import batches_in_order
from transformer.loss import output_cross_entropy, target_hidden, unwrap
from transformer.model import eval_mode
from transformer.search import Interrupted
from transformer.special import BOS_ID, EOS_ID

log = logging.getLogger(__name__)


@torch.no_grad()
def validation_loss(model, corpus, max_tokens: int, device, autocast, smoothing: float, stop=None):
    """Per-token (label-smoothed loss, NLL, accuracy) over a whole prepared split (an `EncodedCorpus`);
    accuracy: the share of target tokens that are the most probable token given the reference before
    them. `stop()` is asked between batches and True raises `search.Interrupted`."""
    total_loss = total_nll = tokens = 0.0
    correct = torch.zeros((), device=device)
    lengths = np.maximum(corpus.src_lens, corpus.tgt_lens)
    with eval_mode(model):
        for indices in batches_in_order(lengths, max_tokens):
            if stop is not None and stop():
                raise Interrupted
            batch = corpus.collate(indices).to(device)
            with autocast():
                hidden, target = target_hidden(model, batch)
                weight = unwrap(model).output.weight
                loss, nll, predicted = output_cross_entropy(hidden, weight, target, smoothing)
                correct += predicted
            total_loss += loss.item()
            total_nll += nll.item()
            tokens += batch.num_tgt_tokens
    return total_loss / tokens, total_nll / tokens, correct.item() / tokens


@functools.cache
def bleu_metric(tgt_lang: str | None) -> sacrebleu.metrics.BLEU:
    """Cased sacreBLEU with the tokenizer sacreBLEU chooses for the target language: 13a for most,
    zh for Chinese, ja-mecab / ko-mecab for Japanese / Korean. Those two need sacrebleu's extras;
    without them the score falls back to character tokenization (said once, and in the signature)."""
    try:
        return sacrebleu.metrics.BLEU(trg_lang=tgt_lang or "")
    except RuntimeError:
        log.warning("BLEU for target language %r: sacreBLEU's tokenizer for it needs `pip install "
                    "sacrebleu[%s]`; scoring with character tokenization instead (tok:char)", tgt_lang, tgt_lang)
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
    return {"bleu": bleu_score.score, "chrf": chrf_score.score,
            "bleu_signature": str(bleu.get_signature()) + NORMALIZATION_SIGNATURE,
            "chrf_signature": str(chrf.get_signature()) + NORMALIZATION_SIGNATURE}


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
    bleu = sacrebleu.metrics.BLEU(tokenize="none", force=True)
    result = bleu.corpus_score(literature_tokenize(nfc(hypotheses), tgt_lang), [nfc(tokenized_references)])
    return {"bleu_tokenized_lc": result.score,
            "bleu_tokenized_lc_signature": f"{bleu.get_signature()}|hyp:moses-lc-norm-tok-{tgt_lang}"}


def nfc(lines: list[str]) -> list[str]:
    return [unicodedata.normalize("NFC", line) for line in lines]


def cross_attention(model, source_ids: list[int], hypothesis_ids: list[int], device) -> np.ndarray:
    """(T, S) cross-attention of the model's last decoder layer, mean over heads, as it reads the source
    (its ids and EOS: S) while predicting each token of the hypothesis and then EOS (T = len + 1). Ids
    within the model's positions, as `Translator` makes them."""
    return cross_attention_by_layer(model, source_ids, hypothesis_ids, device, [-1])[0].mean(0)


def cross_attention_panels(model, source_ids: list[int], hypothesis_ids: list[int], device,
                           by: str) -> list[tuple[str, np.ndarray]]:
    """(label, (T, S) weights) for `trainer.attention_heatmaps`: `heads`, each head of the last decoder
    layer; `layers`, each layer's mean over heads."""
    if by == "heads":
        heads = cross_attention_by_layer(model, source_ids, hypothesis_ids, device, [-1])[0]
        return [(f"last layer, head {h + 1}", weights) for h, weights in enumerate(heads)]
    layers = cross_attention_by_layer(model, source_ids, hypothesis_ids, device, range(len(model.decoder_layers)))
    return [(f"layer {i + 1}, mean over heads", weights.mean(0)) for i, weights in enumerate(layers)]


@torch.no_grad()
def cross_attention_by_layer(model, source_ids: list[int], hypothesis_ids: list[int], device,
                             layers) -> list[np.ndarray]:
    """Per decoder layer in `layers` (indices): its cross-attention weights (H, T, S) for the sentence."""
    src = torch.tensor([source_ids + [EOS_ID]], device=device)
    tgt = torch.tensor([[BOS_ID] + hypothesis_ids], device=device)
    modules = [model.decoder_layers[i].cross_attn for i in layers]
    for module in modules:
        module.need_weights = True
    try:
        with eval_mode(model):
            model(src, tgt)
        return [module.last_weights[0].float().cpu().numpy() for module in modules]
    finally:
        for module in modules:
            module.need_weights = False
