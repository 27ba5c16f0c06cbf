"""Random online back-translation (`trainer.online_backtranslation`; Zhang et al., 2020, "Improving Massively
Multilingual Neural Machine Translation and Zero-Shot Translation"), the remedy for a multilingual model that
answers a zero-shot request in the wrong language.

For a share of each batch's pairs (x -> y, y in language t), the model itself translates y into another of
its target languages t' (greedy, dropout off) and the pair becomes (that translation -> y): a source in t'
with a real target in t. Where t' -> t is a direction no corpus trains (fr -> de, when every corpus goes
through English), the model now learns it from a real target, which is what makes a zero-shot request be
answered in the language asked for.

Which pairs and which t' are drawn from (trainer.seed, step, the pair's token ids): a function of the pair and
the step, not of its place in a batch, a DataLoader worker or a rank, so that a resumed run, accumulation and
DDP make the same synthetic pairs (the translations themselves are a function of the weights, which those
runs share). The batch's targets and token count are unchanged; its sources are re-padded.

`trainer.online_backtranslation_side=source` translates the pair's source instead (back-translation through
the pivot, as in Gu et al., 2019): for a pair (x -> y) whose target language t one language s alone is
trained into (English, in a corpus through English), x is translated along a trained direction s -> t' into
a third language t' that is not trained into t, and the pair becomes (that translation -> y). Every synthetic
pair is then a zero-shot direction, and its source is a trained direction's output rather than a zero-shot
one's, which the model makes poorly until it has learnt the direction. Pairs into other targets (English,
which several languages are trained into, so that a row does not say its source's language) are not drawn."""

from __future__ import annotations

import logging
import zlib

import numpy as np
import torch

from transformer.data.batching import Batch, pad_sequences
from transformer.data.tokenizer import Tokenizer
from transformer.inference.search import Search, translate_ids
from transformer.model import eval_mode
from transformer.special import EOS_ID, PAD_ID

log = logging.getLogger("transformer.train")


class OnlineBacktranslation:
    """`__call__(micro_batches, step)`: the update's (batch, weight) pairs with a `share` of each batch's pairs'
    sources replaced by the model's translation of their target into another language, from step
    `start` on, before step `end` (None: to the end of the run). `language_tag`: where the model reads its
    tag (data.language_tag). `routes` (DataConfig.pivot_routes): translate the sources of the pairs into
    those targets along them instead (trainer.online_backtranslation_side=source)."""

    def __init__(
        self,
        share: float,
        start: int,
        seed: int,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        language_tag: str,
        max_len: int,
        device: torch.device,
        autocast,
        end: int | None = None,
        routes: dict[str, tuple[str, list[str]]] | None = None,
    ):
        self.share, self.start, self.end, self.seed, self.model = share, start, end, seed, model
        # side=source: {target: (its one source language, [third languages])} (DataConfig.pivot_routes)
        self.routes = routes
        self.language_tag, self.max_len, self.device, self.autocast = language_tag, max_len, device, autocast
        self.languages = tokenizer.target_languages
        self.tag_ids = {language: tokenizer.tag_id(language) for language in self.languages}
        self.language_of = {tag: language for language, tag in self.tag_ids.items()}
        self.never = tokenizer.tag_ids
        self.doubled_by = tokenizer.sentence_marker_ids
        self.as_source = tokenizer.target_ids_as_source  # a target or a translation as a source is written
        self.made = 0  # synthetic pairs so far (this process)

    @classmethod
    def for_run(cls, cfg, model, tokenizer: Tokenizer, runtime) -> OnlineBacktranslation | None:
        """The run's, from its config (said in the log by rank 0); None when trainer.online_backtranslation=0."""
        tc = cfg.trainer
        if not tc.online_backtranslation:
            return None
        routes = cfg.data.pivot_routes() if tc.online_backtranslation_side == "source" else None
        if runtime.is_main:
            log.info(
                "online back-translation: %g of %s from step %d%s, translated by the model (greedy) as their sources",
                tc.online_backtranslation,
                "each batch's pairs, their targets into another language"
                if routes is None
                else "the pairs into "
                + ", ".join(sorted(routes))
                + ", their sources into a third language ("
                + ", ".join(f"{s}->{'|'.join(thirds)}->{t}" for t, (s, thirds) in sorted(routes.items()))
                + ")",
                tc.online_backtranslation_from,
                f" to step {tc.online_backtranslation_until}" if tc.online_backtranslation_until else "",
            )
        return cls(
            tc.online_backtranslation,
            tc.online_backtranslation_from,
            tc.seed,
            model,
            tokenizer,
            cfg.data.language_tag,
            cfg.data.max_len,
            runtime.device,
            runtime.autocast,
            end=tc.online_backtranslation_until or None,
            routes=routes,
        )

    def __call__(self, micro_batches: list, step: int) -> list:
        if step < self.start or self.share <= 0 or (self.end is not None and step >= self.end):
            return micro_batches
        return [(self.batch(batch, step), weight) for batch, weight in micro_batches]

    def draws(self, batch: Batch, step: int) -> list[tuple[int, str]]:
        """(row, language to translate its target (side=source: its source) into) for the rows of `batch`
        drawn at `step`."""
        src, tgt_out = batch.src.numpy(), batch.tgt_out.numpy()
        tags = batch.tgt_in[:, 0].numpy() if self.language_tag != "source" else src[:, 0]
        drawn = []
        for row in range(len(src)):
            key = [self.seed, step, zlib.crc32(src[row].tobytes()), zlib.crc32(tgt_out[row].tobytes())]
            rng = np.random.default_rng(key)
            language = self.language_of.get(int(tags[row]))
            if self.routes is None:
                others = [other for other in self.languages if other != language]
            else:  # side=source: only the pairs from a known language, into a zero-shot direction
                others = self.routes[language][1] if language in self.routes else []
            if language is None or not others or rng.random() >= self.share:
                continue
            drawn.append((row, others[int(rng.integers(len(others)))]))
        return drawn

    def batch(self, batch: Batch, step: int) -> Batch:
        """`batch` with the drawn rows' sources replaced by the model's translations of their targets (side=source:
        of their sources)."""
        drawn = self.draws(batch, step)
        if not drawn:
            return batch
        sources = [_ids(row) for row in batch.src.numpy()]  # the tag first, unless data.language_tag=decoder
        in_source = self.language_tag != "decoder"
        rows = [row for row, _ in drawn]
        if self.routes is None:  # the text each drawn row's new source is a translation of (no EOS, no tag)
            texts = self.as_source([_ids(batch.tgt_out[row].numpy()) for row in rows])
        else:
            texts = [sources[row][1:] if in_source else sources[row] for row in rows]
        tags = [self.tag_ids[language] for _, language in drawn]
        # One greedy search for every drawn row, each into its own language: on a CPU a decoding step costs
        # about as much for 40 rows as for 10, so one search per language would cost three times as much.
        search = Search(
            beam_size=1,
            workers=1,
            start=tags if self.language_tag != "source" else None,
            never=self.never,
            doubled_by=self.doubled_by,
        )
        with torch.no_grad(), eval_mode(self.model):
            hypotheses = translate_ids(
                self.model,
                [([tag] if in_source else []) + text for text, tag in zip(texts, tags)],
                search,
                device=self.device,
                autocast=self.autocast,
            )
        translations = self.as_source([hyps[0].tokens for hyps in hypotheses])
        for row, translation in zip(rows, translations):
            kept = sources[row][:1] if in_source else []  # the pair's own tag: the language of its target
            sources[row] = kept + translation[: self.max_len - len(kept)]
        self.made += len(drawn)
        src = pad_sequences(sources, suffix=[EOS_ID])  # (B, S')
        real = int((src != PAD_ID).sum()) + batch.num_tgt_tokens
        padding = 1.0 - real / max(1, src.numel() + batch.tgt_out.numel())
        return Batch(src, batch.tgt_in, batch.tgt_out, batch.num_tgt_tokens, padding, batch.tgt_positions)


def _ids(row: np.ndarray) -> list[int]:
    """A padded row's ids before its EOS (or its padding)."""
    ends = np.flatnonzero((row == EOS_ID) | (row == PAD_ID))
    return row[: ends[0] if len(ends) else len(row)].tolist()
