"""Tensor parallel with sequence parallel (Megatron-LM's layout, on DTensor), applied from outside.

Per block: the norms run on sequence shards (`SequenceParallel`), attention and MLP gather the
sequence once at their input, q/k/v and gate/up are split by output (heads, hidden units:
`ColwiseParallel`), o and down by input (`RowwiseParallel`) and reduce-scattered back to sequence
shards. The embedding is split by vocabulary rows, the head by vocabulary columns, and its
logits stay sharded (a DTensor): the cross-entropy runs under `loss_parallel()`, so the full
(tokens x vocab) logits never exist on one rank. The model code sees plain local tensors of
`n_heads / tp` heads and infers head counts from shapes, so it knows nothing of this.

Qwen3's per-head q/k norms see local heads; their weights become replicated DTensors whose
gradients are summed over the TP group (a plain parameter would only see its local heads).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def apply_tp(model: nn.Module, tp_mesh) -> None:
    plan = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
    }
    if model.cfg.head == "score":
        # One output: nothing to split. The full sequence goes in, the weight is replicated over
        # the group (a DTensor like every parameter), and every rank computes the same scores.
        plan["score"] = PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=False
        )
    elif model.cfg.tie_embeddings:
        # The head multiplies by the embedding matrix, which the lookup shards by vocabulary rows:
        # with the sequence gathered first, the logits come out sharded by vocabulary like the
        # untied head's, and the gradients of both uses land on the one sharded weight.
        plan["tied_head"] = PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_output=False
        )
    else:
        plan["lm_head"] = ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        )
    parallelize_module(model, tp_mesh, plan)
    if model.cfg.head == "score" and getattr(model, "score", None) is not None:
        distribute_module(model.score, tp_mesh, output_fn=lambda mod, out, mesh: out.to_local())
    if model.embed_tokens is not None:
        model.embed_tokens.register_forward_hook(_wait_output)
    for _, block in model.blocks():
        plan = {
            "input_layernorm": SequenceParallel(),
            # Block.forward(x, cos, sin, mask, cache, layer): only x is sharded (by sequence).
            "self_attn": PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None, None, None),
                desired_input_layouts=(Replicate(), None, None, None, None, None),
            ),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        }
        if getattr(block, "post_norms", False):  # GLM-4-0414: on the branches' sequence shards
            plan["post_self_attn_layernorm"] = SequenceParallel(use_local_output=True)
            plan["post_mlp_layernorm"] = SequenceParallel(use_local_output=True)
        parallelize_module(block, tp_mesh, plan)
        attn = block.self_attn
        if getattr(attn, "qk_norm", False):
            for norm in (attn.q_norm, attn.k_norm):
                _heads_sharded(norm, tp_mesh)


def enable_async_tp(tp_mesh) -> None:
    """Async TP (torchtitan's option): inductor's micro-pipeline pass splits each all-gather ->
    matmul and matmul -> reduce-scatter of the compiled blocks into chunks that overlap, over
    symmetric memory of the TP group. CUDA only, and only under train.compile (checked before
    launch). The pass sees whole blocks: under TP, attention is compiled too (compile.py)."""
    import torch._inductor.config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def _wait_output(module, inputs, out):
    """The embedding's reduce-scatter runs async: its output is an `AsyncCollectiveTensor`. A
    compiled block given one returns a plain tensor as its input's gradient where DTensor's
    backward needs a DTensor (torch 2.13), so the first block gets the finished tensor instead.
    The copy is one (batch, seq / tp, dim) activation, and the norm would wait right there anyway."""
    return out.clone() if isinstance(out, AsyncCollectiveTensor) else out


def _heads_sharded(norm: nn.Module, mesh) -> None:
    """A per-head norm on (B, T, heads / tp, D) local tensors: computed as a DTensor sharded on the
    head dimension with a replicated weight, so the weight's gradient is reduced over TP ranks."""

    def replicate(name, module, mesh):
        for key, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(key, nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()])))

    distribute_module(
        norm,
        mesh,
        replicate,
        input_fn=lambda mod, inputs, mesh: (
            DTensor.from_local(inputs[0], mesh, [Shard(2)], run_check=False),
        ),
        output_fn=lambda mod, out, mesh: out.to_local(),
    )
