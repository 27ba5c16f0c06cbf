"""Device-specific fast paths behind plain module interfaces, so that model.py reads like the paper.

`Dropout` is `nn.Dropout` everywhere; on the CPU, in training, it takes the faster mask of `_CpuDropout`
and can add its output to the residual stream in the same pass (`add_to`). `Int8Linear` is `nn.Linear`
with int8 weights and activations for decoding on the CPU (`quantize_linear_layers`).
"""

from __future__ import annotations

import warnings

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


# Int8Linear's activations are scaled into [-1, 1] row by row; a last row holding -PIN and +PIN fixes the
# range that PyTorch's dynamic int8 product measures over its whole input to [-PIN, PIN] (PIN a little
# over 1, so that a scaled value rounded a hair past 1 cannot move it): every row is then quantized with
# its own scale alone, whatever else is in the batch.
ACTIVATION_PIN = 1.0 + 2.0**-10


class Int8Linear(nn.Module):
    """`nn.Linear` for decoding on the CPU: weights int8 with one scale per output row, activations
    quantized to 8 bits on the fly with one scale per input row (token). PyTorch's own dynamic int8 layers
    take one scale for the whole input, so a sentence's translation depended on the other sentences of
    its batch and on the padding; here each row's output is a function of that row alone (batch
    independence is tested). Built from a float layer by `from_float`; not trainable, not saved."""

    def __init__(self, packed: torch.ScriptObject, bias: torch.Tensor, in_features: int, out_features: int):
        super().__init__()
        self.packed, self.in_features, self.out_features = packed, in_features, out_features
        self.register_buffer("bias", bias)  # (out_features,) float32, zeros for a layer without a bias
        pin = torch.zeros(in_features)  # (in,): the last row of every input, -PIN and +PIN at its ends
        pin[0], pin[-1] = -ACTIVATION_PIN, ACTIVATION_PIN
        self.register_buffer("pin", pin)

    @classmethod
    def from_float(cls, linear: nn.Linear) -> Int8Linear:
        if linear.in_features < 2:  # the pin row needs two places
            raise ValueError(f"an int8 linear layer needs at least 2 inputs, not {linear.in_features}")
        weight = linear.weight.detach().float().cpu()  # (out, in)
        scales = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)  # (out,)
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch's notices that quantized tensors move to torchao one day
            warnings.simplefilter("ignore")
            quantized = torch.quantize_per_channel(weight, scales.double(), zero_points, 0, torch.qint8)
            packed = torch.ops.quantized.linear_prepack(quantized, None)
        bias = torch.zeros(weight.shape[0]) if linear.bias is None else linear.bias.detach().float().cpu()
        return cls(packed, bias, linear.in_features, linear.out_features)

    @torch.no_grad()  # not trainable: its weights are packed int8
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) float32 -> (..., out) float32."""
        rows = x.reshape(-1, self.in_features)  # (R, in)
        row_scale = rows.abs().amax(dim=1, keepdim=True)  # (R, 1)
        row_scale.clamp_min_(torch.finfo(torch.float32).tiny)
        unit = rows.new_empty(rows.shape[0] + 1, self.in_features)  # (R + 1, in): the rows in [-1, 1], the pin
        torch.div(rows, row_scale, out=unit[:-1])
        unit[-1] = self.pin
        product = torch.ops.quantized.linear_dynamic(unit, self.packed, True)[:-1]  # (R, out)
        torch.addcmul(self.bias, product, row_scale, out=product)  # in place: y = s x + b
        return product.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_linear_layers(model: nn.Module) -> nn.Module:
    """`model` (on the CPU) with every `nn.Linear` replaced by an `Int8Linear`, in place; returns it."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear.from_float(child))
        else:
            quantize_linear_layers(child)
    return model


def is_int8(model: nn.Module) -> bool:
    """Whether `model`'s linear layers are int8 ones (`quantize_linear_layers`)."""
    return any(isinstance(module, Int8Linear) for module in model.modules())
