"""Greedy decoding and batched beam search, both incremental over the decoder's key/value cache, and
sampling instead of a search (sampling.py).

The search functions talk to a `StepDecoder` (decoders.py): `step(tokens) -> log-probabilities of the
next token` and `select(rows, sentences)` to follow the surviving hypotheses; `ModelDecoder` and
`EnsembleDecoder` implement it for one model or several, tests with hand-written probability tables. A
target prefix (`Search.prefixes`) forces the first tokens of a sentence; search continues from there.
Text in, text out goes through `transformer.inference.translator.Translator`, which calls `translate_ids`
here. The top candidates of a step are found by candidates.py.

Shapes: the legend of transformer/attention.py (B, S, T, D, K, ...), and here n open sentences, t tokens so
far (BOS included), V vocabulary.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from transformer.config import DEFAULT_BATCH_TOKENS
from transformer.data.batching import batches_in_order, pad_sequences
from transformer.errors import Interrupted
from transformer.inference.candidates import never_generated, prefix_logprob, step_candidates, top_candidates
from transformer.inference.decoders import (
    EncoderDecoder,
    EnsembleDecoder,
    Hypothesis,
    ModelDecoder,
    StepDecoder,
)
from transformer.inference.parallel import PARALLEL_MIN_BATCH_TOKENS, in_processes
from transformer.inference.sampling import Sampling
from transformer.model import eval_mode
from transformer.special import BOS_ID, EOS_ID, PAD_ID


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ((5 + length) / 6) ** alpha (Wu et al., 2016); 1 when alpha = 0."""
    return ((5.0 + length) / 6.0) ** alpha


def max_lengths(
    src: torch.Tensor, max_len_a: float, max_len_b: int, limit: int, doubled_by: tuple[int, ...] = ()
) -> torch.Tensor:
    """Per sentence: at most a * source_length + b output tokens (EOS included), capped by `limit`; a source
    whose last token is one of `doubled_by` counts twice its length."""
    src_lens = (src != PAD_ID).sum(dim=1) - 1  # without the source EOS
    if doubled_by:
        last = src.gather(1, (src_lens - 1).clamp(min=0).unsqueeze(1)).squeeze(1)  # (B,) the token before EOS
        marked = torch.isin(last, torch.tensor(doubled_by, device=src.device)) & (src_lens > 0)
        src_lens = torch.where(marked, 2 * src_lens, src_lens)
    # Capped while still float: a limit beyond int64 (max_len_a=1e30: "no limit") wrapped to 1 token.
    lengths = torch.floor(src_lens.double() * float(max_len_a) + float(max_len_b))
    return lengths.clamp(min=1, max=limit).long()


@dataclass(frozen=True)
class Search:
    """A decoding as `translate_ids` runs it, every option resolved: the beam (1: greedy search), the
    length penalty `alpha`, `nbest` hypotheses per sentence, the length limit `max_len_a * source + max_len_b`,
    `batch_tokens` (source tokens times the beam per batch), `sampling` instead of a search, `prefixes`
    (per source, target token ids without BOS forced first, [] for none), `workers` (CPU processes) and
    `use_cache` (the key/value cache; False recomputes every prefix). `start`: the decoder's first input in
    place of BOS (a target-language tag, data.language_tag=both|decoder), or a list of one per source (each
    sentence into its own language, with the cache); `never`: a range of ids [first, end) never generated
    (the tags)."""

    beam_size: int = 5
    alpha: float = 0.0
    nbest: int = 1
    max_len_a: float = 1.2
    max_len_b: int = 10
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    sampling: Sampling | None = None
    prefixes: list[list[int]] | None = None
    workers: int = 1
    use_cache: bool = True
    start: int | list[int] | None = None
    never: tuple[int, int] | None = None
    # A lower-case source's sentence markers (Tokenizer.sentence_marker_ids): a source ending in one asks for
    # a target with a case marker after every word, up to twice as many pieces: its length counts twice.
    doubled_by: tuple[int, ...] = ()


# Greedy search drops finished sentences from the batch (and the decoder's caches) once they are this
# share of its rows, not at every step where one finishes: copying every cache for a few rows costs more
# than carrying them a few steps.
GREEDY_COMPACT_SHARE = 0.25


@torch.no_grad()
def greedy_search(
    decoder: StepDecoder, max_lens: torch.Tensor, sampling: Sampling | None = None, prefix: torch.Tensor | None = None
) -> list[Hypothesis]:
    """Pick the most probable token at every step (or draw one, with `sampling`); sentences leave the
    batch when they emit EOS (in batches of `GREEDY_COMPACT_SHARE` of the rows; with `sampling` at
    once, so that the draws do not depend on it). `prefix` (n, P): target tokens forced first, PAD
    after each sentence's own prefix (its length + 1 must fit in `max_lens`)."""
    batch = max_lens.numel()
    device = max_lens.device
    tokens = torch.full((batch, 1), BOS_ID, dtype=torch.long, device=device)  # (n, t)
    logprob = torch.zeros(batch, device=device)
    open_ids = torch.arange(batch, device=device)  # original index of each row's sentence
    decoding = torch.ones(batch, dtype=torch.bool, device=device)  # rows not finished yet
    carried = 0  # finished rows still in the batch
    compact_share = 0.0 if sampling is not None else GREEDY_COMPACT_SHARE
    results: list[Hypothesis | None] = [None] * batch
    for step in range(int(max_lens.max())):
        in_prefix = prefix is not None and step < prefix.size(1)
        if sampling is None and not in_prefix:
            best_logprob, best_token, eos_logprob = top_candidates(decoder, tokens, 1)  # (n, 1), (n, 1), (n,)
            best_logprob, best_token = best_logprob.squeeze(1), best_token.squeeze(1)
        else:
            logprobs = never_generated(decoder.step(tokens))  # (n, V) float32
            if sampling is None:
                best_logprob, best_token = logprobs.max(dim=1)
            else:
                best_token, best_logprob = sampling(logprobs)
            eos_logprob = logprobs[:, EOS_ID]
            if in_prefix:
                active, wanted_logprob = prefix_logprob(logprobs, prefix[:, step])
                best_token = torch.where(active, prefix[:, step], best_token)
                best_logprob = torch.where(active, wanted_logprob, best_logprob)
        forced = step + 1 >= max_lens  # (n,)
        next_token = torch.where(forced, EOS_ID, best_token)
        token_logprob = torch.where(forced, eos_logprob, best_logprob)
        logprob = logprob + token_logprob
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        done = (next_token == EOS_ID) & decoding  # (n,) finished now
        if not done.any():
            continue
        done_rows = done.nonzero().flatten()  # (d,)
        # Only the finished rows go to the host, not the whole batch's tokens at every such step.
        for sentence, ids, score, was_forced in zip(
            open_ids[done_rows].tolist(),
            tokens[done_rows, 1:-1].tolist(),
            logprob[done_rows].tolist(),
            forced[done_rows].tolist(),
        ):
            results[sentence] = Hypothesis(tokens=ids, score=score, logprob=score, hit_max_len=was_forced)
        decoding = decoding & ~done
        carried += done_rows.numel()
        rows = decoding.numel()
        if carried == rows:
            break
        if carried > compact_share * rows:
            keep = decoding.nonzero().flatten()
            tokens, logprob, open_ids, max_lens = tokens[keep], logprob[keep], open_ids[keep], max_lens[keep]
            decoding, carried = decoding[keep], 0
            prefix = None if prefix is None else prefix[keep]
            decoder.select(keep, keep)
    return results


@torch.no_grad()
def beam_search(
    decoder: StepDecoder,
    max_lens: torch.Tensor,
    beam_size: int,
    alpha: float = 0.0,
    nbest: int = 1,
    prefix: torch.Tensor | None = None,
) -> list[list[Hypothesis]]:
    """Batched beam search; returns the `nbest` best finished hypotheses per sentence, best first.

    Each step expands every open hypothesis, takes the top 2K candidates per sentence, finishes the
    EOS candidates ranked within the top K, and continues with the K best non-EOS candidates.
    A sentence closes when K hypotheses have finished, when it reaches its maximum length, or when no
    open hypothesis can still beat the `nbest`-th finished one (log-probabilities only fall, so an open
    score s can at best become s / lp(max_len)).

    `prefix` (n, P): target tokens forced first, PAD after each sentence's own prefix (its length + 1
    must fit in `max_lens`). While a sentence is inside it, only its first beam continues, with the
    forced token; the beam widens from the step after.
    """
    if nbest > beam_size:
        raise ValueError(f"nbest={nbest} cannot exceed beam_size={beam_size}")
    batch, device, K = max_lens.numel(), max_lens.device, beam_size
    # Every sentence starts from one hypothesis (BOS); the first step expands it to K.
    tokens = torch.full((batch, 1), BOS_ID, dtype=torch.long, device=device)  # (n*beams, t)
    scores = torch.zeros(batch, 1, device=device)  # (n, beams) log-probs
    # What the host keeps of each open sentence (no device read needed): its index and length limit.
    open_ids, limits = list(range(batch)), max_lens.tolist()
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]
    for step in range(max(limits)):
        n, beams = scores.shape
        # A sentence's 2K best (beam, token) candidates are among each beam's 2K best tokens
        # (width = 2K, or the vocabulary size if that is smaller).
        if prefix is not None and step < prefix.size(1):
            logprobs = decoder.step(tokens)  # (n*beams, V) float32
            row_scores, row_tokens, eos_logprob = step_candidates(logprobs, 2 * K)  # (n*beams, width)
            wanted = prefix[:, step].repeat_interleave(beams)  # (n*beams,)
            active, wanted_logprob = prefix_logprob(logprobs, wanted)
            first_beam = torch.arange(n * beams, device=device) % beams == 0
            _only(row_scores, row_tokens, active, wanted, wanted_logprob.masked_fill(~first_beam, float("-inf")))
        else:
            row_scores, row_tokens, eos_logprob = top_candidates(decoder, tokens, 2 * K)  # (n*beams, width)
        width = row_scores.size(1)
        forced = [step + 1 >= limit for limit in limits]  # sentences at their length limit may only end
        if any(forced):
            forced_rows = torch.tensor(forced, device=device).repeat_interleave(beams)  # (n*beams,)
            _only(row_scores, row_tokens, forced_rows, EOS_ID, eos_logprob)
        candidates = (scores.view(-1, 1) + row_scores).view(n, beams * width)
        top_scores, top_ids = candidates.topk(min(2 * K, beams * width), dim=1)  # (n, <= 2K)
        top_beams = top_ids // width
        top_tokens = row_tokens.view(n, beams * width).gather(1, top_ids)
        is_eos = top_tokens == EOS_ID
        # Continue with the K best non-EOS candidates (at most K of the 2K are EOS). With a beam wider
        # than the vocabulary allows, fewer (and hypotheses at -inf, which can never finish).
        next_scores, picks = top_scores.masked_fill(is_eos, float("-inf")).topk(min(K, top_scores.size(1)), dim=1)
        # EOS candidates that rank among the top K finish. The step's one read to the host: which
        # finish, from which beam, at what score, and each sentence's best open score.
        finish = is_eos[:, :K] & torch.isfinite(top_scores[:, :K])  # (n, <= K)
        top = finish.size(1)
        read = torch.cat(
            [finish.to(top_scores.dtype), top_beams[:, :K].to(top_scores.dtype), top_scores[:, :K], next_scores[:, :1]],
            dim=1,
        ).tolist()  # n x (3 top + 1)
        token_lists, penalty = None, length_penalty(step + 1, alpha)
        for i, row_read in enumerate(read):
            for j in range(top):
                if row_read[j]:
                    if token_lists is None:
                        token_lists = tokens.tolist()  # only in steps where hypotheses finish
                    raw = row_read[2 * top + j]
                    hypothesis = Hypothesis(
                        tokens=token_lists[i * beams + int(row_read[top + j])][1:],
                        score=raw / penalty,
                        logprob=raw,
                        hit_max_len=forced[i],
                    )
                    finished[open_ids[i]].append(hypothesis)
        rows = (torch.arange(n, device=device)[:, None] * beams + top_beams.gather(1, picks)).view(-1)
        tokens = torch.cat([tokens[rows], top_tokens.gather(1, picks).view(-1, 1)], dim=1)
        scores = next_scores

        done = _closed(finished, open_ids, [row_read[-1] for row_read in read], forced, limits, K, alpha, nbest)
        if all(done):
            break
        if any(done):
            kept = [i for i, closed in enumerate(done) if not closed]
            keep = torch.tensor(kept, device=device)
            kept_beams = scores.size(1)
            keep_rows = (keep[:, None] * kept_beams + torch.arange(kept_beams, device=device)).view(-1)
            tokens, scores = tokens[keep_rows], scores[keep]
            open_ids, limits = [open_ids[i] for i in kept], [limits[i] for i in kept]
            prefix = None if prefix is None else prefix[keep]
            decoder.select(rows[keep_rows], keep)
        else:
            decoder.select(rows)
    return [sorted(hyps, key=lambda h: -h.score)[:nbest] for hyps in finished]


def _only(row_scores: torch.Tensor, row_tokens: torch.Tensor, rows: torch.Tensor, token, score: torch.Tensor) -> None:
    """Hypothesis rows `rows` (n*beams,) bool may continue only with `token` at `score` (rows,): their
    first candidate becomes that, the others -inf. In place; a prefix's forced token, EOS at the limit."""
    row_scores.masked_fill_(rows[:, None], float("-inf"))
    row_scores[:, 0] = torch.where(rows, score, row_scores[:, 0])
    row_tokens[:, 0] = torch.where(rows, token, row_tokens[:, 0])


def _closed(
    finished,
    open_ids: list[int],
    best_open: list[float],
    forced: list[bool],
    limits: list[int],
    beam_size: int,
    alpha: float,
    nbest: int,
) -> list[bool]:
    """Which open sentences are done: forced to end, K hypotheses finished, or no open one can still
    beat the `nbest`-th finished (host values only)."""
    done = list(forced)
    for i, sentence in enumerate(open_ids):
        hyps = finished[sentence]
        if done[i] or len(hyps) >= beam_size:
            done[i] = True
        elif len(hyps) >= nbest:
            kth_best = sorted((h.score for h in hyps), reverse=True)[nbest - 1]
            bound = best_open[i] / length_penalty(limits[i], alpha)
            done[i] = bound <= kth_best or math.isinf(best_open[i])
    return done


@torch.inference_mode()  # no_grad, minus version counting and view tracking: a few % here
def translate_ids(
    model: EncoderDecoder | Sequence[EncoderDecoder],
    sources: list[list[int]],
    search: Search = Search(),
    *,
    device: torch.device | str = "cpu",
    weights: Sequence[float] | None = None,
    autocast=None,
    progress=None,
    stop=None,
) -> list[list[Hypothesis]]:
    """Decode token-id sources (without EOS) as `search` says, in length-sorted batches; results in input
    order. With `search.sampling`, one sampled hypothesis per sentence (the beam size is not used).

    A beam of 1 runs greedy search. `model` may be a list of models sharing one vocabulary: an ensemble
    (`EnsembleDecoder`, optionally `weights`). The hypotheses start with their `search.prefixes`. Sources
    longer than the model's positions, and prefixes that leave no room for EOS, are cut by the caller (see
    `Translator`). `stop`, if given, is asked before every batch; True raises `Interrupted`. On a CPU,
    `search.workers` > 1 decodes that many batches at a time, one core each (`in_processes`).
    """
    beam_size, sampling, prefixes = search.beam_size, search.sampling, search.prefixes
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    results: list[list[Hypothesis]] = [[] for _ in sources]
    limit = min(m.cfg.max_positions for m in models) - 1

    def attempt(indices: list[int]) -> list[list[Hypothesis]]:
        src = pad_sequences([sources[i] for i in indices], suffix=[EOS_ID]).to(device)  # (B, S)
        with autocast() if autocast is not None else contextlib.nullcontext():
            start = search.start
            if isinstance(start, list):  # one per source: this batch's, (B,)
                start = torch.tensor([start[i] for i in indices], dtype=torch.long, device=device)
            decoders = [ModelDecoder(m, src, search.use_cache, start, search.never) for m in models]
            decoder = decoders[0] if len(decoders) == 1 else EnsembleDecoder(decoders, weights)
            lens = max_lengths(src, search.max_len_a, search.max_len_b, limit, search.doubled_by)  # (B,)
            prefix = None
            if prefixes is not None and any(prefixes[i] for i in indices):
                prefix = pad_sequences([prefixes[i] for i in indices]).to(device)  # (B, P), PAD after each
                lens = torch.maximum(lens, (prefix != PAD_ID).sum(dim=1) + 1)  # room for the prefix and EOS
            if beam_size == 1 or sampling is not None:
                return [[h] for h in greedy_search(decoder, lens, sampling, prefix)]
            return beam_search(decoder, lens, beam_size, search.alpha, search.nbest, prefix)

    def done(indices: list[int], batch_results: list[list[Hypothesis]]) -> None:
        for index, hyps in zip(indices, batch_results):
            results[index] = hyps
        if progress is not None:
            progress.update(len(indices))

    def decode_batch(indices: list[int]) -> None:
        try:
            batch_results = attempt(indices)
        except torch.cuda.OutOfMemoryError:
            if len(indices) == 1:
                raise
            batch_results = None
        if batch_results is None:
            # Out of memory. Only now, outside the `except` block, is the failed attempt's traceback
            # gone, and with it the frames that held its encoder output, caches and logits: free them
            # for real, then split the batch and retry each half.
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            half = len(indices) // 2
            decode_batch(indices[:half])
            decode_batch(indices[half:])
            return
        done(indices, batch_results)

    hypotheses = 1 if sampling is not None else beam_size  # rows per sentence in a batch
    with contextlib.ExitStack() as in_eval_mode:
        for each in models:
            in_eval_mode.enter_context(eval_mode(each))
        lengths = [len(s) for s in sources]
        budget = max(1, search.batch_tokens // hypotheses)  # source tokens per batch
        # Sampling draws from one generator in batch order, so that its samples depend on the seed alone.
        workers = search.workers if torch.device(device).type == "cpu" and sampling is None else 1
        if workers > 1:  # enough batches that the workers end together: about 4 each, not tiny ones
            budget = min(budget, max(PARALLEL_MIN_BATCH_TOKENS, sum(lengths) // (4 * workers)))
        batches = batches_in_order(lengths, budget)
        if workers > 1 and len(batches) > 1:  # never more processes than batches
            in_processes(batches, attempt, done, min(workers, len(batches)), stop)
        else:
            for indices in batches:
                if stop is not None and stop():
                    raise Interrupted
                decode_batch(indices)
    return results
