"""Greedy decoding and batched beam search, both incremental over the decoder's key/value cache.

The search functions talk to a `StepDecoder` (the protocol below): `step(tokens) -> log-probabilities
of the next token` and `select(rows, sentences)` to follow the surviving hypotheses. `ModelDecoder`
implements it for any `EncoderDecoder` (with the cache, or recomputing the prefix for comparison),
`EnsembleDecoder` for several models at once (the weighted mean of their log-probabilities); tests
implement it with hand-written probability tables. A target prefix (`prefixes`) forces the first
tokens of a sentence; search continues from there. Text in, text out goes through
`transformer.inference.translator.Translator`, which calls `translate_ids` here.

Shapes: the legend of transformer/attention.py (B, S, T, D, K, ...), and here n open sentences, t tokens so
far (BOS included), V vocabulary.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from transformer.attention import padding_mask
from transformer.config import DEFAULT_BATCH_TOKENS
from transformer.data.batching import batches_in_order, pad_sequences
from transformer.errors import Interrupted
from transformer.inference.parallel import PARALLEL_MIN_BATCH_TOKENS, in_processes
from transformer.model import eval_mode
from transformer.special import BOS_ID, EOS_ID, PAD_ID


@dataclass
class Hypothesis:
    tokens: list[int]  # without BOS and EOS
    score: float  # log-probability / length penalty (what the beam ranks by)
    logprob: float  # total log-probability, EOS included
    hit_max_len: bool = False
    text: str = ""  # detokenized (filled in by `Translator`)


class EncoderDecoder(Protocol):
    """What decoding needs of a model (`transformer.model.Transformer` is one)."""

    cfg: object  # .max_positions
    training: bool

    def encode(self, src: torch.Tensor) -> torch.Tensor: ...  # (B, S) -> (B, S, D)

    def decode(self, tgt_in: torch.Tensor, memory, src_pad_mask, cache=None) -> torch.Tensor: ...  # (B, T, V)

    def decode_step(self, tokens: torch.Tensor, cache) -> torch.Tensor: ...  # (B, t) -> (B, V)

    def new_cache(self, memory: torch.Tensor, src_pad_mask: torch.Tensor): ...

    def train(self, mode: bool = True): ...


@runtime_checkable
class StepDecoder(Protocol):
    """One decoding step at a time over a batch of hypothesis rows."""

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (rows, t) -> float32 log-probabilities (rows, V) of token t+1."""

    def select(self, rows: torch.Tensor, sentences: torch.Tensor | None = None) -> None:
        """Continue with hypothesis rows `rows`; if given, keep only sentence rows `sentences`."""


@runtime_checkable
class LogitsDecoder(StepDecoder, Protocol):
    """A StepDecoder that also hands out raw logits, so that search takes log-probabilities in blocks."""

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (rows, t) -> logits (rows, V) of token t+1."""


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ((5 + length) / 6) ** alpha (Wu et al., 2016); 1 when alpha = 0."""
    return ((5.0 + length) / 6.0) ** alpha


def max_lengths(src: torch.Tensor, max_len_a: float, max_len_b: int, limit: int) -> torch.Tensor:
    """Per sentence: at most a * source_length + b output tokens (EOS included), capped by `limit`."""
    src_lens = (src != PAD_ID).sum(dim=1) - 1  # without the source EOS
    # Capped while still float: a limit beyond int64 (max_len_a=1e30: "no limit") wrapped to 1 token.
    lengths = torch.floor(src_lens.double() * float(max_len_a) + float(max_len_b))
    return lengths.clamp(min=1, max=limit).long()


class ModelDecoder:
    """Runs the Transformer decoder one step at a time for `search`."""

    def __init__(self, model: EncoderDecoder, src: torch.Tensor, use_cache: bool = True):
        self.model = model
        memory = model.encode(src)  # (B, S, D)
        src_pad_mask = padding_mask(src, PAD_ID)  # (B, S)
        self.cache = model.new_cache(memory, src_pad_mask) if use_cache else None
        self.memory, self.src_pad_mask = memory, src_pad_mask

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (rows, t) -> logits (rows, V) of token t+1, in the model's compute dtype."""
        if self.cache is not None:
            return self.model.decode_step(tokens, self.cache)
        # Without the cache, recompute the whole prefix: the slow reference for tests and benchmarks.
        return self.model.decode(tokens, self.memory, self.src_pad_mask)[:, -1]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (rows, t) -> log-probabilities (rows, V) of token t+1, in float32."""
        return torch.log_softmax(self.logits(tokens), dim=-1, dtype=torch.float32)

    def select(self, rows: torch.Tensor, sentences: torch.Tensor | None = None) -> None:
        """Continue with hypothesis rows `rows`; if given, keep only sentence rows `sentences`."""
        if self.cache is not None:
            self.cache.reorder_hypotheses(rows)
            if sentences is not None:
                self.cache.keep_sentences(sentences)
        elif sentences is not None:
            self.memory = self.memory.index_select(0, sentences)
            self.src_pad_mask = self.src_pad_mask.index_select(0, sentences)


class EnsembleDecoder:
    """Several decoders over the same vocabulary, stepping together: the next-token log-probabilities are
    the weighted mean of theirs (`weights` normalised to sum to 1), each model with its own encoder
    output and cache, all following the same hypotheses."""

    def __init__(self, decoders: list[StepDecoder], weights: list[float] | None = None):
        weights = [1.0] * len(decoders) if weights is None else list(weights)
        if not decoders or len(weights) != len(decoders):
            raise ValueError(f"an ensemble needs one weight per model ({len(decoders)} models, {len(weights)} weights)")
        total = sum(weights)
        self.decoders, self.weights = decoders, [w / total for w in weights]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (rows, t) -> the weighted mean of the models' float32 log-probabilities (rows, V)."""
        mean = None
        for weight, decoder in zip(self.weights, self.decoders):
            logprobs = decoder.step(tokens)  # (rows, V) float32
            mean = logprobs.mul_(weight) if mean is None else mean.add_(logprobs, alpha=weight)
        return mean

    def select(self, rows: torch.Tensor, sentences: torch.Tensor | None = None) -> None:
        for decoder in self.decoders:
            decoder.select(rows, sentences)


def row_topk(scores: torch.Tensor, k: int, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """`scores.topk(k, dim=1)`, found by first ranking blocks of `chunk` columns by their maxima.

    The k best entries of a row lie in the k blocks with the highest maxima: those k maxima are k
    entries at least as large as anything in the other blocks. On the CPU this reads a (rows, V)
    log-probability matrix about twice as fast as `topk` over all of it. Ties may resolve differently.
    """
    rows, width = scores.shape
    if width < 4 * k * chunk:
        return scores.topk(k, dim=1)
    if width % chunk:
        scores = F.pad(scores, (0, chunk - width % chunk), value=float("-inf"))
    block_max = scores.view(rows, -1, chunk).amax(dim=2)  # (rows, blocks)
    top_blocks = block_max.topk(k, dim=1).indices  # (rows, k)
    offsets = torch.arange(chunk, device=scores.device)
    columns = (top_blocks[:, :, None] * chunk + offsets).view(rows, k * chunk)  # (rows, k * chunk)
    values, picks = scores.gather(1, columns).topk(k, dim=1)  # (rows, k)
    return values, columns.gather(1, picks).clamp_(max=width - 1)


# Rows of logits turned into float32 log-probabilities at a time on the CPU. A whole batch's would be
# up to ~40 MB of fresh memory every step, which glibc maps and the kernel page-faults in anew each
# time (about a tenth of decoding's CPU time); blocks this size are reused from the heap instead.
CPU_LOGPROB_BLOCK_ROWS = 128


def top_candidates(
    decoder: StepDecoder, tokens: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens (rows, t) -> the k most probable next tokens per row (log-probabilities (rows, k) and
    ids (rows, k), best first; PAD and BOS excluded) and each row's EOS log-probability (rows,)."""
    if not isinstance(decoder, LogitsDecoder):  # one that only offers log-probabilities
        return _candidates(decoder.step(tokens), k)
    logits = decoder.logits(tokens)  # (rows, V)
    block = CPU_LOGPROB_BLOCK_ROWS if logits.device.type == "cpu" else max(1, logits.size(0))
    parts = [_candidates(torch.log_softmax(rows, dim=-1, dtype=torch.float32), k) for rows in logits.split(block)]
    return tuple(torch.cat(tensors) for tensors in zip(*parts))


def _never_generated(logprobs: torch.Tensor) -> torch.Tensor:
    """PAD and BOS masked out of (rows, V) log-probabilities, in place."""
    logprobs[:, PAD_ID] = float("-inf")  # integer indices: a fill on the device, no index tensor
    logprobs[:, BOS_ID] = float("-inf")  # copied from the host
    return logprobs


def _candidates(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _never_generated(logprobs)
    values, ids = row_topk(logprobs, min(k, logprobs.size(1)))  # (rows, k)
    return values, ids, logprobs[:, EOS_ID]


def _prefix_logprob(logprobs: torch.Tensor, wanted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows are still inside their target prefix (`wanted` (rows,): the prefix token of this step,
    PAD once a row's prefix has ended) and the log-probability (rows,) of that token."""
    return wanted != PAD_ID, logprobs.gather(1, wanted[:, None]).squeeze(1)


@dataclass
class Sampling:
    """Random sampling instead of search (back-translation, Edunov et al. 2018): each token is drawn from
    the `top_k` most probable ones (0: all), or from the smallest set whose probability reaches `top_p`
    (nucleus sampling; 1.0: all), after dividing the log-probabilities by `temperature`. The object
    keeps a generator seeded with `seed`: a new Sampling of the same seed gives the same input the same
    samples, and one object used again continues its random stream (the chunks of a long input are not
    sampled alike; for a repeatable call, pass a new Sampling). Hypothesis scores stay the model's own
    log-probabilities of the drawn tokens (untempered)."""

    top_k: int = 0
    top_p: float = 1.0
    temperature: float = 1.0
    seed: int = 1

    def __post_init__(self):
        if self.top_k < 0 or not 0.0 < self.top_p <= 1.0 or not 0.0 < self.temperature < math.inf:
            raise ValueError(f"sampling needs top_k >= 0, 0 < top_p <= 1 and a finite temperature > 0 (got {self})")
        self._generators: dict = {}

    def __call__(self, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logprobs (n, V) float32 -> drawn tokens (n,) and their log-probabilities (n,)."""
        scores = logprobs / self.temperature
        if self.top_k and self.top_k < scores.size(1):
            kth = scores.topk(self.top_k, dim=1).values[:, -1:]  # (n, 1)
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            ordered, order = scores.sort(dim=1, descending=True)  # (n, V)
            probs = ordered.softmax(dim=1)
            outside = probs.cumsum(dim=1) - probs >= self.top_p  # the first token always stays
            scores = scores.scatter(1, order, ordered.masked_fill(outside, float("-inf")))
        generator = self._generators.get(scores.device)
        if generator is None:
            generator = self._generators[scores.device] = torch.Generator(scores.device).manual_seed(self.seed)
        tokens = torch.multinomial(scores.softmax(dim=1), 1, generator=generator).squeeze(1)
        return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


@dataclass(frozen=True)
class Search:
    """A decoding as `translate_ids` runs it, every option resolved: the beam (1: greedy search), the
    length penalty `alpha`, `nbest` hypotheses per sentence, the length limit `max_len_a * source + max_len_b`,
    `batch_tokens` (source tokens times the beam per batch), `sampling` instead of a search, `prefixes`
    (per source, target token ids without BOS forced first, [] for none), `workers` (CPU processes) and
    `use_cache` (the key/value cache; False recomputes every prefix)."""

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
            logprobs = _never_generated(decoder.step(tokens))  # (n, V) float32
            if sampling is None:
                best_logprob, best_token = logprobs.max(dim=1)
            else:
                best_token, best_logprob = sampling(logprobs)
            eos_logprob = logprobs[:, EOS_ID]
            if in_prefix:
                active, wanted_logprob = _prefix_logprob(logprobs, prefix[:, step])
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
            row_scores, row_tokens, eos_logprob = _candidates(logprobs, 2 * K)  # (n*beams, width)
            wanted = prefix[:, step].repeat_interleave(beams)  # (n*beams,)
            active, wanted_logprob = _prefix_logprob(logprobs, wanted)
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
            decoders = [ModelDecoder(m, src, search.use_cache) for m in models]
            decoder = decoders[0] if len(decoders) == 1 else EnsembleDecoder(decoders, weights)
            lens = max_lengths(src, search.max_len_a, search.max_len_b, limit)  # (B,)
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
