"""Where and how a process computes, resolved once: device, torchrun process group, precision, autocast.

`Runtime.for_training` (the Trainer) and `Runtime.for_inference` (Translator) are the two ways in; the
functions below are their parts (and the bench's).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import platform
from dataclasses import dataclass

import torch

from transformer import distributed as D
from transformer.config import ConfigError, TrainerConfig, as_given, device_name_error
from transformer.distributed import DistInfo

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
GLIBC_MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # set: keep_freed_memory leaves it
ONEDNN_CACHE_CAPACITY = 8192  # compiled CPU kernels kept; oneDNN's default is 1,024
FREED_MEMORY_EVERY = 100  # training steps between hand_back_freed_memory calls


def tune_cpu_process() -> None:
    """What the training and translation CLIs set before their first tensor operation (CPU only in effect)."""
    keep_freed_memory()
    cache_more_cpu_kernels()


def cache_more_cpu_kernels() -> None:
    """Let oneDNN keep ONEDNN_CACHE_CAPACITY compiled kernels, unless ONEDNN_PRIMITIVE_CACHE_CAPACITY is set.

    oneDNN (the CPU matmuls, bf16 and fp32) compiles a kernel per operation and shape and caches the last
    1,024. Length-bucketed batches have thousands of distinct (sentences, source length, target length)
    shapes, so with the default the cache cycles and kernels are compiled again every epoch: 14-20% more
    training steps per minute with the larger cache, the same arithmetic, some memory on the multilingual
    model (the measurements: docs/benchmarks.md, "oneDNN's kernel cache"). Read when oneDNN makes its first
    kernel, so this must run before the process's first matmul.
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))


def keep_freed_memory() -> None:
    """Ask glibc to keep freed memory for reuse rather than hand it back to the kernel (CLIs only).

    By default it maps blocks above a threshold that adapts between 128 KB and 32 MB and unmaps them
    when freed, and trims the heap's free top. Training and decoding free and reallocate tensors of
    changing sizes all the time, so the same memory is page-faulted in again and again:
    - decoding test_2016_flickr at beam 5: about 500,000 faults and 1 s of system time, a tenth of the run;
    - training model=small on a 2-core CPU: 10-20% more target tokens/s in bf16, 2-5% in fp32.
    The price is memory in a fragmented heap (docs/benchmarks.md, "oneDNN's kernel cache"): a user who sets
    MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ keeps glibc's behaviour as set. No-op off glibc.
    """
    libc = None if any(name in os.environ for name in GLIBC_MALLOC_VARIABLES) else _glibc()
    if libc is None:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt parameters, from malloc.h
    libc.mallopt(m_mmap_threshold, 32 * 2**20)  # the largest value glibc accepts
    libc.mallopt(m_trim_threshold, 2**31 - 1)


@functools.cache
def _glibc():
    """The C library through ctypes when it is glibc (None elsewhere: macOS, Windows, musl). Looked up once:
    `platform.libc_ver` reads the interpreter's executable, which the Trainer would otherwise do every
    FREED_MEMORY_EVERY steps."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def hand_back_freed_memory() -> None:
    """glibc's malloc_trim(0): give the kernel back the free pages inside the heap (the Trainer, every
    FREED_MEMORY_EVERY steps). keep_freed_memory's heap, and glibc's own with its adaptive threshold, serve
    tensors of ever-changing shapes from a heap that fragments: the free pages between live blocks are never
    returned: the multilingual recipe's run grew by 1.5 MB a step with online back-translation (11.7 GB at
    step 9,500). Trimmed every hundred steps the pages are faulted in again once per hundred steps, not once
    per step, which is what keep_freed_memory saves: model=small de-en on the 2-core CPU peaked at 3.1 GB in
    400 steps instead of 3.7 GB, at the same speed within the noise (docs/benchmarks.md). No-op off glibc."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def autocast_factory(device: torch.device, dtype: torch.dtype | None):
    """A zero-argument callable returning the autocast context for `dtype` (a no-op context for fp32)."""
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def auto_device(name: str) -> str:
    """`auto`: CUDA when available, else the CPU; any other name as it is."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def inference_device_error(device, knob: str = "device=") -> str | None:
    """Why `device` cannot translate here, in one line (`config.device_name_error`'s words for a name that
    is none, then: no CUDA, or fewer CUDA devices than its index); None when it can."""
    problem = device_name_error(device, knob)
    if problem is None and device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        if not torch.cuda.is_available():
            problem = f"{as_given(knob, device)}: CUDA is not available"
        elif index >= torch.cuda.device_count():
            problem = (
                f"{as_given(knob, device)}: there are {torch.cuda.device_count()} "
                f"CUDA device(s) (0 to {torch.cuda.device_count() - 1})"
            )
    return problem


def resolve_device(name: str, dist_info: DistInfo) -> torch.device:
    name = auto_device(name)
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"trainer.device={name} but CUDA is not available; use trainer.device=cpu")
        if name == "cuda":
            count = torch.cuda.device_count()
            if dist_info.local_rank >= count:  # more processes on this machine than GPUs
                raise ConfigError(
                    f"rank {dist_info.rank} is process {dist_info.local_rank + 1} on a machine with "
                    f"{count} CUDA device(s): start at most one per device (--nproc_per_node={count})"
                )
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
    return torch.cuda.is_bf16_supported(including_emulation=False) and torch.cuda.get_device_capability(device)[0] >= 8


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
        log.warning(
            "precision bf16 on %s, which emulates it (slower than fp16): consider fp16",
            torch.cuda.get_device_name(device),
        )
    return name


def allow_tf32_for_training(device: torch.device, precision: str) -> None:
    """fp32 training on a GPU runs its matmuls and convolutions on TF32 tensor cores (10-bit mantissa
    inputs, fp32 accumulation): about 7x the fp32 throughput on an A100/H100, at a precision that
    training tolerates. Decoding (`transformer-translate`) keeps full fp32."""
    if device.type == "cuda" and precision == "fp32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


@dataclass
class Runtime:
    device: torch.device
    precision: str  # bf16 | fp16 | fp32, resolved from auto
    autocast: object  # a zero-argument callable returning the autocast context
    dist: DistInfo

    # The collectives a run needs, single-process no-ops without torchrun (distributed.py).

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that logs, validates and writes."""
        return self.dist.is_main

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank (a pickled object, read on the host)."""
        return D.broadcast_object(obj, self.dist)

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if it is True on any (stop decisions must agree)."""
        return D.any_rank(flag, self.dist, self.device)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over ranks in place, left on the device."""
        return D.all_reduce_tensor(tensor, self.dist)

    def shutdown(self, barrier: bool) -> None:
        """Leave the process group; with `barrier`, together."""
        D.shutdown(self.dist, barrier=barrier)

    @classmethod
    def for_training(cls, tc: TrainerConfig) -> Runtime:
        """The device (cuda:LOCAL_RANK under torchrun), the process group (joined here when torchrun
        started this process), the precision (TF32 allowed for fp32 on a GPU) and the thread count."""
        device = resolve_device(tc.device, DistInfo())
        dist = D.init_distributed(device.type)
        device = resolve_device(tc.device, dist)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        precision = resolve_precision(tc.precision, device)
        allow_tf32_for_training(device, precision)
        if tc.num_threads:
            torch.set_num_threads(tc.num_threads)
        return cls(device, precision, autocast_factory(device, DTYPES[precision]), dist)

    @classmethod
    def for_inference(cls, device: str = "auto", precision: str = "auto") -> Runtime:
        """One process, no process group: `device` auto | cpu | cuda | cuda:N, `precision` auto | bf16 |
        fp16 | fp32 (ValueError otherwise)."""
        problem = inference_device_error(device)
        if problem:
            raise ValueError(problem)
        resolved = torch.device(auto_device(device))
        if precision not in ("auto", *DTYPES):
            raise ValueError(f"precision={precision!r} must be auto, bf16, fp16 or fp32")
        precision = resolve_precision(precision, resolved)
        return cls(resolved, precision, autocast_factory(resolved, DTYPES[precision]), DistInfo())
