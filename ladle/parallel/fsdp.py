"""Data parallelism: FSDP2 (`fully_shard`) per transformer block plus the root, HSDP on a 2-D
(replicate x shard) mesh, or plain DDP for pure replication.

FSDP2 shards every parameter as a DTensor over the data ranks; each block's weights are gathered
just before it runs and (with `reshard_after_forward`) freed right after, gradients are
reduce-scattered in the backward. Under bf16-mixed the gathered weights are bf16 (half the
traffic) while the sharded master weights, the gradient reduction and the optimizer stay fp32.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ladle.config.schema import ParallelConfig


def apply_fsdp(
    model: nn.Module, dp_mesh, p: ParallelConfig, precision_mode: str, experts_mesh=None, dp_size: int = 1
) -> nn.Module:
    """experts_mesh: under expert parallelism, the data ranks that hold the same experts; the
    experts are sharded over those alone, and their gradient, which all-to-all already gathered
    from every rank's tokens, is divided by the whole data-parallel size like the others."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": dp_mesh}
    if precision_mode == "bf16-mixed":
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, p.fsdp_reduce_dtype)
        )
    elif precision_mode == "fp16-mixed":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    if p.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for _, block in model.blocks():
        experts = getattr(block.mlp, "experts", None)  # DeepSeek's first layers are dense
        if experts_mesh is not None and experts is not None:
            fully_shard(
                experts, reshard_after_forward=p.reshard_after_forward, **{**kwargs, "mesh": experts_mesh}
            )
            experts.set_gradient_divide_factor(float(dp_size))
            # gloo has no PREMUL_SUM: divide, then sum. (Not on a 1-rank mesh, where torch 2.13's
            # FSDP2 would then divide twice.)
            if experts_mesh.device_type == "cpu" and experts_mesh.size() > 1:
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, reshard_after_forward=p.reshard_after_forward, **kwargs)
    # The root holds the embedding, final norm and head; it is gathered for the whole step
    # anyway (the head runs last in forward, first in backward), so it is never resharded early.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def apply_ddp(model: nn.Module, device: torch.device, group=None) -> nn.Module:
    """DDP over `group` (the data-parallel ranks; None: the world)."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type != "cpu" else None
    return DistributedDataParallel(model, device_ids=ids, process_group=group)
