"""Device-specific fast paths behind plain module interfaces, so that model.py reads like the paper.

`Dropout` is `nn.Dropout` everywhere; on the CPU, in training, it takes the faster mask of `_CpuDropout`
and can add its output to the residual stream in the same pass (`add_to`).
"""

from __future__ import annotations

import torch
from torch import nn

DROP_RESOLUTION = 32768  # the CPU dropout's probabilities are multiples of 1 / DROP_RESOLUTION (15 bits)


def _keep_mask(shape: torch.Size, threshold: int, device) -> torch.Tensor:
    """A uint8 tensor of `shape`: 0 with probability threshold / 32768, else 1.

    Each 64-bit draw serves four elements, 15 uniform bits each. `random_()` without a range is the
    fast draw (63 bits, the top one 0; asking for the full 64-bit range takes a modulo per draw, 2x the
    time), so every 16-bit lane is masked to its low 15 bits, all uniform."""
    numel = shape.numel()
    bits = torch.empty((numel + 3) // 4, dtype=torch.int64, device=device).random_()
    bits.bitwise_and_(0x7FFF7FFF7FFF7FFF)  # four lanes of 15 bits
    values = bits.view(torch.int16)[:numel]
    return (values >= threshold).view(shape).view(torch.uint8)


class _CpuDropout(torch.autograd.Function):
    """Inverted dropout with a drop probability rounded to 1/32768, optionally added to a residual.

    On the CPU, `F.dropout` draws one random number per element (a float, then a Bernoulli test) and
    spends more time there than in the rest of the layer. Here each 64-bit draw serves four elements,
    the one-byte keep mask is all the backward pass stores, and forward and backward are each one
    `addcmul`: base + scale * x * keep, where base is the residual stream (the residual add comes free)
    or zero.
    """

    @staticmethod
    def forward(ctx, x, p: float, residual=None):
        threshold = min(round(p * DROP_RESOLUTION), DROP_RESOLUTION - 1)  # p < 1: never all dropped
        keep = _keep_mask(x.shape, threshold, x.device)
        ctx.scale = 1.0 / (1.0 - threshold / DROP_RESOLUTION)
        ctx.x_dtype, ctx.has_residual = x.dtype, residual is not None
        ctx.save_for_backward(keep)
        base = residual if residual is not None else x.new_zeros(())
        return torch.addcmul(base, x, keep, value=ctx.scale)

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        grad_x = torch.empty(keep.shape, dtype=ctx.x_dtype, device=grad.device)  # in x's dtype, one pass
        torch.addcmul(grad.new_zeros(()), grad, keep, value=ctx.scale, out=grad_x)
        return grad_x, None, grad if ctx.has_residual else None


class Dropout(nn.Dropout):
    """nn.Dropout, with the faster mask of `_CpuDropout` for CPU tensors."""

    def _cpu_mask(self, x: torch.Tensor) -> bool:
        # Not under torch.compile: its own dropout is fused into the graph, and this mask's 64-bit
        # draws would break the graph at every layer.
        return self.training and self.p > 0.0 and x.device.type == "cpu" and not torch.compiler.is_compiling()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:  # the identity: no operator (decoding calls this per step)
            return x
        return _CpuDropout.apply(x, self.p) if self._cpu_mask(x) else super().forward(x)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + dropout(x), on the CPU in one pass."""
        return _CpuDropout.apply(x, self.p, residual) if self._cpu_mask(x) else residual + self.forward(x)


def is_int8(model: torch.nn.Module) -> bool:
    """Whether `model`'s linear layers are PyTorch's dynamic int8 ones (`inference_model`)."""
    return any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in model.modules())
