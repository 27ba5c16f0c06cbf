"""What a run needs before its first step besides data (corpus.py): device, precision, optimizer."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import platform

import torch

from transformer.config import ConfigError, TrainerConfig
from transformer.distributed import DistInfo

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def keep_freed_memory() -> None:
    """Ask glibc to keep freed memory for reuse rather than hand it back to the kernel (CLIs only).

    By default it maps blocks above a threshold that adapts between 128 KB and 32 MB and unmaps them
    when freed, and trims the heap's free top. Training and decoding free and reallocate tensors of
    changing sizes all the time, so the same memory is page-faulted in again and again:
    - decoding test_2016_flickr at beam 5: about 500,000 faults and 1 s of system time, a tenth of the run;
    - training model=small on a 2-core CPU: 10-20% more target tokens/s in bf16, 2-5% in fp32.
    No-op off glibc.
    """
    if platform.libc_ver()[0] != "glibc":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3          # mallopt parameters, from malloc.h
    libc.mallopt(m_mmap_threshold, 32 * 2**20)           # the largest value glibc accepts
    libc.mallopt(m_trim_threshold, 2**31 - 1)


def autocast_factory(device: torch.device, dtype: torch.dtype | None):
    """A zero-argument callable returning the autocast context for `dtype` (a no-op context for fp32)."""
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def resolve_device(name: str, dist_info: DistInfo) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"trainer.device={name} but CUDA is not available; use trainer.device=cpu")
        if name == "cuda":
            return torch.device("cuda", dist_info.local_rank)
    return torch.device(name)


def cpu_has_native_bf16() -> bool:
    """True on x86 CPUs with AVX512-BF16 or AMX (bf16 matmuls run natively, not emulated)."""
    try:
        with open("/proc/cpuinfo") as handle:
            flags = next((line for line in handle if line.startswith("flags")), "")
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def cuda_has_native_bf16(device: torch.device) -> bool:
    """True on GPUs with bf16 tensor cores (Ampere and later); `is_bf16_supported()` alone also counts
    the emulation older GPUs offer, which is slower than fp16."""
    return torch.cuda.is_bf16_supported(including_emulation=False) and \
        torch.cuda.get_device_capability(device)[0] >= 8


def resolve_precision(name: str, device: torch.device) -> str:
    """`auto` is bf16 on GPUs with native bf16 (fp16 with a GradScaler on older ones) and on CPUs
    with native bf16 instructions; fp32 otherwise. Parameters and optimizer state stay fp32 either way."""
    if name == "auto":
        if device.type == "cuda":
            return "bf16" if cuda_has_native_bf16(device) else "fp16"
        return "bf16" if cpu_has_native_bf16() else "fp32"
    if name == "fp16" and device.type == "cpu":
        raise ConfigError("precision fp16 needs CUDA (trainer.precision / --precision); on the CPU use bf16 or fp32")
    if name == "bf16" and device.type == "cuda" and not cuda_has_native_bf16(device):
        log.warning("precision bf16 on %s, which emulates it (slower than fp16): consider fp16",
                    torch.cuda.get_device_name(device))
    return name


def allow_tf32_for_training(device: torch.device, precision: str) -> None:
    """fp32 training on a GPU runs its matmuls and convolutions on TF32 tensor cores (10-bit mantissa
    inputs, fp32 accumulation): about 7x the fp32 throughput on an A100/H100, at a precision that
    training tolerates. Decoding (`transformer-translate`) keeps full fp32."""
    if device.type == "cuda" and precision == "fp32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def inverse_sqrt_schedule(warmup: int):
    """lr factor: linear warm-up to 1 at `warmup` steps, then decay ∝ 1/√step (Vaswani et al., 2017)."""
    def factor(step: int) -> float:
        step = max(step, 1)
        if warmup == 0:
            return 1.0 / math.sqrt(step)
        return min(step / warmup, math.sqrt(warmup / step))
    return factor


def lr_factor(schedule: str, warmup: int, max_steps: int = 0, floor: float = 0.0):
    """The lr multiplier at each optimizer step (LambdaLR's `lr_lambda`): a linear warm-up to 1 over
    `warmup` steps, then `schedule`: inverse_sqrt, constant, or a cosine or linear decay that reaches
    `floor` (min_lr / lr) at `max_steps` and stays there."""
    if schedule == "inverse_sqrt":
        return inverse_sqrt_schedule(warmup)

    def factor(step: int) -> float:
        step = max(step, 1)
        if step < warmup:
            return step / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))   # 0 -> 1 over the decay
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
        return floor + (1.0 - floor) * shape
    return factor


def build_optimizer(model: torch.nn.Module, trainer: TrainerConfig, device: torch.device):
    """AdamW, fused on every device: one kernel for all parameters (on this 2-core CPU about 7x faster
    than the for-each implementation), and it takes the `found_inf` flag with which the training step
    skips a non-finite update without reading anything back to the host."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=trainer.lr, betas=tuple(trainer.betas), eps=trainer.adam_eps,
                                  weight_decay=trainer.weight_decay, fused=True)
    factor = lr_factor(trainer.schedule, trainer.warmup, trainer.max_steps, trainer.min_lr / trainer.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return optimizer, scheduler
