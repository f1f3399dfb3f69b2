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
    # Grouped by mesh and placements (FSDP, TP and expert-parallel DTensors live on different
    # meshes, and foreach ops take one kind at a time): a norm per group, then the total.
    groups: dict = {}
    for p in parameters:
        if p.grad is not None:
            g = p.grad
            key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
            groups.setdefault(key, []).append(p)
    norms = []
    for params in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0, foreach=True)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms])) if norms else torch.zeros(())
    if pp_group is not None:
        sq = total.square()
        torch.distributed.all_reduce(sq, group=pp_group)
        total = sq.sqrt()
    if math.isfinite(max_norm):
        for params in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
