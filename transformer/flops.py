"""Model FLOPs utilisation (MFU): the analytic FLOPs of a training step and the device's dense peak.

The count (`train_flops`). A matmul of an (M, K) by a (K, N) matrix is M*K*N multiply-adds, 2*M*K*N
FLOPs. The forward of one batch, with D = model.d_model, F = model.d_ff, V the target vocabulary,
S and T the padded source and target widths, and N_src / N_tgt the real (non-padding) tokens:

    each encoder layer   N_src * (2*4*D*D  Q, K, V, output projections
                                + 2*2*D*F  the two feed-forward matmuls
                                + 2*2*S*D) QK^T and attention x V against S keys
    each decoder layer   N_tgt * (2*4*D*D  self-attention's Q, K, V, output projections
                                + 2*2*D*D  cross-attention's Q and output projections
                                + 2*2*D*F
                                + 2*2*T*D  self-attention against T keys (the causal half not discounted)
                                + 2*2*S*D) cross-attention against S keys
                         + N_src * 2*2*D*D  cross-attention's K and V of the encoder's output
    the output layer     N_tgt * 2*D*V      (the loss projects only the real targets)

and the backward costs twice the forward (a gradient for the input and one for the weight of every
matmul): a step is 3 x forward. Only the real tokens count (the padding the kernels also multiply is
not useful work), embeddings, layer norms, softmax and the optimizer are left out: these are the model's
FLOPs, as the literature counts them for MFU, not the hardware's. For `model=base` at an 8k vocabulary
this comes to about 0.29 GFLOP per target token at Multi30k's lengths.

The peak (`PEAK_BF16_TFLOPS`, `peak_bf16_tflops`): dense bf16 tensor-core TFLOP/s from the vendors' data
sheets (without structured sparsity), matched against the CUDA device's name; an unknown device has no
peak and then no MFU is reported. The bf16 peak is the yardstick at every precision (an fp32 run's MFU is
its FLOPs over the same bf16 peak), so that figures at different precisions compare.

`make bench` (scripts/bench.py) and the training log (`MfuMeter`, in transformer/training/step_log.py's
log line and TensorBoard's train/mfu) share this count and this table. No torch import: a batch only needs
tensors' `.size()`, `!=` and `.sum()`.
"""

from __future__ import annotations

from transformer.special import PAD_ID

# (name fragment, dense bf16 TFLOP/s), matched in this order: the first fragment the device's name
# contains wins, so that the more specific names ("H100 PCIe") come before the general ones ("H100").
PEAK_BF16_TFLOPS = [
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # H100 SXM5 ("NVIDIA H100 80GB HBM3")
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("B200", 2250.0),
    ("B100", 1750.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("RTX 4090", 165.0),
    ("RTX 3090", 71.0),
]


def peak_bf16_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of the device `torch.cuda.get_device_name()` names, or None if unknown."""
    return next((peak for fragment, peak in PEAK_BF16_TFLOPS if fragment in device_name), None)


def step_flops(model_cfg, src_tokens: int, tgt_tokens: int, src_len: int, tgt_len: int, vocab: int) -> float:
    """Forward+backward FLOPs of one batch of `src_tokens` / `tgt_tokens` real tokens, padded to
    `src_len` (S) and `tgt_len` (T) columns, `vocab` target pieces (the module docstring's count)."""
    D, F, S, T = model_cfg.d_model, model_cfg.d_ff, src_len, tgt_len
    encoder = model_cfg.encoder_layers * src_tokens * (2 * 4 * D * D + 2 * 2 * D * F + 2 * 2 * S * D)
    decoder = model_cfg.decoder_layers * (
        tgt_tokens * (2 * 6 * D * D + 2 * 2 * D * F + 2 * 2 * T * D + 2 * 2 * S * D) + src_tokens * 2 * 2 * D * D
    )
    output = tgt_tokens * 2 * D * vocab
    return 3.0 * (encoder + decoder + output)


def train_flops(model_cfg, batch, vocab: int) -> float:
    """`step_flops` of a `transformer.data.batching.Batch`. Counts the padding of a batch on the host:
    give it the collated (CPU) batch, not its copy on the GPU, or the count waits for the device."""
    src_tokens = int((batch.src != PAD_ID).sum())
    return step_flops(model_cfg, src_tokens, batch.num_tgt_tokens, batch.src.size(1), batch.tgt_in.size(1), vocab)


class MfuMeter:
    """The FLOPs of the batches this process trained on since the last `read`, over the seconds and the
    peak: the MFU of one GPU (under DDP each rank reports its own). `passes`: forwards per batch (2 under
    trainer.rdrop, which runs every batch twice)."""

    def __init__(self, model_cfg, vocab: int, peak_tflops: float, passes: int = 1):
        self.model_cfg, self.vocab, self.peak_flops, self.passes = model_cfg, vocab, peak_tflops * 1e12, passes
        self.flops = 0.0

    def add(self, micro_batches) -> None:
        """One update's (batch, weight) pairs, the host batches as collated."""
        self.flops += self.passes * sum(train_flops(self.model_cfg, batch, self.vocab) for batch, _ in micro_batches)

    def read(self, seconds: float) -> float:
        """The share of the peak the FLOPs since the last read reached in `seconds`; starts a new window."""
        mfu = self.flops / max(seconds, 1e-9) / self.peak_flops
        self.flops = 0.0
        return mfu


def mfu_meter(device, model_cfg, vocab: int, passes: int = 1, device_name: str | None = None) -> MfuMeter | None:
    """The meter for a run on `device`, or None where no MFU is reported: on a CPU, or on a GPU whose
    peak `PEAK_BF16_TFLOPS` does not know. `device_name`: the device's name (default: asked of CUDA)."""
    if device.type != "cuda":
        return None
    if device_name is None:
        import torch  # only on CUDA: this module stays importable without torch

        device_name = torch.cuda.get_device_name(device)
    peak = peak_bf16_tflops(device_name)
    return MfuMeter(model_cfg, vocab, peak, passes) if peak else None
