"""Activation checkpointing per transformer block, applied from outside the model.

`full` recomputes every block's forward during backward (only each block's input is kept);
`selective: N` does so for every N-th block; `selective: op` keeps what is expensive to
recompute (the outputs of matmuls and attention) and recomputes the cheap elementwise ops (norms,
RoPE, SiLU, casts), which hold most of a block's activation bytes for a fraction of its FLOPs.
`offload` moves whatever is saved to host memory (pinned) and back for backward.

The block's `forward` is replaced on the instance, so parameter names, checkpoints and exports
are unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ladle.config.schema import ActivationCheckpointConfig

_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._grouped_mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _keep_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, cfg: ActivationCheckpointConfig, device: torch.device) -> None:
    for i, block in model.blocks():
        forward = block.forward
        if cfg.mode == "full" or (
            cfg.mode == "selective" and cfg.selective != "op" and i % cfg.selective == 0
        ):
            forward = _checkpointed(forward)
        elif cfg.mode == "selective" and cfg.selective == "op":
            forward = _checkpointed(
                forward, functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
            )
        if cfg.offload and device.type != "cpu":
            forward = _offloaded(forward)
        block.forward = forward


# Plain closures, not functools.partial: torch.compile traces through these (and through
# checkpoint), while a partial as a module's forward made it skip the block silently.
def _checkpointed(forward, context_fn=None):
    kwargs = {"context_fn": context_fn} if context_fn else {}

    def run(*args):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def _offloaded(forward):
    def run(*args):
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return forward(*args)

    return run
