"""Process-group set-up and the few collectives the loop needs.

A process group always exists, also for a single process (world size 1 over an in-memory store),
so the same code path (DCP, all-reduces of token counts, stop flags) runs everywhere.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ladle import device as dev
from ladle import watchdog

_device = torch.device("cpu")  # where this process group's collectives take their tensors
_before_shutdown: list = []  # what must end while the group lives (an in-process inference engine)


def init(device: torch.device, timeout_s: float = 600.0, trace_dir: str | None = None) -> None:
    """`trace_dir`: where NCCL's flight recorder dumps (turned on under CUDA; ladle/watchdog.py)."""
    global _device
    if dist.is_initialized():
        return
    _device = device
    if trace_dir is not None:
        os.environ.update(watchdog.flight_recorder_env(device.type, trace_dir))
    backend = dev.backend_for(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun set RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type != "cpu" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def before_shutdown(fn) -> None:
    """Call `fn` at `shutdown`, before the group is destroyed (once)."""
    _before_shutdown.append(fn)


def shutdown() -> None:
    while _before_shutdown:
        _before_shutdown.pop()()
    if dist.is_initialized():  # (vLLM's engine destroys the group it joined when it shuts down)
        dist.destroy_process_group()


def collective_device() -> torch.device:
    return _device


def rank(group=None) -> int:
    """This process's rank in `group` (None: the world)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def world_size(group=None) -> int:
    """The ranks of `group` (None: the world)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if world_size() > 1:
        with watchdog.within("collective: barrier"):
            dist.barrier()


# The collectives below take a `group` (None: the world): the RL recipes' separated placement
# runs each group of ranks' rollout bookkeeping over that group alone (ladle/parallel/mesh.py).
def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    if world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_max(t: torch.Tensor, group=None) -> torch.Tensor:
    if world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def all_gather_objects(obj, group=None) -> list:
    """Every rank's `obj` (picklable), in rank order."""
    n = world_size(group)
    if n == 1:
        return [obj]
    out = [None] * n
    with watchdog.within("collective: all_gather_object"):
        dist.all_gather_object(out, obj, group=group)
    return out


def any_rank(flag: bool, device: torch.device, group=None) -> bool:
    """True on every rank when it is true on one (e.g. a SIGTERM that reached one rank)."""
    if world_size(group) == 1:
        return flag
    with watchdog.within("collective: any_rank (stop flags)"):
        return bool(all_reduce_max(torch.tensor([int(flag)], device=device), group).item())


def store():
    """The job's key-value store (torchrun's), which the watchdog's heartbeats go through."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
