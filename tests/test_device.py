"""Device placement, proven without a GPU: training's forward, fused loss and backward, cached decoding and
search's per-step tensor work run on the `meta` device. Meta tensors have shapes and dtypes but no values;
code on them takes the non-CPU paths (`device.type != "cpu"`), and an operation mixing them with a CPU
tensor fails. Index tensors are the exception (meta lets a CPU index through, a GPU copies it from the host
or refuses it), so `HostTensors` also records every operation that takes or makes a CPU tensor.

The models are built on the CPU and moved: built under `with torch.device("meta")`, the model code's own
factory calls without `device=` would land on meta as well, and the bugs looked for here would hide."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests.helpers import HostReads
from transformer.attention import BACKENDS, padding_mask
from transformer.config import ModelConfig
from transformer.data.batching import Batch
from transformer.inference.candidates import row_topk, top_candidates
from transformer.inference.decoders import ModelDecoder
from transformer.inference.search import beam_search, greedy_search, max_lengths
from transformer.loss import batch_loss
from transformer.model import build_model
from transformer.special import BOS_ID, PAD_ID

META = torch.device("meta")
VOCAB = 60


class HostTensors(TorchDispatchMode):
    """Records (as operation names) every operation in the block that takes or makes a CPU tensor, and
    every `torch.tensor(data)`, which makes its tensor on the host (then copies it) past the dispatcher."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __enter__(self):
        self.original_tensor = torch.tensor

        def tensor(*args, **kwargs):
            self.seen.append("torch.tensor")
            return self.original_tensor(*args, **kwargs)

        torch.tensor = tensor
        return super().__enter__()

    def __exit__(self, *exc):
        torch.tensor = self.original_tensor
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tree_flatten((args, kwargs, out))[0]):
            self.seen.append(str(func.overloadpacket))
        return out


def meta_model(backend: str = "auto", dtype: torch.dtype = torch.float32, dropout: float = 0.1):
    torch.manual_seed(0)
    cfg = ModelConfig(
        d_model=32,
        n_heads=4,
        d_ff=64,
        encoder_layers=2,
        decoder_layers=2,
        dropout=dropout,
        attention_dropout=dropout,
        src_word_dropout=dropout,
        tgt_word_dropout=dropout,
        attention=backend,
    )
    return build_model(cfg, VOCAB, VOCAB, True).to(META, dtype)


def meta_ids(rows: int, length: int) -> torch.Tensor:
    return torch.randint(4, VOCAB, (rows, length), device=META)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_training_step_runs_on_meta(backend, dtype):
    # The trainer's step: batch_loss (forward with dropout, the fused output loss), then backward. Autocast
    # has no meta version; the half-precision models take the loss's bf16 and fp16 (float32-stored) paths.
    model = meta_model(backend, dtype)
    rows, tgt_len = 3, 6
    batch = Batch(
        meta_ids(rows, 7),
        meta_ids(rows, tgt_len),
        meta_ids(rows, tgt_len),
        rows * tgt_len - 2,
        tgt_positions=torch.arange(rows * tgt_len - 2, device=META),
    )  # made by collate, moved
    with HostTensors() as host:
        loss, nll, correct = batch_loss(model, batch, smoothing=0.1)
        (loss / batch.num_tgt_tokens).backward()
    assert host.seen == []
    assert loss.device == nll.device == META
    assert loss.shape == nll.shape == () and loss.dtype == nll.dtype == torch.float32
    assert loss.requires_grad and not nll.requires_grad
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert (param.grad.device, param.grad.shape, param.grad.dtype) == (META, param.shape, dtype), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_decoding_with_prefixes_and_reordering_runs_on_meta(backend):
    model = meta_model(backend, dropout=0.0).eval()
    sentences, beams = 3, 2
    src = meta_ids(sentences, 7)
    kept_sentences, kept_rows = torch.tensor([0, 2], device=META), torch.tensor([0, 1, 4, 5], device=META)
    with torch.no_grad(), HostTensors() as host:
        memory = model.encode(src)
        cache = model.new_cache(memory, padding_mask(src, PAD_ID))
        tokens = meta_ids(sentences * beams, 2)  # a forced prefix: two positions at once
        steps = [model.decode(tokens, None, None, cache)]
        for _ in range(3):  # one position per step, hypotheses reordered
            cache.reorder_hypotheses(torch.arange(sentences * beams, device=META).flip(0))
            tokens = torch.cat([tokens, meta_ids(sentences * beams, 1)], dim=1)
            steps.append(model.decode(tokens[:, -1:], None, None, cache))
        cache.keep_sentences(kept_sentences)  # the middle sentence finished
        cache.reorder_hypotheses(kept_rows)
        tokens = torch.cat([tokens[kept_rows], meta_ids(4, 2)], dim=1)
        steps.append(model.decode(tokens[:, -2:], None, None, cache))  # two positions after a past
        uncached = model.decode(tokens, memory[kept_sentences], padding_mask(src[kept_sentences], PAD_ID))
    assert host.seen == []
    assert [tuple(step.shape) for step in steps] == [(6, 2, VOCAB)] + [(6, 1, VOCAB)] * 3 + [(4, 2, VOCAB)]
    assert uncached[:, -2:].shape == steps[-1].shape and cache.length == tokens.size(1)
    assert all(step.device == META and step.dtype == torch.float32 for step in steps)
    for self_kv, (keys, values) in zip(cache.self_kv, cache.memory_kv):
        assert self_kv.keys.shape == self_kv.values.shape == (4, 4, tokens.size(1), 8)
        assert keys.shape == values.shape == (2, 4, 7, 8)
        assert self_kv.keys.device == keys.device == cache.memory_allowed.device == META


@pytest.mark.parametrize("width, k", [(VOCAB, 4), (5000, 4)])  # torch.topk, then ranked blocks
def test_row_topk_runs_on_meta(width, k):
    with HostTensors() as host:
        values, ids = row_topk(torch.randn(6, width, device=META), k)
    assert host.seen == []
    assert (values.shape, values.device, ids.shape, ids.dtype, ids.device) == ((6, k), META, (6, k), torch.long, META)


class LogprobsOnly:
    """A StepDecoder without `logits`: top_candidates takes its path for log-probabilities."""

    def __init__(self, decoder: ModelDecoder):
        self.decoder = decoder

    def step(self, tokens):
        return self.decoder.step(tokens)

    def select(self, rows, sentences=None):
        self.decoder.select(rows, sentences)


def test_candidates_and_length_limits_run_on_meta():
    model = meta_model(dropout=0.0).eval()
    src = meta_ids(3, 7)
    with torch.no_grad(), HostTensors() as host:
        lens = max_lengths(src, 1.2, 10, model.cfg.max_positions - 1)
        decoder = ModelDecoder(model, src)
        tokens = torch.full((3, 1), BOS_ID, device=META)
        candidates = top_candidates(decoder, tokens, 4)  # from logits, in one block on meta

        from_logprobs = top_candidates(LogprobsOnly(decoder), tokens, 4)
    assert host.seen == []
    assert (lens.shape, lens.dtype, lens.device) == ((3,), torch.long, META)
    for values, ids, eos in (candidates, from_logprobs):
        assert values.shape == ids.shape == (3, 4) and eos.shape == (3,)
        assert values.dtype == eos.dtype == torch.float32 and ids.dtype == torch.long
        assert values.device == ids.device == eos.device == META


STEP = "-- step --"


class StepMarkingDecoder(ModelDecoder):
    """ModelDecoder that writes STEP into `reads` at every decoding step."""

    def __init__(self, model, src, reads: HostReads):
        super().__init__(model, src)
        self.reads = reads

    def logits(self, tokens):
        self.reads.seen.append(STEP)
        return super().logits(tokens)


def reads_per_step(seen: list[str]) -> list[list[str]]:
    """The reads before the first step, then those of each step."""
    parts = [[]]
    for name in seen:
        if name == STEP:
            parts.append([])
        else:
            parts[-1].append(name)
    return parts


# What search.py reads back to the host in a decoding step in which no sentence finishes or is forced
# to end (the common step), in order; meta runs it with placeholder answers. Beam search reads once per
# step (which candidates finish, from which beam, at what score, and each sentence's best open score:
# one packed tensor), greedy search once (whether any sentence ended).
BEAM_STEP_READS = ["Tensor.tolist"]
GREEDY_STEP_READS = ["aten._local_scalar_dense"]  # `if not done.any()`
BATCH_READS = {
    "beam": ["Tensor.tolist"],  # the length limits, kept on the host
    "greedy": ["aten._local_scalar_dense"],
}  # `int(max_lens.max())`


@pytest.mark.parametrize("search", ["beam", "greedy"])
def test_search_steps_run_on_meta_and_their_host_reads_are_counted(search):
    model = meta_model(dropout=0.0).eval()
    src = meta_ids(3, 7)
    steps = 4
    with torch.no_grad(), HostReads(meta_int=steps) as reads, HostTensors() as host:
        decoder = StepMarkingDecoder(model, src, reads)
        lens = max_lengths(src, 1.2, 10, model.cfg.max_positions - 1)
        if search == "beam":
            beam_search(decoder, lens, beam_size=3)
        else:
            greedy_search(decoder, lens)
    per_step = reads_per_step(reads.seen)
    assert per_step[0] == BATCH_READS[search]  # once per batch
    step_reads = BEAM_STEP_READS if search == "beam" else GREEDY_STEP_READS
    assert per_step[1:] == [step_reads] * steps
    # Nothing is copied from the host but, in beam search, which sentences are at their length limit
    # in the one step they reach it (here the last, for all three).
    assert host.seen == (["torch.tensor"] if search == "beam" else [])
    assert decoder.cache.length == steps and decoder.cache.self_kv[0].keys.device == META
