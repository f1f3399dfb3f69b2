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


def apply_fsdp(model: nn.Module, dp_mesh, p: ParallelConfig, precision_mode: str) -> nn.Module:
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
    for block in model.layers:
        fully_shard(block, reshard_after_forward=p.reshard_after_forward, **kwargs)
    # The root holds the embedding, final norm and head; it is gathered for the whole step
    # anyway (the head runs last in forward, first in backward), so it is never resharded early.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def apply_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type != "cpu" else None)
