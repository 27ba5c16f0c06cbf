"""The analytic FLOPs of a training step and the device peaks behind MFU (transformer/flops.py)."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from transformer.config import ModelConfig
from transformer.data.batching import Batch
from transformer.flops import MfuMeter, mfu_meter, peak_bf16_tflops, step_flops, train_flops
from transformer.model import build_model
from transformer.special import PAD_ID


def test_one_layer_each_side_counts_every_matmul_by_hand():
    # D=4, F=8, V=10; 3 source and 2 target tokens, no padding. Multiply-adds of each matmul:
    cfg = SimpleNamespace(d_model=4, d_ff=8, encoder_layers=1, decoder_layers=1)
    encoder = (
        3 * 4 * 12  # Q, K, V in one (3, 4) @ (4, 12)
        + 3 * 4 * 4  # output projection
        + 3 * 3 * 4  # QK^T: 3 queries x 3 keys x 4 wide (over all heads)
        + 3 * 3 * 4  # weights x V
        + 3 * 4 * 8  # feed-forward up
        + 3 * 8 * 4  # feed-forward down
    )
    decoder = (
        2 * 4 * 12  # self-attention Q, K, V
        + 2 * 4 * 4  # self-attention output
        + 2 * 2 * 4 * 2  # self-attention QK^T and weights x V: 2 queries x 2 keys x 4
        + 2 * 4 * 4  # cross-attention Q
        + 3 * 4 * 8  # cross-attention K, V of the 3 encoder outputs
        + 2 * 3 * 4 * 2  # cross-attention QK^T and weights x V: 2 queries x 3 keys x 4
        + 2 * 4 * 4  # cross-attention output
        + 2 * 4 * 8
        + 2 * 8 * 4  # feed-forward
    )
    output = 2 * 4 * 10
    assert (encoder, decoder, output) == (456, 496, 80)
    # 2 FLOPs per multiply-add, forward + backward = 3 x forward.
    assert step_flops(cfg, 3, 2, 3, 2, vocab=10) == 3 * 2 * (456 + 496 + 80) == 6192


def test_the_count_is_what_torch_counts_in_the_models_own_forward_and_backward():
    """The slow truth: PyTorch's FLOP counter over our model's matmuls (the math attention path, whose
    matmuls it sees; the full logits, as a batch without padding has only real targets)."""
    cfg = ModelConfig(d_model=8, n_heads=2, d_ff=16, encoder_layers=2, decoder_layers=3, dropout=0.0, attention="math")
    vocab = 11
    torch.manual_seed(0)
    model = build_model(cfg, vocab, vocab, True)
    B, S, T = 3, 5, 4
    src, tgt_in, tgt_out = (torch.randint(4, vocab, (B, n)) for n in (S, T, T))  # no padding
    batch = Batch(src, tgt_in, tgt_out, num_tgt_tokens=B * T)
    with FlopCounterMode(display=False) as counter:
        model(src, tgt_in).sum().backward()  # logits (B, T, V)
    assert counter.get_total_flops() == train_flops(cfg, batch, vocab) == 316800


def test_padding_is_not_counted_and_the_widths_are():
    cfg = SimpleNamespace(d_model=16, d_ff=32, encoder_layers=2, decoder_layers=2)
    src = torch.tensor([[5, 6, 7, 3], [5, 3, PAD_ID, PAD_ID]])  # (2, 4): 6 real tokens
    tgt_in = torch.tensor([[2, 8, 9], [2, 8, PAD_ID]])
    tgt_out = torch.tensor([[8, 9, 3], [8, 3, PAD_ID]])  # 5 real targets
    batch = Batch(src, tgt_in, tgt_out, num_tgt_tokens=5)
    assert train_flops(cfg, batch, vocab=50) == step_flops(cfg, 6, 5, 4, 3, vocab=50)


def test_base_at_an_8k_vocabulary_is_about_0_29_gflop_per_target_token():
    """The figure transformer/flops.py and issue 69 quote: Multi30k-like lengths (14 tokens a side)."""
    base = SimpleNamespace(d_model=512, d_ff=2048, encoder_layers=6, decoder_layers=6)
    per_token = step_flops(base, 1400, 1400, 14, 14, vocab=8000) / 1400
    assert 0.285e9 < per_token < 0.295e9


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),  # not the SXM figure: the more specific name comes first
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA A10G", 70.0),  # not the A10's
        ("NVIDIA A10", 125.0),
        ("NVIDIA L40S", 362.0),
        ("Tesla T4", None),
        ("", None),
    ],
)
def test_the_peak_is_looked_up_by_the_device_name(name, peak):
    assert peak_bf16_tflops(name) == peak


def test_mfu_only_on_a_cuda_device_whose_peak_is_known():
    cfg = SimpleNamespace(d_model=4, d_ff=8, encoder_layers=1, decoder_layers=1)
    assert mfu_meter(torch.device("cpu"), cfg, 10) is None
    assert mfu_meter(torch.device("meta"), cfg, 10) is None
    cuda = SimpleNamespace(type="cuda")  # no GPU needed: the name is given
    assert mfu_meter(cuda, cfg, 10, device_name="Tesla T4") is None
    meter = mfu_meter(cuda, cfg, 10, passes=2, device_name="NVIDIA H200")
    assert isinstance(meter, MfuMeter) and meter.peak_flops == 989e12 and meter.passes == 2


def test_the_meter_sums_the_windows_batches_and_starts_afresh_after_a_read():
    cfg = SimpleNamespace(d_model=4, d_ff=8, encoder_layers=1, decoder_layers=1)
    batch = Batch(torch.tensor([[5, 6, 3]]), torch.tensor([[2, 7]]), torch.tensor([[7, 3]]), num_tgt_tokens=2)
    meter = MfuMeter(cfg, vocab=10, peak_tflops=1e-9, passes=2)  # a peak of 1,000 FLOP/s
    meter.add([(batch, 1.0), (batch, 0.5)])  # two micro-batches (the weight does not change the work)
    assert meter.read(seconds=2.0) == pytest.approx(2 * 2 * 6192 / 2.0 / 1000.0)
    assert meter.read(seconds=2.0) == 0.0


def test_the_module_imports_without_torch():
    code = "import sys, transformer.flops; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
