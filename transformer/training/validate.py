"""Validation and scoring: loss and token accuracy on a split, sacreBLEU/chrF, and the cross-attention
weights that TensorBoard's heatmaps draw (`transformer.training.monitor`). Decoding a split goes through
`transformer.inference.translator.Translator`.

`Validator` computes one validation of whatever weights the model holds and returns it: it logs
nothing and writes nothing; the trainer says what it means (a new best, a checkpoint) and the monitor
draws it.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from transformer.data.augment import EVALUATION_SEED, augment_pairs
from transformer.data.batching import batches_in_order, place_language_tag
from transformer.data.corpus import EncodedCorpus
from transformer.data.langid import off_target
from transformer.errors import Interrupted
from transformer.inference.request import DecodeRequest
from transformer.inference.scoring import score
from transformer.loss import output_cross_entropy, target_hidden, unwrap
from transformer.model import eval_mode
from transformer.special import BOS_ID, EOS_ID
from transformer.training.monitor import attention_sentences, pieces

log = logging.getLogger(__name__)


@torch.no_grad()
def validation_loss(
    model: torch.nn.Module,
    corpus: EncodedCorpus,
    max_tokens: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager],
    smoothing: float,
    stop: Callable[[], bool] | None = None,
    language_tag: str = "source",
) -> tuple[float, float, float]:
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
            batch = place_language_tag(corpus.collate(indices), language_tag).to(device)
            with autocast():
                hidden, target = target_hidden(model, batch)
                weight = unwrap(model).output.weight
                loss, nll, predicted = output_cross_entropy(hidden, weight, target, smoothing)
                correct += predicted
            total_loss += loss.item()
            total_nll += nll.item()
            tokens += batch.num_tgt_tokens
    return total_loss / tokens, total_nll / tokens, correct.item() / tokens


def cross_attention(model, source_ids: list[int], hypothesis_ids: list[int], device, start: int = BOS_ID) -> np.ndarray:
    """(T, S) cross-attention of the model's last decoder layer, mean over heads, as it reads the source
    (its ids and EOS: S) while predicting each token of the hypothesis and then EOS (T = len + 1). Ids
    within the model's positions, as `Translator` makes them."""
    return cross_attention_by_layer(model, source_ids, hypothesis_ids, device, [-1], start)[0].mean(0)


def cross_attention_panels(
    model, source_ids: list[int], hypothesis_ids: list[int], device, by: str, start: int = BOS_ID
) -> list[tuple[str, np.ndarray]]:
    """(label, (T, S) weights) for `trainer.attention_heatmaps`: `heads`, each head of the last decoder
    layer; `layers`, each layer's mean over heads."""
    if by == "heads":
        heads = cross_attention_by_layer(model, source_ids, hypothesis_ids, device, [-1], start)[0]
        return [(f"last layer, head {h + 1}", weights) for h, weights in enumerate(heads)]
    layers = cross_attention_by_layer(
        model, source_ids, hypothesis_ids, device, range(len(model.decoder_layers)), start
    )
    return [(f"layer {i + 1}, mean over heads", weights.mean(0)) for i, weights in enumerate(layers)]


@torch.no_grad()
def cross_attention_by_layer(
    model, source_ids: list[int], hypothesis_ids: list[int], device, layers, start: int = BOS_ID
) -> list[np.ndarray]:
    """Per decoder layer in `layers` (indices): its cross-attention weights (H, T, S) for the sentence, the
    decoder reading `start` first (BOS, or a target-language tag: data.language_tag)."""
    src = torch.tensor([source_ids + [EOS_ID]], device=device)
    tgt = torch.tensor([[start] + hypothesis_ids], device=device)
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


def mean_metrics(results: list[dict]) -> dict:
    """The mean of several directions' validation metrics (perplexity: of their mean NLL)."""
    keys = [key for key in results[0] if all(key in r for r in results)]  # off_target: where langid knows them
    mean = {key: sum(r[key] for r in results) / len(results) for key in keys}
    mean["ppl"] = math.exp(min(mean["nll"], 50))
    return mean


@dataclass
class Validation:
    """One validation: `metrics` (loss, nll, ppl, accuracy, bleu, chrf, cut_at_max_len), sacreBLEU's
    `signature`, `samples` (source, reference, hypothesis) in validation order, and the attention
    pictures: `panels` (weights (T, S), source pieces, predicted pieces) per attention sentence,
    `detail` (kind, labelled panels per head or layer of the first sentence) or None."""

    metrics: dict
    signature: str
    samples: list[tuple[str, str, str]]
    panels: list
    detail: tuple[str, list] | None


class Validator:
    """Validation of a training run's model: the prepared validation split for the loss, its text for
    BLEU/chrF (trainer.val_max_sentences of it) decoded through `translator`, and the cross-attention of
    a few fixed sentences. `attention`: trainer.attention_heatmaps (mean, heads, layers), or None to draw
    nothing (`off`, and ranks other than 0). A multilingual model's validator per direction decodes through a
    translator into that direction's target language (`Translator.tgt_lang`), scored by its rules."""

    def __init__(
        self, cfg, model, translator, corpus, text: tuple[list[str], list[str]], device, autocast, attention: str | None
    ):
        self.cfg, self.model, self.translator, self.corpus = cfg, model, translator, corpus
        self.device, self.autocast, self.attention = device, autocast, attention
        limit = cfg.trainer.val_max_sentences
        sources, references = text
        self.sources, self.references = (sources[:limit], references[:limit]) if limit else (sources, references)
        # trainer.val_augment: noised copies of those sentences, as transformer-evaluate --augment makes them
        self.noised = {
            name: augment_pairs(self.sources, self.references, name, EVALUATION_SEED)
            for name in cfg.trainer.val_augment
        }
        # The sentences drawn at every validation of the run, chosen and encoded once.
        encoded = translator.encode_sources(self.sources) if attention else []
        self.drawn = attention_sentences(encoded)
        self.drawn_sources = [encoded[i] for i in self.drawn]
        self.start = translator.tag_in_decoder(translator.tgt_lang).get("start", BOS_ID)  # what the decoder reads first

    def run(self, stop=None) -> Validation:
        """Loss, BLEU, chrF, samples and pictures of the weights the model holds now. `stop()` is asked
        between batches; True raises `search.Interrupted`."""
        tc, dc = self.cfg.trainer, self.cfg.decode
        loss, nll, accuracy = validation_loss(
            self.model,
            self.corpus,
            tc.max_tokens,
            self.device,
            self.autocast,
            tc.label_smoothing,
            stop,
            self.cfg.data.language_tag,
        )
        request = DecodeRequest(beam_size=tc.val_beam_size, batch_tokens=dc.batch_tokens)
        hyps, texts, scores = self._decoded(self.sources, self.references, request, "validate", stop)
        metrics = {
            "loss": loss,
            "nll": nll,
            "ppl": math.exp(min(nll, 50)),
            "accuracy": accuracy,
            "bleu": scores["bleu"],
            "chrf": scores["chrf"],
            "cut_at_max_len": sum(h[0].hit_max_len for h in hyps) / max(1, len(hyps)),
        }
        if self.translator.target_languages:  # a multilingual model: how often it answers in another language
            off = off_target(texts, self.translator.tgt_lang, self.cfg.data.languages())
            if off is not None:
                metrics["off_target"] = off["off_target"]
        for name, (sources, references) in self.noised.items():
            _, _, noised = self._decoded(sources, references, request, f"validate {name}", stop)
            metrics[f"bleu_{name}"], metrics[f"chrf_{name}"] = noised["bleu"], noised["chrf"]
        shown = [hyps[i][0].tokens for i in self.drawn]  # what each drawn sentence decodes to now
        return Validation(
            metrics,
            scores["bleu_signature"],
            list(zip(self.sources, self.references, texts)),
            self._panels(shown),
            self._detail(shown),
        )

    def _decoded(self, sources: list[str], references: list[str], request, desc: str, stop) -> tuple:
        """(hypotheses, their texts, BLEU/chrF against `references`) of `sources` decoded as `request` asks."""
        hyps = self.translator.hypotheses(sources, request, progress=None, desc=desc, stop=stop)
        texts = [h[0].text for h in hyps]
        return hyps, texts, score(texts, references, self.translator.tgt_lang or self.cfg.data.tgt_lang)

    def _panels(self, hypotheses: list[list[int]]) -> list:
        """(weights, source pieces, predicted pieces) of each drawn sentence and its hypothesis."""
        tokenizer = self.translator.tokenizer
        return [
            (
                cross_attention(self.model, source, hypothesis, self.device, self.start),
                pieces(tokenizer.src, source),
                pieces(tokenizer.tgt, hypothesis),
            )
            for source, hypothesis in zip(self.drawn_sources, hypotheses)
        ]

    def _detail(self, hypotheses: list[list[int]]) -> tuple[str, list] | None:
        """With trainer.attention_heatmaps heads or layers: that kind, and one labelled panel per head or
        layer of the first drawn sentence; None otherwise (or with no sentence to draw)."""
        if self.attention in (None, "mean") or not hypotheses:
            return None
        tokenizer, source = self.translator.tokenizer, self.drawn_sources[0]
        source_pieces, predicted = pieces(tokenizer.src, source), pieces(tokenizer.tgt, hypotheses[0])
        return self.attention, [
            (weights, source_pieces, predicted, label)
            for label, weights in cross_attention_panels(
                self.model, source, hypotheses[0], self.device, self.attention, self.start
            )
        ]
