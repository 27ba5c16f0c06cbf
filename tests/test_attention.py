import pytest
import torch

from transformer.attention import (
    BACKENDS,
    CPU_ONE_QUERY_MATMUL_KEYS,
    MultiHeadAttention,
    SelfAttentionCache,
    attend,
    attention_math,
    causal_allowed,
    key_padding_allowed,
    padding_mask,
)


def test_causal_mask_is_bottom_right_aligned_for_cached_queries():
    # 2 new queries after 3 cached keys: they sit at positions 3 and 4.
    allowed = causal_allowed(query_len=2, key_len=5, device=torch.device("cpu"))
    assert allowed.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    square = causal_allowed(3, 3, torch.device("cpu"))
    assert square.tolist() == [[True, False, False], [True, True, False], [True, True, True]]


@pytest.mark.parametrize("causal", [False, True])
def test_fast_path_matches_explicit_softmax_math(causal):
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4).eval()
    x = torch.randn(3, 7, 32)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 5:] = True
    pad[2, 3:] = True
    fast = attn(x, key_pad_mask=pad, causal=causal)
    attn.need_weights = True  # switches to attention_math (SDPA on GPUs, matmuls on CPUs otherwise)
    slow = attn(x, key_pad_mask=pad, causal=causal)
    assert torch.allclose(fast, slow, atol=1e-5)
    weights = attn.last_weights  # (B, H, T, T)
    assert torch.allclose(weights.sum(-1), torch.ones(3, 4, 7), atol=1e-5)
    assert weights[2, :, :, 3:].abs().max() == 0  # padding gets no attention
    if causal:
        assert weights[0].triu(diagonal=1).abs().max() == 0  # no look at the future


def test_attention_math_by_hand():
    q = torch.tensor([[[[1.0, 0.0]]]])  # (1, 1, 1, 2)
    k = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    v = torch.tensor([[[[10.0, 0.0], [0.0, 10.0]]]])
    out, weights = attention_math(q, k, v)
    p = torch.softmax(torch.tensor([1 / 2**0.5, 0.0]), 0)
    assert torch.allclose(weights.flatten(), p)
    assert torch.allclose(out.flatten(), torch.stack([10 * p[0], 10 * p[1]]))


def test_padding_does_not_change_unpadded_outputs():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 2).eval()
    x = torch.randn(1, 4, 16)
    padded = torch.cat([x, torch.randn(1, 3, 16)], dim=1)
    pad = torch.tensor([[False] * 4 + [True] * 3])
    assert torch.allclose(attn(x), attn(padded, key_pad_mask=pad)[:, :4], atol=1e-6)


def test_cross_attention_beam_folding_equals_expanded_memory():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, cross=True).eval()
    memory = torch.randn(2, 5, 16)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    beams = 3
    queries = torch.randn(2 * beams, 4, 16)
    shared = attn(queries, memory_kv=attn.project_memory(memory), key_pad_mask=pad)
    expanded = attn(queries, memory=memory.repeat_interleave(beams, 0), key_pad_mask=pad.repeat_interleave(beams, 0))
    assert torch.allclose(shared, expanded, atol=1e-6)


def test_cached_self_attention_equals_full():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 6, 16)
    full = attn(x, causal=True)
    cache = SelfAttentionCache()
    steps = [attn(x[:, t : t + 1], causal=True, cache=cache) for t in range(6)]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
    # Two new positions at once after a cached past need the bottom-right triangle.
    cache = SelfAttentionCache()
    first = attn(x[:, :4], causal=True, cache=cache)
    rest = attn(x[:, 4:], causal=True, cache=cache)
    assert torch.allclose(torch.cat([first, rest], 1), full, atol=1e-5)


def test_mask_helpers():
    ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
    assert padding_mask(ids, 0).tolist() == [[False, False, True], [False, True, True]]
    assert key_padding_allowed(padding_mask(ids, 0)).shape == (2, 1, 1, 3)


@pytest.mark.parametrize("bf16", [False, True])
def test_cpu_path_under_no_grad_and_bf16_matches_explicit_softmax_math(bf16):
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4).eval()
    x = torch.randn(3, 7, 32)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[2, 4:] = True
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for causal in (False, True):
            attn.need_weights = False
            fast = attn(x, key_pad_mask=pad, causal=causal)
            attn.need_weights = True
            slow = attn(x, key_pad_mask=pad, causal=causal)
            assert fast.dtype == slow.dtype
            assert torch.allclose(fast.float(), slow.float(), atol=2e-2 if bf16 else 1e-5)


def test_cache_with_beam_reordering_matches_recomputing_each_history():
    """40 steps with beam-style reorders that duplicate, permute and drop rows (two reorders in a row too)."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4).eval()
    rows = 6
    history = torch.randn(rows, 1, 16)  # every row's inputs so far
    cache = SelfAttentionCache()
    with torch.no_grad():
        for step in range(40):
            out = attn(history[:, -1:], causal=True, cache=cache)  # (rows, 1, D)
            full = attn(history, causal=True)[:, -1:]
            assert torch.allclose(out, full, atol=1e-5), step
            keep = rows - 1 if step in (10, 25) else rows  # a sentence ends
            order = torch.randint(0, rows, (keep,))
            cache.reorder(order)
            if step % 7 == 3:  # a second reorder before the next step composes with the first
                again = torch.randperm(keep)
                cache.reorder(again)
                order = order[again]
            history = torch.cat([history[order], torch.randn(keep, 1, 16)], dim=1)
            rows = keep
    assert cache.length == 40


def test_cpu_path_gradients_match_explicit_softmax_math():
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4)
    x = torch.randn(3, 7, 32, requires_grad=True)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 5:] = True
    grads = []
    for need_weights in (False, True):
        attn.need_weights = need_weights
        attn.zero_grad()
        x.grad = None
        (attn(x, key_pad_mask=pad, causal=True) ** 2).sum().backward()
        grads.append((x.grad.clone(), attn.qkv_proj.weight.grad.clone()))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-5)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Every backend of model.attention against the reference formula (attention_math), on the CPU:
# self-attention, causal self-attention with a cache, cross-attention with folded beams, all with padding.
# "sdpa_gpu" is what `auto` runs on a GPU (SDPA without cuDNN's kernel); on the CPU it runs SDPA's
# CPU kernels under the same kernel restriction.

ALL_BACKENDS = list(BACKENDS) + ["sdpa_gpu"]


def _module(backend, cross=False, seed=0):
    torch.manual_seed(seed)
    attn = MultiHeadAttention(32, 4, cross=cross).eval()
    attn.backend = backend  # the constructor accepts only the public names
    return attn


def _padding():
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 5:] = True
    pad[2, 2:] = True
    return pad


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_every_backend_matches_the_formula_in_self_attention_forward_and_backward(backend, causal):
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(1))
    results = {}
    for name in (backend, "math"):
        attn = _module(name)
        inputs = x.clone().requires_grad_(True)
        out = attn(inputs, key_pad_mask=_padding(), causal=causal)
        real = ~_padding()  # padded query rows are not compared
        (out[real] * torch.linspace(-1, 1, 32)).sum().backward()
        results[name] = (out[real].detach(), inputs.grad[real], attn.qkv_proj.weight.grad)
    for fast, reference in zip(results[backend], results["math"]):
        assert torch.allclose(fast, reference, atol=1e-5), backend


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_every_backend_matches_the_formula_with_a_cache(backend):
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(2))
    reference = _module("math")(x, causal=True)  # full causal recomputation
    attn = _module(backend)
    cache = SelfAttentionCache()
    # one position, then two at once (the bottom-right-aligned triangle), then one at a time
    chunks = [(0, 1), (1, 3)] + [(t, t + 1) for t in range(3, 7)]
    steps = [attn(x[:, a:b], causal=True, cache=cache) for a, b in chunks]
    assert torch.allclose(torch.cat(steps, 1), reference, atol=1e-5), backend


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_every_backend_matches_the_formula_in_cross_attention(backend):
    generator = torch.Generator().manual_seed(3)
    memory, beams = torch.randn(3, 7, 32, generator=generator), 2
    queries = torch.randn(3 * beams, 4, 32, generator=generator)
    reference_attn = _module("math", cross=True)
    reference = reference_attn(
        queries, memory=memory.repeat_interleave(beams, 0), key_pad_mask=_padding().repeat_interleave(beams, 0)
    )
    attn = _module(backend, cross=True)
    folded = attn(queries, memory_kv=attn.project_memory(memory), key_pad_mask=_padding())  # beams folded
    assert torch.allclose(folded, reference, atol=1e-5), backend


def test_the_backend_is_a_model_setting():
    from transformer.config import ATTENTION_BACKENDS, ModelConfig
    from transformer.model import build_model

    assert ATTENTION_BACKENDS == BACKENDS
    model = build_model(ModelConfig(attention="sdpa"), 50, 50, True)
    assert {m.backend for m in model.modules() if isinstance(m, MultiHeadAttention)} == {"sdpa"}
    with pytest.raises(ValueError, match="attention backend 'flash'"):
        MultiHeadAttention(16, 2, backend="flash")


@pytest.mark.parametrize("keys", [3, CPU_ONE_QUERY_MATMUL_KEYS, 20])
def test_auto_on_a_cpu_picks_by_shape_and_matches_the_formula(keys, monkeypatch):
    """One query (a decoding step) over many keys takes the matmuls, over a few SDPA; both give the formula."""
    import transformer.attention as attention

    generator = torch.Generator().manual_seed(keys)
    q = torch.randn(6, 4, 1, 8, generator=generator)
    k, v = (torch.randn(6, 4, keys, 8, generator=generator) for _ in range(2))
    allowed = torch.ones(6, 1, 1, keys, dtype=torch.bool)
    allowed[2, ..., keys // 2 :] = False
    reference = attention_math(q, k, v, allowed)[0]
    sdpa, matmul, used = attention.F.scaled_dot_product_attention, attention.matmul_attention, []
    monkeypatch.setattr(attention, "matmul_attention", lambda *a, **kw: used.append("matmul") or matmul(*a, **kw))
    monkeypatch.setattr(
        attention.F, "scaled_dot_product_attention", lambda *a, **kw: used.append("sdpa") or sdpa(*a, **kw)
    )
    out, _ = attend(q, k, v, allowed)
    assert used == (["matmul"] if keys >= CPU_ONE_QUERY_MATMUL_KEYS else ["sdpa"])
    assert torch.allclose(out, reference, atol=1e-6)
    attend(q.expand(6, 4, 2, 8), k, v, allowed)  # two queries: SDPA, as in training
    assert used[-1] == "sdpa"


def test_the_caches_cross_attention_mask_follows_the_sentences_kept():
    # The decoder cache builds the memory's allowed mask once (not per layer and step); dropping finished
    # sentences must drop their rows of it too, or attention would read another sentence's padding.
    from transformer.attention import DecoderCache

    src_pad = torch.tensor([[False, False, True], [False, True, True], [False, False, False]])
    memory_kv = [(torch.randn(3, 2, 3, 4), torch.randn(3, 2, 3, 4))]
    cache = DecoderCache(memory_kv, src_pad)
    assert torch.equal(cache.memory_allowed, key_padding_allowed(src_pad))
    cache.keep_sentences(torch.tensor([2, 0]))
    assert torch.equal(cache.memory_allowed, key_padding_allowed(src_pad[[2, 0]]))
    assert cache.memory_allowed.shape == (2, 1, 1, 3)
