"""Applies the layout to a model from outside, in torchtitan's order: tensor and expert parallel
first (they change what the parameters are), LoRA adapters, activation checkpointing, compile per
block, then FSDP2 over the data ranks (it wraps the DTensors TP and EP made) or DDP for pure
replication. Under pipeline parallelism each stage is laid out so (`build_pipeline`).

What is applied comes in as arguments (`Apply`), not from the run config, so one run can lay out
a trained policy (adapters, checkpointing, compile) and a frozen reference (none of them) alike.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from ladle.config.schema import ActivationCheckpointConfig, LoRAConfig, ModelConfig, ParallelConfig
from ladle.models.lora import apply_lora
from ladle.parallel.ac import apply_ac
from ladle.parallel.compile import compile_blocks
from ladle.parallel.ep import apply_ep
from ladle.parallel.fsdp import apply_ddp, apply_fsdp
from ladle.parallel.mesh import Parallel
from ladle.parallel.tp import apply_tp, enable_async_tp


@dataclass(frozen=True)
class Apply:
    """What `parallelize` applies to a model besides the layout itself."""

    parallel: ParallelConfig  # FSDP options (reshard, offload), async TP, the pipeline schedule
    precision: str = "fp32"  # precision.mode: FSDP's parameter and reduce dtypes
    lora: LoRAConfig | None = None
    ac: ActivationCheckpointConfig | None = None
    compile: bool = False
    seed: int = 0  # the adapters' initialisation

    def frozen(self) -> Apply:
        """A model that is only run forward: no adapters, no activation checkpointing."""
        return replace(self, lora=None, ac=None)


def parallelize(model: nn.Module, par: Parallel, device: torch.device, what: Apply) -> nn.Module:
    lay = par.layout
    if lay.tp > 1:
        apply_tp(model, par.submesh("tp"))
        if what.parallel.async_tp:
            enable_async_tp(par.submesh("tp"))
    if lay.ep > 1:
        apply_ep(model, par.submesh("ep"))
    if what.lora is not None:  # on TP's DTensors (adapters placed like their base), before FSDP
        apply_lora(model, what.lora, what.seed)
    if what.ac is not None and what.ac.mode != "none":
        apply_ac(model, what.ac, device)
    if what.compile:
        compile_blocks(model, eager_attention=lay.tp == 1)
    if lay.fsdp:
        shard = "dp_shard_cp" if lay.cp > 1 else "dp_shard"  # a CP group's ranks hold the same weights
        mesh = par.submesh("dp_replicate", shard) if lay.dp_replicate > 1 else par.submesh(shard)
        experts = None
        if lay.ep > 1:
            experts = (
                par.submesh("dp_replicate", "dp_shard_mod_ep")
                if lay.dp_replicate > 1
                else par.submesh("dp_shard_mod_ep")
            )
        return apply_fsdp(
            model, mesh, what.parallel, what.precision, experts_mesh=experts, dp_size=par.dp_size
        )
    if lay.dp > 1 and any(p.requires_grad for p in model.parameters()):  # a frozen model needs no DDP
        return apply_ddp(model, device, par.dp_group)
    return model


def gather_model(
    model: nn.Module, par: Parallel, model_cfg: ModelConfig, lora: LoRAConfig | None = None
) -> nn.Module | None:
    """A plain, whole copy of a sharded model on rank 0 (None elsewhere), for the end-of-run
    sample. Every rank must call it (the shards are gathered)."""
    if par.layout.world == 1:
        return model
    if par.layout.pp > 1:
        return None  # the stages live on other ranks: no end-of-run sample (yet)
    core = getattr(model, "module", model)  # DDP
    if not (par.layout.fsdp or par.layout.tp > 1):
        return core if torch.distributed.get_rank() == 0 else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from ladle.models.llama import build_model

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if torch.distributed.get_rank() != 0:
        return None
    w = next(iter(full.values()))
    plain = build_model(model_cfg, device="cpu", dtype=w.dtype, init=False)
    if lora is not None:
        apply_lora(plain, lora)
    plain.load_state_dict(full)
    return plain.to(next(core.parameters()).device)


def build_pipeline(
    model: nn.Module, par: Parallel, device: torch.device, what: Apply, n_micro: int, seq_len: int
):
    """This rank's stages of a meta-device model, each laid out with the other degrees, and the
    schedule that runs `n_micro` microbatches of `seq_len` tokens through them: (RankModel of the
    parts, Pipeline)."""
    from ladle.parallel.pp import STAGES_PER_RANK, Pipeline, RankModel, split_model, stage_bounds, stage_ids

    p = what.parallel
    n_layers = len(model.layers)
    n_stages = par.layout.pp * STAGES_PER_RANK[p.pp_schedule]
    bounds = stage_bounds(n_layers, n_stages, p.pp_split)
    stages = stage_ids(par.mesh["pp"].get_local_rank(), par.layout.pp, p.pp_schedule)
    parts = [parallelize(part, par, device, what) for part in split_model(model, bounds, stages)]
    hidden = (seq_len // par.layout.tp, model.cfg.dim)  # sequence parallel: a shard of the sequence
    pipe = Pipeline(parts, stages, n_stages, p.pp_schedule, n_micro, par.pp_group, device, hidden)
    return RankModel(parts), pipe
