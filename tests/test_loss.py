"""The fused label-smoothed loss against plain autograd (smoothing, padding, chunks, bf16), and the
learning-rate schedule against its formula."""

import math

import pytest
import torch
import torch.nn.functional as F

import transformer.loss as loss_module
from transformer.config import ModelConfig
from transformer.data.batching import pad_sequences
from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer.loss import (
    batch_loss,
    output_cross_entropy,
    output_cross_entropy_reference,
    rdrop_cross_entropy_reference,
)
from transformer.model import build_model
from transformer.training.optim import inverse_sqrt_schedule


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("n_tokens", [13, 2100])  # 2100 spans several chunks
def test_fused_loss_and_gradients_match_autograd_reference(smoothing, n_tokens):
    torch.manual_seed(0)
    hidden = torch.randn(n_tokens, 16)
    weight = torch.randn(37, 16)
    target = torch.randint(0, 37, (n_tokens,))
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, nll, correct = output_cross_entropy(h1, w1, target, smoothing)
    ref_loss, ref_nll, ref_correct = output_cross_entropy_reference(h2, w2, target, smoothing)
    assert correct.item() == ref_correct.item() > 0  # random logits: the most probable is the argmax
    assert not correct.requires_grad
    (2.5 * loss).backward()
    (2.5 * ref_loss).backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert nll.item() == pytest.approx(ref_nll.item(), rel=1e-5)
    assert torch.allclose(h1.grad, h2.grad, atol=1e-4)
    assert torch.allclose(w1.grad, w2.grad, atol=1e-4)


def test_fused_loss_under_bf16_autocast_is_close():
    torch.manual_seed(0)
    hidden, weight = torch.randn(64, 32), torch.randn(50, 32) * 0.3
    target = torch.randint(0, 50, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, _ = output_cross_entropy(hidden, weight, target, 0.1)
    ref, _, _ = output_cross_entropy_reference(hidden, weight, target, 0.1)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(ref.item(), rel=2e-2)


@pytest.mark.parametrize("rdrop", [0.0, 5.0])  # 5: the KL weight 2.5 on the products, not only its sign
@pytest.mark.parametrize("product_rows", [100, 300, 1024])  # chunks of 256 (R-Drop: 128 per pass) larger
def test_bf16_gradients_taken_in_the_forward_pass_match_the_reference(rdrop, product_rows, monkeypatch):
    # than the rows gathered for Gᵀ H, one chunk at a time (256 of 300), several chunks at a time
    # bf16 takes G W chunk by chunk in the forward pass and Gᵀ H over WEIGHT_PRODUCT_ROWS rows at a time,
    # summed in float32; 2100 tokens span several chunks. Nothing of N x V is kept for the backward pass.
    # R-Drop: two passes of 1050 tokens that disagree a little, its KL term's gradient scaled on the products.
    monkeypatch.setattr(loss_module, "WEIGHT_PRODUCT_ROWS", product_rows)
    torch.manual_seed(0)
    first = torch.randn(1050, 32)
    hidden, weight = torch.cat([first, first + 0.3 * torch.randn(1050, 32)]), torch.randn(300, 32) * 0.3
    target = torch.randint(0, 300, (1050,)).repeat(2)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, _ = output_cross_entropy(h1, w1, target, 0.1, rdrop)
    assert loss.grad_fn.mode == "eager"
    assert loss.grad_fn.saved_tensors and all(t.numel() < 2100 * 300 for t in loss.grad_fn.saved_tensors)
    loss.backward()
    with pytest.raises(RuntimeError, match="freed"):  # saved for backward, so freed by it: nothing held after
        _ = loss.grad_fn.saved_tensors
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    reference = (
        rdrop_cross_entropy_reference(h2, w2, target, 0.1, rdrop)
        if rdrop
        else output_cross_entropy_reference(h2, w2, target, 0.1)
    )
    reference[0].backward()
    assert loss.item() == pytest.approx(reference[0].item(), rel=1e-2)
    for ours, exact in ((h1.grad, h2.grad), (w1.grad, w2.grad)):
        assert ours.dtype == torch.float32
        assert (ours - exact).norm() / exact.norm() < 2e-2


def test_without_autograd_the_loss_is_the_same_and_keeps_no_gradient(monkeypatch):
    # Validation runs under no_grad: the same loss, NLL and count, and no gradient products computed.
    import transformer.loss as loss_module

    modes = []

    class Recorded(loss_module._LogitGradient):
        def __init__(self, *args):
            super().__init__(*args)
            modes.append(self.mode)

    monkeypatch.setattr(loss_module, "_LogitGradient", Recorded)
    torch.manual_seed(0)
    hidden, weight = torch.randn(600, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    target = torch.randint(0, 40, (600,))
    with_grad = output_cross_entropy(hidden, weight, target, 0.1)
    with torch.no_grad():
        without = output_cross_entropy(hidden, weight, target, 0.1)
    with torch.inference_mode():
        rdrop_without = output_cross_entropy(hidden, weight, target, 0.1, rdrop=1.0)
    rdrop_with = output_cross_entropy(hidden, weight, target, 0.1, rdrop=1.0)
    assert modes == ["eager", "none", "none", "eager"]
    assert all(torch.equal(a.detach(), b) for a, b in zip(rdrop_with, rdrop_without))
    assert all(torch.equal(a.detach(), b) for a, b in zip(with_grad, without))
    loss, _, _ = loss_module._FusedOutputCrossEntropy.apply(hidden, weight, target, 0.1, 0.0, torch.float32, False)
    with pytest.raises(RuntimeError, match="gradient_wanted=False"):
        loss.backward()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_a_target_whose_probability_underflows_float32_keeps_its_exact_loss(smoothing):
    # The NLL comes from the softmax at the largest logit, not at the target: a target 150 nats below
    # the best (p_y = e^-150, zero in float32) must still cost 150 nats and give finite gradients.
    hidden = torch.tensor([[150.0, 0.0, 0.0], [0.0, 2.0, 1.0]], requires_grad=True)
    target = torch.tensor([1, 1])
    loss, nll, correct = output_cross_entropy(hidden, torch.eye(3), target, smoothing)
    ref_loss, ref_nll, _ = output_cross_entropy_reference(hidden.detach(), torch.eye(3), target, smoothing)
    assert math.isfinite(nll.item()) and nll.item() == pytest.approx(ref_nll.item(), rel=1e-6)
    assert nll.item() > 150.0 and loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert correct.item() == 1  # the second row's target is its argmax
    loss.backward()
    assert torch.isfinite(hidden.grad).all()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_rdrop_with_a_target_whose_probability_underflows_float32_matches_the_reference(smoothing):
    # R-Drop's log-ratio comes from the logits (z - lse), not from probabilities that underflow: the
    # second pass puts the target 150 nats below the best, the first 140; loss and gradients stay exact.
    hidden = torch.tensor([[140.0, 0.0, 0.0], [0.0, 2.0, 1.0], [150.0, 0.0, 0.5], [0.0, 1.0, 2.0]])
    target = torch.tensor([1, 1, 1, 1])
    h1, h2 = hidden.clone().requires_grad_(), hidden.double().requires_grad_()
    loss, nll, _ = output_cross_entropy(h1, torch.eye(3), target, smoothing, rdrop=2.0)
    reference, ref_nll, _ = rdrop_cross_entropy_reference(h2, torch.eye(3).double(), target, smoothing, 2.0)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5) and nll.item() > 290
    assert nll.item() == pytest.approx(ref_nll.item(), rel=1e-6)
    loss.backward()
    reference.backward()
    assert torch.allclose(h1.grad.double(), h2.grad, atol=1e-5)


def test_loss_by_hand():
    # one token, identity projection: logits = log([0.5, 0.25, 0.25])
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    loss, nll, correct = output_cross_entropy(logits, torch.eye(3), torch.tensor([0]), 0.3)
    expected = 0.7 * 0.6931472 + 0.3 * (0.6931472 + 2 * 1.3862944) / 3  # (1-ε) NLL + ε mean(-log p)
    assert loss.item() == pytest.approx(expected, rel=1e-5) and nll.item() == pytest.approx(0.6931472, rel=1e-5)
    assert correct.item() == 1  # token 0 is the most probable
    _, _, wrong = output_cross_entropy(logits, torch.eye(3), torch.tensor([2]), 0.3)
    assert wrong.item() == 0


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_batch_loss_ignores_padding_like_cross_entropy_with_ignore_index(smoothing):
    """Padded target positions contribute nothing: the fused loss over the real positions of a padded
    batch equals torch's cross_entropy over all positions with ignore_index=PAD."""
    from transformer.data.batching import Batch

    torch.manual_seed(0)
    model = build_model(
        ModelConfig(d_model=32, n_heads=4, d_ff=64, encoder_layers=1, decoder_layers=1, dropout=0.0), 40, 40, True
    )
    src = pad_sequences([[5, 6, 7], [8, 9], [10, 11, 12, 13]], suffix=[EOS_ID])
    tgt = [[14, 15], [16, 17, 18, 19], [20]]
    batch = Batch(
        src,
        pad_sequences(tgt, prefix=[BOS_ID]),
        pad_sequences(tgt, suffix=[EOS_ID]),
        num_tgt_tokens=sum(len(t) + 1 for t in tgt),
    )
    assert (batch.tgt_out == PAD_ID).sum() == 5
    loss, nll, correct = batch_loss(model, batch, smoothing)
    logits = model(batch.src, batch.tgt_in)  # (B, T, V)
    reference = F.cross_entropy(
        logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=PAD_ID, label_smoothing=smoothing, reduction="sum"
    )
    reference_nll = F.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=PAD_ID, reduction="sum")
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    assert nll.item() == pytest.approx(reference_nll.item(), rel=1e-5)
    real = batch.tgt_out != PAD_ID  # (B, T)
    assert correct.item() == (logits.argmax(dim=-1) == batch.tgt_out)[real].sum().item()


def test_inverse_sqrt_schedule_by_hand():
    factor = inverse_sqrt_schedule(warmup=400)
    assert factor(0) == pytest.approx(1 / 400)  # step 0 counts as step 1
    assert factor(100) == pytest.approx(0.25)  # linear warm-up
    assert factor(400) == pytest.approx(1.0)  # the peak
    assert factor(1600) == pytest.approx(0.5)  # sqrt(400 / 1600)
    assert factor(40000) == pytest.approx(0.1)
    no_warmup = inverse_sqrt_schedule(warmup=0)
    assert no_warmup(1) == 1.0 and no_warmup(100) == pytest.approx(0.1)


def test_the_optimizer_follows_the_schedule():
    from transformer.config import TrainerConfig
    from transformer.training.optim import build_optimizer

    model = torch.nn.Linear(3, 3)
    optimizer, scheduler = build_optimizer(model, TrainerConfig(lr=2e-3, warmup=10, max_steps=1), torch.device("cpu"))
    lrs = []
    for _ in range(40):
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    assert lrs[4] == pytest.approx(2e-3 * 5 / 10)
    assert max(lrs) == pytest.approx(2e-3) and lrs.index(max(lrs)) == 9
    assert lrs[39] == pytest.approx(2e-3 * math.sqrt(10 / 40))


@pytest.mark.parametrize("decay_norm_bias", [True, False])
def test_weight_decay_reaches_norms_and_biases_only_when_asked(decay_norm_bias):
    """With a zero gradient AdamW's step is the decay alone, p <- p (1 - lr wd): every parameter shrinks
    by that factor, or, without trainer.weight_decay_norm_bias, the weight matrices and embeddings do
    and the LayerNorm gains and biases stay as they were."""
    from transformer.config import TrainerConfig
    from transformer.training.optim import build_optimizer

    model = build_model(ModelConfig(d_model=16, n_heads=2, d_ff=32, encoder_layers=1, decoder_layers=1), 50, 50, True)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = TrainerConfig(lr=0.1, warmup=0, max_steps=1, weight_decay=0.5, weight_decay_norm_bias=decay_norm_bias)
    optimizer, _ = build_optimizer(model, config, torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    vectors = [name for name, p in model.named_parameters() if p.dim() < 2]
    assert any("norm" in name for name in vectors) and any(name.endswith("bias") for name in vectors)
    for name, p in model.named_parameters():
        decayed = decay_norm_bias or p.dim() >= 2
        torch.testing.assert_close(p.detach(), before[name] * (1 - 0.1 * 0.5 if decayed else 1.0), msg=name)


@pytest.mark.parametrize(
    "schedule, expected_at",
    [
        # warm-up 10, decay to step 110 with min_lr = lr / 10: hand-computed lr factors
        ("constant", {5: 0.5, 10: 1.0, 60: 1.0, 500: 1.0}),
        ("linear", {5: 0.5, 10: 1.0, 60: 0.1 + 0.9 * 0.5, 110: 0.1, 500: 0.1}),
        ("cosine", {5: 0.5, 10: 1.0, 35: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), 60: 0.55, 110: 0.1, 500: 0.1}),
    ],
)
def test_schedules_by_hand(schedule, expected_at):
    from transformer.config import TrainerConfig
    from transformer.training.optim import build_optimizer

    config = TrainerConfig(lr=2e-3, min_lr=2e-4, warmup=10, max_steps=110, schedule=schedule)
    config.validate()
    optimizer, scheduler = build_optimizer(torch.nn.Linear(3, 3), config, torch.device("cpu"))
    lrs = {0: scheduler.get_last_lr()[0]}
    for step in range(1, 501):
        optimizer.step()
        scheduler.step()
        lrs[step] = scheduler.get_last_lr()[0]
    assert lrs[0] == pytest.approx(2e-3 / 10)  # step 0 counts as step 1, as for inverse_sqrt
    for step, factor in expected_at.items():
        assert lrs[step] == pytest.approx(2e-3 * factor), (schedule, step)


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.schedule=step", "trainer.schedule='step' must be one of inverse_sqrt, cosine, linear, constant"),
        ("trainer.min_lr=1", "trainer.min_lr=1.0 must be in [0, trainer.lr="),
    ],
)
def test_schedule_keys_are_checked(override, message):
    from tests.helpers import compose_config
    from transformer.config import ConfigError

    with pytest.raises(ConfigError) as error:
        compose_config([override])
    assert message in str(error.value)


def test_a_decaying_schedule_needs_max_steps_beyond_warmup():
    from tests.helpers import compose_config
    from transformer.config import ConfigError

    with pytest.raises(
        ConfigError, match="trainer.schedule=cosine decays from trainer.warmup=200 to trainer.max_steps=0"
    ):
        compose_config(["trainer.schedule=cosine", "trainer.max_steps=0"])
    assert compose_config(["trainer.schedule=cosine"]).trainer.schedule == "cosine"


def test_fp16_keeps_the_gradients_of_improbable_tokens():
    """Under fp16 the stored softmax must not flush a large vocabulary's small probabilities to zero
    before the loss scale (here 2**16, as a GradScaler's) multiplies them in the backward pass."""
    from transformer.loss import _FusedOutputCrossEntropy

    torch.manual_seed(0)
    direction = torch.full((16,), 0.25)  # a unit vector
    hidden = torch.randn(8, 16) * 0.5 + 4.0 * direction
    weight = torch.randn(500, 16) * 0.5
    weight[250:] = torch.randn(250, 16) * 0.05 - 3.0 * direction  # p ~ 1e-8: zero in fp16, not once scaled
    target = torch.randint(0, 250, (8,))
    probabilities = torch.softmax(hidden.double() @ weight.double().t(), 1)[:, 250:]
    assert probabilities.max() < 3e-8 and probabilities.min() > 1e-10
    w32 = weight.clone().requires_grad_()  # parameters stay fp32 under autocast; compute is fp16
    loss, _, _ = _FusedOutputCrossEntropy.apply(hidden, w32, target, 0.0, 0.0, torch.float16, True)
    (loss * 2.0**16).backward()
    w64 = weight.double().requires_grad_()
    reference, _, _ = output_cross_entropy_reference(hidden.double(), w64, target, 0.0)
    (reference * 2.0**16).backward()
    improbable, ours = w64.grad[250:], w32.grad[250:].double()
    assert (ours != 0).all()
    assert (ours - improbable).norm() / improbable.norm() < 2e-2


@pytest.mark.parametrize("smoothing, rdrop", [(0.1, 0.0), (0.1, 5.0), (0.0, 5.0)])
def test_fp16_stored_gradient_with_smoothing_and_rdrop_matches_the_reference(smoothing, rdrop):
    # fp16 keeps G (float32) for the backward pass instead of taking its products in the forward one.
    from transformer.loss import _FusedOutputCrossEntropy

    torch.manual_seed(0)
    first = torch.randn(300, 16)
    hidden, weight = torch.cat([first, first + 0.3 * torch.randn(300, 16)]), torch.randn(70, 16) * 0.5
    target = torch.randint(0, 70, (300,)).repeat(2)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, _, _ = _FusedOutputCrossEntropy.apply(h1, w1, target, smoothing, rdrop, torch.float16, True)
    assert loss.grad_fn.mode == "stored"
    (loss * 2.0**10).backward()
    h2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    reference = (
        rdrop_cross_entropy_reference(h2, w2, target, smoothing, rdrop)
        if rdrop
        else output_cross_entropy_reference(h2, w2, target, smoothing)
    )
    (reference[0] * 2.0**10).backward()
    assert loss.item() == pytest.approx(reference[0].item(), rel=5e-3)
    for ours, exact in ((h1.grad, h2.grad), (w1.grad, w2.grad)):
        assert (ours.double() - exact).norm() / exact.norm() < 1e-2


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("pairs", [7, 1300])  # 1300 pairs span several chunks of each pass
def test_rdrop_loss_and_gradients_match_autograd_reference(smoothing, pairs):
    torch.manual_seed(0)
    first = torch.randn(pairs, 16)
    hidden = torch.cat([first, first + 0.5 * torch.randn(pairs, 16)])  # two "passes" that disagree a little
    weight = torch.randn(37, 16)
    target = torch.randint(0, 37, (pairs,)).repeat(2)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, nll, correct = output_cross_entropy(h1, w1, target, smoothing, rdrop=5.0)
    ref_loss, ref_nll, ref_correct = rdrop_cross_entropy_reference(h2, w2, target, smoothing, 5.0)
    plain, _, _ = output_cross_entropy(hidden, weight, target, smoothing)
    assert loss.item() > plain.item() * 1.05  # the consistency term is there and not small
    (1.5 * loss).backward()
    (1.5 * ref_loss).backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert nll.item() == pytest.approx(ref_nll.item(), rel=1e-5)
    assert correct.item() == ref_correct.item()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-4)
    assert torch.allclose(w1.grad, w2.grad, atol=1e-4)


def test_rdrop_of_two_equal_passes_is_the_plain_loss_and_an_odd_row_count_is_refused():
    torch.manual_seed(0)
    hidden, weight = torch.randn(5, 8), torch.randn(11, 8)
    target = torch.randint(0, 11, (5,))
    plain, _, _ = output_cross_entropy(hidden, weight, target, 0.1)
    twice, _, _ = output_cross_entropy(hidden.repeat(2, 1), weight, target.repeat(2), 0.1, rdrop=5.0)
    assert twice.item() == pytest.approx(2 * plain.item(), rel=1e-6)  # KL 0: twice the same loss
    with pytest.raises(ValueError, match="even number of tokens"):
        output_cross_entropy(hidden, weight, target, 0.1, rdrop=1.0)


def test_a_batch_twice_puts_the_copy_after_the_batch_and_its_targets_in_the_same_order():
    from transformer.data.batching import Batch

    src = pad_sequences([[5, 6, 7], [8, 9]], suffix=[EOS_ID])
    tgt = [[14, 15], [16, 17, 18]]
    batch = Batch(src, pad_sequences(tgt, prefix=[BOS_ID]), pad_sequences(tgt, suffix=[EOS_ID]), num_tgt_tokens=7)
    doubled = batch.twice()
    assert doubled.src.shape == (4, 4) and torch.equal(doubled.src[2:], batch.src)
    assert doubled.num_tgt_tokens == 14
    positions = doubled.target_positions()
    assert torch.equal(positions[7:], batch.target_positions() + batch.tgt_out.numel())  # into the copy's rows
    targets = doubled.tgt_out.flatten()[positions]
    assert targets.tolist() == [14, 15, EOS_ID, 16, 17, 18, EOS_ID] * 2
