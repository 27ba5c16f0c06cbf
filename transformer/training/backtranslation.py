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
runs share). The batch's targets and token count are unchanged; its sources are re-padded."""

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
    tag (data.language_tag)."""

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
    ):
        self.share, self.start, self.end, self.seed, self.model = share, start, end, seed, model
        self.language_tag, self.max_len, self.device, self.autocast = language_tag, max_len, device, autocast
        self.languages = tokenizer.target_languages
        self.tag_ids = {language: tokenizer.tag_id(language) for language in self.languages}
        self.language_of = {tag: language for language, tag in self.tag_ids.items()}
        self.never = tokenizer.tag_ids
        self.made = 0  # synthetic pairs so far (this process)

    @classmethod
    def for_run(cls, cfg, model, tokenizer: Tokenizer, runtime) -> OnlineBacktranslation | None:
        """The run's, from its config (said in the log by rank 0); None when trainer.online_backtranslation=0."""
        tc = cfg.trainer
        if not tc.online_backtranslation:
            return None
        if runtime.is_main:
            log.info(
                "online back-translation: %g of each batch's pairs from step %d%s, their targets translated into "
                "another language by the model (greedy) as their sources",
                tc.online_backtranslation,
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
        )

    def __call__(self, micro_batches: list, step: int) -> list:
        if step < self.start or self.share <= 0 or (self.end is not None and step >= self.end):
            return micro_batches
        return [(self.batch(batch, step), weight) for batch, weight in micro_batches]

    def draws(self, batch: Batch, step: int) -> list[tuple[int, str]]:
        """(row, language to translate its target into) for the rows of `batch` drawn at `step`."""
        src, tgt_out = batch.src.numpy(), batch.tgt_out.numpy()
        tags = batch.tgt_in[:, 0].numpy() if self.language_tag != "source" else src[:, 0]
        drawn = []
        for row in range(len(src)):
            key = [self.seed, step, zlib.crc32(src[row].tobytes()), zlib.crc32(tgt_out[row].tobytes())]
            rng = np.random.default_rng(key)
            language = self.language_of.get(int(tags[row]))
            if rng.random() >= self.share or language is None:
                continue
            others = [other for other in self.languages if other != language]
            drawn.append((row, others[int(rng.integers(len(others)))]))
        return drawn

    def batch(self, batch: Batch, step: int) -> Batch:
        """`batch` with the drawn rows' sources replaced by the model's translations of their targets."""
        drawn = self.draws(batch, step)
        if not drawn:
            return batch
        targets = [_ids(row) for row in batch.tgt_out.numpy()]  # without EOS
        sources = [_ids(row) for row in batch.src.numpy()]  # the tag first, unless data.language_tag=decoder
        in_source = self.language_tag != "decoder"
        rows = [row for row, _ in drawn]
        tags = [self.tag_ids[language] for _, language in drawn]
        # One greedy search for every drawn row, each into its own language: on a CPU a decoding step costs
        # about as much for 40 rows as for 10, so one search per language would cost three times as much.
        search = Search(
            beam_size=1,
            workers=1,
            start=tags if self.language_tag != "source" else None,
            never=self.never,
        )
        with torch.no_grad(), eval_mode(self.model):
            hypotheses = translate_ids(
                self.model,
                [([tag] if in_source else []) + targets[row] for row, tag in zip(rows, tags)],
                search,
                device=self.device,
                autocast=self.autocast,
            )
        for row, hyps in zip(rows, hypotheses):
            kept = sources[row][:1] if in_source else []  # the pair's own tag: the language of its target
            sources[row] = kept + hyps[0].tokens[: self.max_len - len(kept)]
        self.made += len(drawn)
        src = pad_sequences(sources, suffix=[EOS_ID])  # (B, S')
        real = int((src != PAD_ID).sum()) + batch.num_tgt_tokens
        padding = 1.0 - real / max(1, src.numel() + batch.tgt_out.numel())
        return Batch(src, batch.tgt_in, batch.tgt_out, batch.num_tgt_tokens, padding, batch.tgt_positions)


def _ids(row: np.ndarray) -> list[int]:
    """A padded row's ids before its EOS (or its padding)."""
    ends = np.flatnonzero((row == EOS_ID) | (row == PAD_ID))
    return row[: ends[0] if len(ends) else len(row)].tolist()
