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

_device = torch.device("cpu")  # where this process group's collectives take their tensors


def init(device: torch.device, timeout_s: float = 600.0) -> None:
    global _device
    if dist.is_initialized():
        return
    _device = device
    backend = dev.backend_for(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun set RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type != "cpu" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def collective_device() -> torch.device:
    return _device


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def all_gather_objects(obj) -> list:
    """Every rank's `obj` (picklable), in rank order."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when it is true on one (e.g. a SIGTERM that reached one rank)."""
    if world_size() == 1:
        return flag
    return bool(all_reduce_max(torch.tensor([int(flag)], device=device)).item())
