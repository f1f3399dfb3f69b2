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

DeepSeek-V3's latent attention: q_b_proj (or q_proj) and kv_b_proj are split by heads, o_proj by
input; the low-rank q_a_proj and kv_a_proj_with_mqa and their norms are small and replicated (every
rank computes them on the gathered sequence alike), and the rotary key part every head shares
(`MLA.shared_key`) has its gradient summed over the ranks' heads.

Mixture of experts: the routed experts and the router are not split. Each rank routes the tokens
of its own sequence shard through whole, replicated experts (token parallel: no all-gather of the
sequence), and the gradients of those weights are summed over the group; shared experts are split
like a dense MLP over the gathered tokens. The router's statistics are per shard: the token counts
are summed over the group (metrics and the bias update see the whole batch), the balancing and z
losses averaged (exact for the z-loss; the balancing loss of the whole sequence is not a mean of
its shards', so it is close to one process's, not equal).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ladle.models.mla import MLA
from ladle.models.moe import MoE


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
        attn, mlp = block.self_attn, block.mlp
        mla = isinstance(attn, MLA)
        plan = {
            "input_layernorm": SequenceParallel(),
            # Block.forward(x, cos, sin, mask, cache, layer): only x is sharded (by sequence).
            # Latent attention takes it as a plain tensor (its replicated parts run on it as is).
            "self_attn": PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None, None, None),
                desired_input_layouts=(Replicate(), None, None, None, None, None),
                use_local_output=mla,
            ),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
        }
        if mla:
            q = "q_b_proj" if attn.low_rank_q else "q_proj"
            plan.update({f"self_attn.{q}": ColwiseParallel(), "self_attn.kv_b_proj": ColwiseParallel()})
        else:
            plan.update({f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")})
        if isinstance(mlp, MoE):
            # Token parallel: the layer gets this rank's sequence shard as a plain tensor.
            plan["mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
            )
            if hasattr(mlp, "shared_experts"):  # called on the layer's (tokens, dim) rows
                plan.update(_mlp_plan("mlp.shared_experts", Shard(0)))
        else:
            plan.update(_mlp_plan("mlp", Shard(1)))
        if getattr(block, "post_norms", False):  # GLM-4-0414: on the branches' sequence shards
            plan["post_self_attn_layernorm"] = SequenceParallel(use_local_output=True)
            plan["post_mlp_layernorm"] = SequenceParallel(use_local_output=True)
        parallelize_module(block, tp_mesh, plan)
        if getattr(attn, "qk_norm", False):
            for norm in (attn.q_norm, attn.k_norm):
                _heads_sharded(norm, tp_mesh)
        if mla:
            for name in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"):
                if hasattr(attn, name):
                    _replicated(getattr(attn, name), tp_mesh)
            distribute_module(attn.shared_key, tp_mesh, input_fn=_as_replicated, output_fn=_sum_grad)
        if isinstance(mlp, MoE):
            for module in (mlp.gate, mlp.experts):  # whole on every rank; MoE uses their local tensors
                _replicate_params(None, module, tp_mesh)
            mlp.register_forward_hook(_router_stats(tp_mesh))


def _mlp_plan(prefix: str, rows) -> dict:
    """A SwiGLU MLP whose input and output are sharded on `rows`: gathered in, reduce-scattered out."""
    return {
        prefix: PrepareModuleInput(input_layouts=(rows,), desired_input_layouts=(Replicate(),)),
        f"{prefix}.gate_proj": ColwiseParallel(),
        f"{prefix}.up_proj": ColwiseParallel(),
        f"{prefix}.down_proj": RowwiseParallel(output_layouts=rows),
    }


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


def _replicate_params(name, module, mesh):
    for key, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(key, nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()])))


def _as_replicated(module, inputs, mesh):
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)


def _sum_grad(module, out, mesh):
    """Forward: the same tensor. Backward: each rank's gradient is its heads' part, and going back
    through `from_local(Replicate)` the partial sum is all-reduced."""
    return out.to_local(grad_placements=[Partial()])


def _replicated(module: nn.Module, mesh) -> None:
    """A small module every rank computes whole on the same input (latent attention's low-rank
    projections and norms): replicated weights; its output's gradient arrives complete on every
    rank (what follows is a split projection, whose input gradient DTensor all-reduces)."""
    distribute_module(
        module,
        mesh,
        _replicate_params,
        input_fn=_as_replicated,
        output_fn=lambda m, out, mesh: out.to_local(),
    )


def _router_stats(mesh):
    """The MoE layer's statistics of this rank's shard -> the group's: counts summed; the losses'
    values averaged over the group, their gradients this rank's share of that mean."""
    group, n = mesh.get_group(), mesh.size()

    def hook(module, inputs, out):
        y, (aux, z, counts) = out
        counts = counts.clone()
        mean = torch.stack([aux.detach(), z.detach()]).float()
        dist.all_reduce(counts, group=group)
        dist.all_reduce(mean, group=group)
        mean = mean / n
        aux = aux / n + (mean[0] - aux.detach() / n).to(aux.dtype)
        z = z / n + (mean[1] - z.detach() / n).to(z.dtype)
        return y, (aux, z, counts)

    return hook


def _heads_sharded(norm: nn.Module, mesh) -> None:
    """A per-head norm on (B, T, heads / tp, D) local tensors: computed as a DTensor sharded on the
    head dimension with a replicated weight, so the weight's gradient is reduced over TP ranks."""
    distribute_module(
        norm,
        mesh,
        _replicate_params,
        input_fn=lambda mod, inputs, mesh: (
            DTensor.from_local(inputs[0], mesh, [Shard(2)], run_check=False),
        ),
        output_fn=lambda mod, out, mesh: out.to_local(),
    )
