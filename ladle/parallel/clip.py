"""Global-norm gradient clipping that spans sharded parameters.

With FSDP2 and tensor parallel the gradients are DTensors: the norm of each is computed over its
shards and combined across ranks, so every rank gets the norm of the whole model's gradient (the
one a single process would compute) and clips by the same factor.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, pp_group=None) -> torch.Tensor:
    """pp_group: the pipeline stages, each holding other parameters (their norms add up)."""
    params = [p for p in parameters if p.grad is not None]
    total = total_norm([p.grad for p in params], pp_group)
    if math.isfinite(max_norm):
        for group in _by_layout(params, lambda p: p.grad).values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total


@torch.no_grad()
def total_norm(tensors: list[torch.Tensor], pp_group=None) -> torch.Tensor:
    """The 2-norm of all `tensors` together, as one process holding them whole would compute it:
    DTensors over all their shards, plain tensors as they are (replicas), plus the other stages'."""
    # Grouped by mesh and placements (FSDP, TP and expert-parallel DTensors live on different
    # meshes, and foreach ops take one kind at a time): a norm per group, then the total.
    norms = []
    for group in _by_layout(tensors, lambda t: t).values():
        n = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=True)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms])) if norms else torch.zeros(())
    if pp_group is not None:
        sq = total.square()
        torch.distributed.all_reduce(sq, group=pp_group)
        total = sq.sqrt()
    return total


def _by_layout(items, tensor_of) -> dict:
    groups: dict = {}
    for item in items:
        t = tensor_of(item)
        key = (t.device_mesh, t.placements) if isinstance(t, DTensor) else None
        groups.setdefault(key, []).append(item)
    return groups
