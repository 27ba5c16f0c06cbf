"""The host's share of a training step, measured without a GPU (issue 69): how many operators the trainer's
update dispatches, and how long the host takes over them, with the model on the `meta` device.

A meta tensor has a shape and a dtype but no values: an operator on it runs its shape function and no
arithmetic, so a step there costs what the host does around the arithmetic: Python, autograd, the dispatcher,
the shape checks. On a GPU that is the part that must stay ahead of the kernels; on this machine's CPUs it can
be counted and timed, and it moves with every operator a change adds or removes. The count is exact and the
same on every machine of one torch version; the time is this host's and a meta operator's (some shape
functions are written in Python, so a meta operator is not a CUDA launch), for comparing changes side by side.

A step is what `Trainer._update` runs for one update: `TrainingStep` (the batch copied to the device, the
forward with dropout, the fused label-smoothed loss, backward, clipping, the fused AdamW step and the
schedule), the EMA's update when `trainer.ema_decay` is set, and `TrainLog.add`. The trainer's own classes do
it (`build_model`, `build_optimizer`, `TrainingStep`, `TrainLog`), on a model built on the CPU and moved (as
`Trainer.build_model` does; built under `torch.device("meta")`, a tensor the model makes without `device=`
would land on meta too, and a misplaced one would go unseen). The log line every `trainer.log_every` steps,
which reads the numbers back, is not part of it.

Where meta is not a GPU, and what is done about it while a step runs here (`on_meta`):
- the fused AdamW refuses a meta parameter when it makes its state (its device check lists the devices with
  a fused kernel; meta has the shape function): the check lets meta through;
- clipping takes its for-each path (one `_foreach_norm`) only on the devices torch lists as having for-each
  kernels (a GPU, the CPU), else one norm and one product per parameter: meta is added to the list;
- the loss takes its chunk of target tokens by device type (`loss.CHUNK_ROWS`): meta is given CUDA's, so the
  loop over chunks is the GPU's. The operator count depends on the batch through that loop only: each
  further chunk of target tokens adds the same few dozen operators; the sentences and lengths change nothing;
- not changed: SDPA takes its math path on meta (batched matmuls and a softmax, where a GPU runs one fused
  kernel), and dropout ATen's unfused one (4 operators where CUDA runs `native_dropout`); both are fixed per
  layer, so the count still moves one for one with a change to this project's code;
- autocast has no meta version (`torch.autocast("meta")` refuses): bf16 autocast cannot be measured here
  (`autocast_on_meta`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from transformer import loss as loss_module
from transformer.config import ModelConfig, TrainerConfig
from transformer.data.batching import Batch
from transformer.distributed import DistInfo
from transformer.model import build_model
from transformer.runtime import Runtime, autocast_factory
from transformer.special import PAD_ID
from transformer.training.ema import ExponentialMovingAverage
from transformer.training.optim import build_optimizer
from transformer.training.step import TrainingStep
from transformer.training.step_log import TrainLog

META = torch.device("meta")
VOCAB = 32000  # a WMT-sized joint vocabulary; on meta it changes nothing but the CPU's build time
# The phases of a step, in the order they run: forward (the batch's copy, the model, the fused loss's forward
# pass, the step's sums, backward's seed), backward (what the autograd engine runs), clip (clip_grad_norm_),
# optimizer (AdamW's step), other (the finite check, the profiler labels of optimizer.step and zero_grad, the
# numbers stacked, the EMA, TrainLog.add).
PHASES = ("forward", "backward", "clip", "optimizer", "other")


def autocast_on_meta() -> bool:
    """Whether torch.autocast works on meta (not in torch 2.13: it refuses the device type)."""
    return torch.amp.is_autocast_available("meta")


@dataclass(frozen=True)
class BatchShape:
    """A batch as collate makes it: B sentences, source (B, S), target (B, T), N real target tokens."""

    sentences: int  # B
    src_len: int  # S, padded
    tgt_len: int  # T, padded (BOS + target, or target + EOS)
    tgt_tokens: int  # N <= B * T

    def __post_init__(self):
        if not 0 < self.tgt_tokens <= self.sentences * self.tgt_len:
            raise ValueError(f"{self.tgt_tokens} target tokens do not fit {self.sentences} rows of {self.tgt_len}")

    @classmethod
    def for_budget(cls, max_tokens: int, width: int = 32, real: int = 30) -> BatchShape:
        """The batch of a `trainer.max_tokens` budget at one padded width (sentences x width <= budget),
        `real` tokens of each row real: about 30 tokens a sentence, as in WMT-like data."""
        sentences = max(1, max_tokens // width)
        return cls(sentences, width, width, sentences * min(real, width))

    def cpu_batch(self, vocab: int = VOCAB) -> Batch:
        """The batch on the host, as the DataLoader hands it to the step: ids in [4, vocab), each target row
        real for its first N / B positions (or one more), PAD after."""
        generator = torch.Generator().manual_seed(0)
        src = torch.randint(4, vocab, (self.sentences, self.src_len), generator=generator)  # (B, S)
        tgt = torch.randint(4, vocab, (self.sentences, self.tgt_len + 1), generator=generator)  # (B, T + 1)
        lengths = torch.full((self.sentences,), self.tgt_tokens // self.sentences)  # (B,)
        lengths[: self.tgt_tokens % self.sentences] += 1
        real = torch.arange(self.tgt_len)[None, :] < lengths[:, None]  # (B, T)
        tgt_in, tgt_out = tgt[:, :-1].masked_fill(~real, PAD_ID), tgt[:, 1:].masked_fill(~real, PAD_ID)
        positions = real.flatten().nonzero().squeeze(1)  # (N,) into B * T, as collate gives them
        return Batch(src, tgt_in, tgt_out, self.tgt_tokens, 1.0 - real.float().mean().item(), positions)


@contextlib.contextmanager
def on_meta():
    """Meta on a GPU's paths (see the module docstring): the fused AdamW's device check lets meta through,
    clipping takes the for-each path, and the loss's chunks are CUDA's. All undone on leaving. These are
    torch's private names (2.13): a torch that renames them fails here, loudly."""
    from torch.optim import adam
    from torch.utils import _foreach_utils

    check = adam._device_dtype_check_for_fused
    foreach_devices = _foreach_utils._get_foreach_kernels_supported_devices

    def meta_passes(param, *args, **kwargs):
        if param.device.type != "meta":
            check(param, *args, **kwargs)

    chunks = loss_module.CHUNK_ROWS
    had_meta, meta_rows = "meta" in chunks, chunks.get("meta")
    adam._device_dtype_check_for_fused = meta_passes
    _foreach_utils._get_foreach_kernels_supported_devices = lambda: [*foreach_devices(), "meta"]
    chunks["meta"] = chunks["cuda"]
    try:
        yield
    finally:
        adam._device_dtype_check_for_fused = check
        _foreach_utils._get_foreach_kernels_supported_devices = foreach_devices
        if had_meta:
            chunks["meta"] = meta_rows
        else:
            del chunks["meta"]


def chunk_rows() -> int:
    """Target tokens per chunk of the loss on meta while `on_meta` holds: a GPU's."""
    return loss_module.CHUNK_ROWS["cuda"]


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched in the block by phase (`PHASES`), below autograd: what the
    device would run, a composite operator counted by the operators it becomes, a fused one once. Also
    records the operators that take or make a CPU tensor (on a GPU: a copy from the host or a refusal)."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.ops: Counter[tuple[str, str]] = Counter()  # (phase, operator) -> times dispatched
        self.host_tensor_ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        phase = "backward" if torch._C._current_autograd_node() is not None else self.phase
        self.ops[phase, name] += 1
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tree_flatten((args, kwargs, out))[0]):
            self.host_tensor_ops.append(name)
        return out

    def by_phase(self) -> dict[str, int]:
        counts = dict.fromkeys(PHASES, 0)
        for (phase, _), n in self.ops.items():
            counts[phase] += n
        return counts

    def by_operator(self) -> Counter[str]:
        counts: Counter[str] = Counter()
        for (_, name), n in self.ops.items():
            counts[name] += n
        return counts


@dataclass
class StepState:
    """The part of `TrainingState` that `TrainingStep` uses, and the EMA that `Trainer._update` folds in."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: torch.amp.GradScaler
    ema: ExponentialMovingAverage | None = None
    step: int = 0


@dataclass
class StepCount:
    """One step's operators: by phase, by operator, and those that touched a CPU tensor."""

    by_phase: dict[str, int]
    by_operator: Counter[str]
    host_tensor_ops: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.by_phase.values())


class MetaTrainingStep:
    """The trainer's update of a `model_cfg` model (fp32: see `autocast_on_meta`) under the trainer settings
    `tc` (clipping, smoothing, R-Drop, EMA, optimizer, schedule), on meta, one batch per update (not
    `trainer.update_freq`'s several). Call it with a CPU batch; use it inside `on_meta()`."""

    def __init__(self, model_cfg: ModelConfig, tc: TrainerConfig, vocab: int = VOCAB):
        torch.manual_seed(tc.seed)
        model = build_model(model_cfg, vocab, vocab, True).to(META)  # built on the CPU, moved: as the trainer
        optimizer, scheduler = build_optimizer(model, tc, META)
        scaler = torch.amp.GradScaler(META.type, enabled=False)  # fp16's only
        ema = ExponentialMovingAverage(model, tc.ema_decay, tc.ema_warmup) if tc.ema_decay else None
        self.state = StepState(model, optimizer, scheduler, scaler, ema)
        runtime = Runtime(META, "fp32", autocast_factory(META, None), DistInfo())
        self.log = TrainLog(META, None, tc.max_bad_steps)
        self.update = TrainingStep(tc, self.state, runtime, self.log)

    def __call__(self, batch: Batch) -> None:
        """One update as `Trainer._update` makes it (without its log line, validation and checkpoints)."""
        micro = [(batch, 1.0)]
        result = self.update(micro)
        self.state.step += 1
        if self.state.ema:
            self.state.ema.update(self.state.step)
        self.log.add(result, micro)

    def count(self, batch: Batch) -> StepCount:
        """The operators of one step (run after a first one: that one also makes the optimizer's state)."""
        counter = OpCounter()
        optimizer = self.state.optimizer

        def phase(name):
            def hook(*_):
                counter.phase = name

            return hook

        clip = torch.nn.utils.clip_grad_norm_

        def clip_in_its_phase(*args, **kwargs):
            counter.phase = "clip"
            try:
                return clip(*args, **kwargs)
            finally:
                counter.phase = "other"

        hooks = [
            optimizer.register_step_pre_hook(phase("optimizer")),
            optimizer.register_step_post_hook(phase("other")),
        ]
        torch.nn.utils.clip_grad_norm_ = clip_in_its_phase  # step.py looks it up at every call
        try:
            with counter:
                self(batch)
        finally:
            torch.nn.utils.clip_grad_norm_ = clip
            for handle in hooks:
                handle.remove()
        return StepCount(counter.by_phase(), counter.by_operator(), counter.host_tensor_ops)

    def host_seconds(self, batch: Batch, repeats: int) -> tuple[list[float], list[float]]:
        """Wall time and this process's CPU time of each of `repeats` steps (not counted: the counter's own
        Python would be timed). The CPU time is the steadier figure where other processes share the cores."""
        wall, cpu = [], []
        for _ in range(repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            self(batch)
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        return wall, cpu


def measure(model_cfg: ModelConfig, tc: TrainerConfig, shapes: list[BatchShape], repeats: int = 10) -> list[dict]:
    """Per batch shape: the operators of a step (total, by phase, the ten most dispatched) and the host's
    median milliseconds per step over `repeats` steps (wall and CPU time), after a first step that makes the
    optimizer's state."""
    rows = []
    with on_meta():
        step = MetaTrainingStep(model_cfg, tc)
        for shape in shapes:
            batch = shape.cpu_batch()
            step(batch)  # warm-up: the optimizer's state, the first call of each operator
            count = step.count(batch)
            wall, cpu = step.host_seconds(batch, repeats)
            rows.append(
                {
                    "sentences": shape.sentences,
                    "src_len": shape.src_len,
                    "tgt_len": shape.tgt_len,
                    "tgt_tokens": shape.tgt_tokens,
                    "loss_chunks": -(-shape.tgt_tokens // chunk_rows()),
                    "ops": count.total,
                    "ops_by_phase": count.by_phase,
                    "top_ops": dict(count.by_operator.most_common(10)),
                    "host_tensor_ops": count.host_tensor_ops,
                    "host_ms": 1000 * statistics.median(wall),
                    "host_ms_each": [1000 * t for t in wall],
                    "host_cpu_ms": 1000 * statistics.median(cpu),
                }
            )
    return rows
