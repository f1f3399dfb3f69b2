"""Bytes of a model's state on each rank of a layout: parameters, gradients, optimizer state.

Counted tensor by tensor on a meta-device copy of the model (with its adapters), each split the
way ladle lays it out: tensor parallel by the plan of ladle/parallel/tp.py (q/k/v, gate/up and
the head by output rows, o/down by input columns, the embedding by vocabulary rows; norms, the
router and the routed experts whole, latent attention's q_b/kv_b by rows and its low-rank q_a/kv_a
whole), experts over `ep` ranks, then FSDP2's dim-0 shard over `dp_shard x cp` ranks
(`dp_shard / ep` for experts), padded to equal shards. A pipeline rank holds its stages' blocks,
the first stage also the embedding, the last the final norm and head. The worst rank is what
must fit. Checked exactly against `ladle.plan.measure.state_bytes` of real runs.

AdamW keeps two moments in the parameter's dtype and a step count (4 bytes a tensor); Muon one
momentum buffer in the parameter's dtype for each matrix it takes (ladle/train/muon.py), AdamW's
state for the rest, and, while it steps, the largest of them gathered whole with its Newton-Schulz
iterates (`muon_workspace`); gradients have the parameter's dtype. Frozen weights have neither; an NF4 base (QLoRA) is stored at 4.13
bits a weight (ladle/models/nf4.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ladle.config.schema import LoRAConfig, ModelConfig
from ladle.parallel.mesh import Layout
from ladle.train.muon import is_muon

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head", "q_b_proj", "kv_b_proj")
ROWWISE = ("o_proj", "down_proj")
NF4_BLOCK, NF4_GROUP = 64, 256


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    trained: bool
    nf4: bool = False  # an NF4 base weight (QLoRA)

    @property
    def module(self) -> str:
        parts = self.name.split(".")
        return parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]

    @property
    def layer(self) -> int | None:
        """The block index, None for the embedding, final norm and head."""
        parts = self.name.split(".")
        return int(parts[1]) if parts[0] == "layers" else None

    @property
    def expert(self) -> bool:
        return ".experts." in self.name


def tensors(cfg: ModelConfig, trained: bool = True, lora: LoRAConfig | None = None) -> list[Tensor]:
    """The model's parameters (and NF4 bases) as named shapes, on the meta device."""
    return _tensors(cfg.model_dump_json(), trained, lora.model_dump_json() if lora is not None else None)


@functools.lru_cache(maxsize=32)
def _tensors(model_json: str, trained: bool, lora_json: str | None) -> list[Tensor]:
    from ladle.models.llama import Llama
    from ladle.models.lora import apply_lora

    cfg = ModelConfig.model_validate_json(model_json)
    lora = LoRAConfig.model_validate_json(lora_json) if lora_json else None
    with torch.device("meta"):
        model = Llama(cfg)
    if lora is not None and trained:
        apply_lora(model, lora)
    nf4 = lora is not None and trained and lora.quantize_base == "nf4"
    out = []
    for name, p in model.named_parameters():
        base = ".lora_" not in name and "magnitude" not in name
        quantized = nf4 and base and not p.requires_grad and p.dim() == 2 and name.startswith("layers.")
        out.append(Tensor(name, tuple(p.shape), trained and p.requires_grad, quantized))
    return out


def local_shape(t: Tensor, lay: Layout) -> tuple[int, ...]:
    shape = list(t.shape)
    if lay.tp > 1 and ".lora_" not in t.name and not t.expert:  # routed experts: token parallel
        if t.module in COLWISE or (t.module == "embed_tokens"):
            shape[0] //= lay.tp
        elif t.module in ROWWISE and len(shape) == 2:
            shape[1] //= lay.tp
    shards = lay.dp_shard * lay.cp if lay.fsdp else 1
    if t.expert and lay.ep > 1:
        shape[0] //= lay.ep
        shards //= lay.ep
    if shards > 1 and shape:
        shape[0] = math.ceil(shape[0] / shards)
    return tuple(shape)


def nf4_bytes(n: int) -> int:
    """An NF4 weight of n values: packed 4-bit indices, int8 block maxima (stored padded to whole
    groups), an fp32 scale and mean per group, and the 16 fp32 levels."""
    groups = math.ceil(n / NF4_BLOCK / NF4_GROUP)
    return math.ceil(n / 2) + groups * (NF4_GROUP + 8) + 16 * 4


def stage_of(t: Tensor, n_layers: int, bounds: list[tuple[int, int]]) -> int:
    """The pipeline stage holding `t` (0 for the embedding, the last for the norm and head)."""
    if t.layer is None:
        return 0 if t.module == "embed_tokens" else len(bounds) - 1
    return next(s for s, (a, b) in enumerate(bounds) if a <= t.layer < b)


def pp_ranks(n_layers: int, lay: Layout, schedule: str, split) -> list[list[int]]:
    """The stages each pipeline rank holds, and their layer bounds."""
    from ladle.parallel.pp import STAGES_PER_RANK, stage_bounds, stage_ids

    if lay.pp == 1:
        return [[0]], [(0, n_layers)]
    bounds = stage_bounds(n_layers, lay.pp * STAGES_PER_RANK[schedule], split)
    return [stage_ids(r, lay.pp, schedule) for r in range(lay.pp)], bounds


def state(
    ts: list[Tensor],
    lay: Layout,
    param_bytes: int,
    n_layers: int,
    schedule: str = "1f1b",
    split=None,
    optimizer: str = "adamw",
) -> list[dict[str, int]]:
    """Per pipeline rank: {"params", "grads", "optimizer", "layers"} in bytes (layers: the blocks it
    holds), under `optimizer` (optim.name)."""
    ranks, bounds = pp_ranks(n_layers, lay, schedule, split)
    out = []
    for stages in ranks:
        acc = {"params": 0, "grads": 0, "optimizer": 0}
        for t in ts:
            if stage_of(t, n_layers, bounds) not in stages:
                continue
            n = math.prod(local_shape(t, lay))
            if t.nf4:
                acc["params"] += nf4_bytes(math.prod(t.shape))
                continue
            acc["params"] += n * param_bytes
            if t.trained:
                # Tensor parallel's embedding gradient comes back replicated: whole on every rank.
                whole = lay.tp > 1 and not lay.fsdp and t.module == "embed_tokens"
                acc["grads"] += (math.prod(t.shape) if whole else n) * param_bytes
                if optimizer == "muon" and is_muon(t.name, len(t.shape)):
                    acc["optimizer"] += n * param_bytes  # the momentum buffer
                else:
                    acc["optimizer"] += 2 * n * param_bytes + 4
        acc["layers"] = sum(b - a for s, (a, b) in enumerate(bounds) if s in stages)
        acc["first"], acc["last"] = 0 in stages, len(bounds) - 1 in stages
        out.append(acc)
    return out


def muon_workspace(ts: list[Tensor], param_bytes: int, ns_bytes: int, lay: Layout | None = None) -> int:
    """Bytes Muon's step holds for its largest matrix (a stack of experts: all of them, or this
    rank's when split by expert alone): the update gathered whole and the result, in the
    parameter's dtype, and the Newton-Schulz iterate, its next value and three Gram-sized products
    in `ns_bytes`."""
    most = 0
    for t in ts:
        if t.trained and not t.nf4 and is_muon(t.name, len(t.shape)):
            rows, cols = t.shape[-2:]
            shape = t.shape
            if len(shape) == 3 and lay is not None and lay.fsdp + (lay.ep > 1) == 1:
                shape = (local_shape(t, lay)[0], rows, cols)  # one plain Shard(0): experts stay local
            whole, gram = (
                math.prod(shape),
                shape[0] * min(rows, cols) ** 2 if len(shape) == 3 else min(rows, cols) ** 2,
            )
            most = max(most, whole * (2 * param_bytes + 2 * ns_bytes) + 3 * gram * ns_bytes)
    return most


def block_elements(ts: list[Tensor], lay: Layout, layer: int = 0) -> int:
    """Elements of one block's parameters as FSDP gathers them (TP- and EP-local, unsharded)."""
    unsharded = Layout(tp=lay.tp, ep=lay.ep)
    return sum(math.prod(local_shape(t, unsharded)) for t in ts if t.layer == layer and not t.nf4)


def root_elements(ts: list[Tensor], lay: Layout) -> int:
    """Elements of the embedding, final norm and head (FSDP's root, gathered for the whole step)."""
    unsharded = Layout(tp=lay.tp)
    return sum(math.prod(local_shape(t, unsharded)) for t in ts if t.layer is None)
