"""CUDA paths, run where a GPU is present (skipped elsewhere; `pytest -m gpu` selects them): SDPA against
the reference formula, the fused loss under bf16/fp16 autocast, cached decoding, a fused-AdamW step with
the fp16 GradScaler."""

import pytest
import torch

from transformer.attention import attend, attention_math, causal_allowed
from transformer.config import ModelConfig
from transformer.inference.search import Search, translate_ids
from transformer.loss import output_cross_entropy, output_cross_entropy_reference
from transformer.model import build_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _full_fp32():
    """fp32 training turns TF32 on for the process (runtime.allow_tf32_for_training); these comparisons
    of fp32 results need it off, whichever test ran before."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_matches_the_reference_formula(dtype, tol, causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, 9, 16, device="cuda", dtype=dtype) for _ in range(3))
    allowed = torch.ones(3, 1, 1, 9, dtype=torch.bool, device="cuda")
    allowed[0, ..., 6:] = False  # padding in the first sentence
    if causal:  # decoder self-attention: SDPA's is_causal, no padding mask
        out, _ = attend(q, k, v, None, causal=True)
        mask = causal_allowed(9, 9, q.device)
    else:
        out, _ = attend(q, k, v, allowed)
        mask = allowed
    ref, _ = attention_math(q.float(), k.float(), v.float(), mask)
    assert torch.allclose(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("n_tokens", [300, 9000])  # 9000: three chunks, the weight's gradient summed over them
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_loss_under_autocast_on_cuda(dtype, n_tokens):
    torch.manual_seed(0)
    hidden = torch.randn(n_tokens, 64, device="cuda", requires_grad=True)
    weight = (torch.randn(500, 64, device="cuda") * 0.2).requires_grad_()
    target = torch.randint(0, 500, (n_tokens,), device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        loss, _, _ = output_cross_entropy(hidden, weight, target, 0.1)
    loss.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref, _, _ = output_cross_entropy_reference(hidden, weight, target, 0.1)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=2e-2)
    for ours, reference in zip(grads, (hidden.grad, weight.grad)):
        assert (ours - reference).norm() / reference.norm() < 2e-2


def test_cached_decoding_equals_recomputation_on_cuda():
    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=64, n_heads=4, d_ff=128, dropout=0.0), 100, 100, True).cuda().eval()
    sources = [[5 + (i * 7 + j) % 90 for j in range(3 + i % 5)] for i in range(12)]
    for beam in (1, 4):
        cached = translate_ids(model, sources, Search(beam_size=beam, max_len_b=8), device="cuda")
        plain = translate_ids(model, sources, Search(beam_size=beam, max_len_b=8, use_cache=False), device="cuda")
        assert [h[0].tokens for h in cached] == [h[0].tokens for h in plain]


def test_fused_adamw_and_grad_scaler_step():
    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=64, n_heads=4, d_ff=128), 100, 100, True).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    src = torch.randint(4, 100, (8, 10), device="cuda")
    tgt = torch.randint(4, 100, (8, 9), device="cuda")
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.float16):
            hidden = model(src, tgt, return_hidden=True).flatten(0, 1)
            loss, _, _ = output_cross_entropy(hidden, model.output.weight, tgt.flatten(), 0.1)
        scaler.scale(loss / tgt.numel()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    assert scaler.get_scale() > 0 and torch.isfinite(loss)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize("precision", ["auto", "fp32"])
def test_a_training_step_never_waits_for_the_gpu(precision, tmp_path, data_cache):
    """On CUDA, PyTorch itself can refuse every operation that makes the host wait for the device."""
    from tests.helpers import FAST, compose_config
    from transformer.training.trainer import Trainer

    cfg = compose_config(
        FAST + ["trainer.device=cuda", f"trainer.precision={precision}", "trainer.update_freq=2"], data_cache
    )
    trainer = Trainer(cfg, tmp_path)
    try:
        trainer.batches.updates.start(0, 0)
        loader = iter(trainer.batches.loader)
        micro, _ = next(loader)
        trainer.step.log.add(trainer.step(micro), micro)  # warm-up: allocator, kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                micro, _ = next(loader)
                trainer.step.log.add(trainer.step(micro), micro)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        numbers = trainer.step.log.read()
        assert numbers["skipped"] == 0 and numbers["finite_tokens"] > 0
    finally:
        trainer.leave_process_group(clean=True)
        trainer.monitor.close()


@pytest.mark.parametrize("backend", ["auto", "sdpa", "matmul"])
def test_every_backend_matches_the_formula_on_cuda(backend):
    from transformer.attention import MultiHeadAttention, SelfAttentionCache

    torch.manual_seed(0)
    x = torch.randn(3, 7, 32, device="cuda")
    pad = torch.zeros(3, 7, dtype=torch.bool, device="cuda")
    pad[1, 5:] = True
    reference = MultiHeadAttention(32, 4, backend="math").cuda().eval()
    attn = MultiHeadAttention(32, 4, backend=backend).cuda().eval()
    attn.load_state_dict(reference.state_dict())
    real = ~pad
    assert torch.allclose(attn(x, key_pad_mask=pad)[real], reference(x, key_pad_mask=pad)[real], atol=1e-4)
    cache = SelfAttentionCache()
    steps = torch.cat([attn(x[:, t : t + 1], causal=True, cache=cache) for t in range(7)], 1)
    assert torch.allclose(steps, reference(x, causal=True), atol=1e-4)


@pytest.fixture
def memory_limit():
    """`limit(n_bytes)`: cap this process's CUDA allocations at about n bytes; lifted after the test."""
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory

    def limit(n_bytes: int) -> None:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(1.0, n_bytes / total))

    yield limit
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


def test_a_decoding_batch_out_of_memory_is_split_and_retried(memory_limit):
    """512 sentences x beam 5 over a 32k vocabulary need about 2 GB at once; capped at 1 GB, the batch
    runs out of memory, is halved until the halves fit, and the results are those of small batches."""
    torch.manual_seed(0)
    model = (
        build_model(
            ModelConfig(d_model=256, n_heads=4, d_ff=512, encoder_layers=2, decoder_layers=2, dropout=0.0),
            32000,
            32000,
            True,
        )
        .cuda()
        .eval()
    )
    sources = [[5 + (i * 31 + j * 7) % 31000 for j in range(40 + i % 20)] for i in range(512)]
    settings = dict(beam_size=5, device="cuda", max_len_a=0.0, max_len_b=30)
    reference = translate_ids(model, sources, Search(batch_tokens=20_000), **settings)  # small batches
    ooms = torch.cuda.memory_stats().get("num_ooms", 0)
    memory_limit(1 << 30)
    limited = translate_ids(model, sources, Search(batch_tokens=10_000_000), **settings)  # one batch asked
    assert torch.cuda.memory_stats().get("num_ooms", 0) > ooms, "the batch fit: the test tests nothing"
    same = sum(a[0].tokens == b[0].tokens for a, b in zip(limited, reference))
    assert same >= 0.99 * len(sources)


def test_training_batches_too_large_for_the_gpu_stop_with_one_line(memory_limit, tmp_path, data_cache):
    """Every batch out of memory: skipped with a warning, and after OOM_SKIP_LIMIT in a row the run
    stops with a TrainingError that names trainer.max_tokens; the weights are untouched."""
    from tests.helpers import FAST, compose_config
    from transformer.training.run_dir import TrainingError
    from transformer.training.step import OOM_SKIP_LIMIT, StepResult
    from transformer.training.trainer import Trainer

    cfg = compose_config(
        FAST + ["trainer.device=cuda", "trainer.precision=fp32", "trainer.max_tokens=40000", "trainer.num_workers=0"],
        data_cache,
    )  # no worker left behind on failure
    trainer = Trainer(cfg, tmp_path)
    try:
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.batches.updates.start(0, 0)
        micro, _ = next(iter(trainer.batches.loader))  # ~40k tokens: hundreds of MB of activations
        memory_limit(torch.cuda.memory_allocated() + (8 << 20))  # 8 MB beyond the weights
        with pytest.raises(TrainingError, match="trainer.max_tokens=40000 is too large") as stopped:
            for _ in range(OOM_SKIP_LIMIT):
                assert trainer.step(micro) == StepResult(out_of_memory=True)
        assert "\n" not in str(stopped.value) and trainer.step.oom_in_a_row == OOM_SKIP_LIMIT
        assert all(torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))
    finally:
        trainer.leave_process_group(clean=True)
        trainer.monitor.close()


def test_max_tokens_auto_picks_a_budget_that_fits_and_refuses_one_that_does_not():
    """trainer.max_tokens_auto's real probe: the budget the search picks fits (with the headroom), the next
    rung does not, and a budget far past the GPU's memory is caught (out of memory), not raised."""
    from types import SimpleNamespace

    from transformer.training.batch_fit import RUNG, cuda_probe, largest_fitting_budget

    cfg = ModelConfig(d_model=512, n_heads=8, d_ff=2048, encoder_layers=6, decoder_layers=6, dropout=0.1)
    model = build_model(cfg, 8000, 8000, True).cuda()
    runtime = SimpleNamespace(
        device=torch.device("cuda"), autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    )
    fits = cuda_probe(model, runtime, max_len=256, vocab=8000, rdrop=False)
    assert fits(4096)
    assert not fits(2**24)  # 16M tokens of base: far more than any GPU holds
    budget, tries = largest_fitting_budget(fits, first=8192)
    assert budget is not None and budget >= 4096 and tries <= 30
    assert fits(budget) and not fits(budget + RUNG)
    assert all(p.grad is None for p in model.parameters())  # the probe leaves no gradients behind
