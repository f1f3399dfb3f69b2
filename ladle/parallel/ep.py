"""Expert parallel: each of `ep` ranks holds n_experts / ep experts; tokens travel to their experts
and back with all-to-all (NCCL, HCCL and gloo all have it).

The MoE layer is unchanged: it sorts its (token, expert) pairs by global expert id and calls its
`experts` module with those rows and the count per expert. Around that module, the hooks below
(1) send each rank the rows of the experts it holds (rows sorted by expert are already grouped by
owning rank, as rank r owns experts [r * E/ep, (r+1) * E/ep)), (2) regroup the received rows by
local expert for the grouped matmul, and after it (3) undo the regrouping and (4) send the
results back, in the order they came. Gradients take the same ways back (autograd all-to-all).

The expert weights become DTensors sharded on their first (expert) dimension over the ep mesh,
so checkpoints hold all experts and load into any layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor


def apply_ep(model: nn.Module, ep_mesh) -> None:
    for _, block in model.blocks():
        experts = getattr(block.mlp, "experts", None)  # DeepSeek's first layers are dense
        if experts is not None:
            distribute_module(experts, ep_mesh, _shard_experts, input_fn=_dispatch, output_fn=_combine)


def _shard_experts(name, module, mesh):
    for key, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(key, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))


def _dispatch(module, inputs, mesh):
    x, counts, grouped = inputs  # rows sorted by global expert, (E,) rows per expert
    group, ep = mesh.get_group(), mesh.size()
    local_e = counts.numel() // ep
    # How many rows each rank sends to each of our experts: (ep source ranks, local experts).
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_counts = recv_counts.view(ep, local_e)
    send_split = counts.view(ep, local_e).sum(1).tolist()
    recv_split = recv_counts.sum(1).tolist()
    y = all_to_all_single_autograd(x, recv_split, send_split, group)
    y = _wait(y)
    # Received rows come by source rank, then by expert; the grouped matmul wants them by expert.
    expert_of_row = torch.repeat_interleave(
        torch.arange(local_e, device=x.device).repeat(ep), recv_counts.flatten()
    )
    order = torch.argsort(expert_of_row, stable=True)
    module._ep_state = (order, send_split, recv_split, group)
    return y[order], recv_counts.sum(0), grouped


def _combine(module, out, mesh):
    order, send_split, recv_split, group = module._ep_state
    module._ep_state = None
    back = out[torch.argsort(order)]  # the rows in the order they were received
    return _wait(all_to_all_single_autograd(back, send_split, recv_split, group))


def _wait(t: torch.Tensor) -> torch.Tensor:
    # Functional collectives return an async tensor; use it only once it has arrived.
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t
