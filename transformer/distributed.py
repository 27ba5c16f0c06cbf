"""torch.distributed glue for `torchrun`: process group setup and the few collectives training needs.

Started by torchrun, each process sees RANK, LOCAL_RANK and WORLD_SIZE in its environment; without
them everything here degrades to single-process no-ops.
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str) -> DistInfo:
    """Join the process group torchrun prepared: NCCL for CUDA, gloo for CPU."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo()
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        # A short timeout turns a rank that died into an error on the others instead of a long hang.
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=10))
    return DistInfo(dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0")), dist.get_world_size())


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def all_reduce_tensor(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sums a device tensor over ranks in place and returns it, left on the device (nothing is read
    back to the host)."""
    if info.enabled:
        dist.all_reduce(tensor)
    return tensor


def any_rank(flag: bool, info: DistInfo, device) -> bool:
    """True on every rank if it is True on any rank (stop decisions must agree)."""
    if not info.enabled:
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def broadcast_object(obj, info: DistInfo):
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj, info: DistInfo) -> list:
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def shutdown(info: DistInfo, barrier: bool = True) -> None:
    """Leave the process group; with `barrier`, together (no rank tears down while another is still
    inside a collective, e.g. rank 0 writing the last checkpoint)."""
    if info.enabled and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


# What gloo and NCCL say in a collective when another rank of the run has gone (killed, crashed, stopped):
# its connection closed or reset, the collective aborted.
PEER_GONE = re.compile(
    r"connection (?:closed|reset) by peer(?: \[[^\]]*\]:\d+)?|broken pipe|remote process exited"
    r"|communicator was aborted|failed to recv, got 0 bytes",
    re.IGNORECASE,
)


def peer_gone(error: BaseException | None) -> str | None:
    """The backend's words (`Connection closed by peer [127.0.0.1]:4242`) when `error`, or an error that
    led to it, says another rank of the run has gone; None when it says something else."""
    while error is not None:
        found = PEER_GONE.search(str(error)) if isinstance(error, RuntimeError) else None
        if found:
            return found[0]
        error = error.__cause__ or error.__context__
    return None
