import pytest
import torch

from transformer.loss import output_cross_entropy, output_cross_entropy_reference
from transformer.validate import score


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("n_tokens", [13, 2100])       # 2100 spans several chunks
def test_fused_loss_and_gradients_match_autograd_reference(smoothing, n_tokens):
    torch.manual_seed(0)
    hidden = torch.randn(n_tokens, 16)
    weight = torch.randn(37, 16)
    target = torch.randint(0, 37, (n_tokens,))
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, nll = output_cross_entropy(h1, w1, target, smoothing)
    ref_loss, ref_nll = output_cross_entropy_reference(h2, w2, target, smoothing)
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
        loss, _ = output_cross_entropy(hidden, weight, target, 0.1)
    ref, _ = output_cross_entropy_reference(hidden, weight, target, 0.1)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(ref.item(), rel=2e-2)


def test_loss_by_hand():
    # one token, identity projection: logits = log([0.5, 0.25, 0.25])
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    loss, nll = output_cross_entropy(logits, torch.eye(3), torch.tensor([0]), 0.3)
    expected = 0.7 * 0.6931472 + 0.3 * (0.6931472 + 2 * 1.3862944) / 3       # (1-ε) NLL + ε mean(-log p)
    assert loss.item() == pytest.approx(expected, rel=1e-5) and nll.item() == pytest.approx(0.6931472, rel=1e-5)


def test_score_uses_sacrebleu_defaults():
    result = score(["The dog runs ."], ["The dog runs ."])
    assert result["bleu"] == pytest.approx(100.0)
    assert "tok:13a" in result["bleu_signature"] and "case:mixed" in result["bleu_signature"]
