"""A live model's weights streamed one tensor at a time in a Hugging Face family's names
(`stream_hf`): what an inference engine's copy of the policy is fed after each update
(ladle/rl/vllm.py). The same tensors `save_hf` writes, without a whole copy anywhere."""

from __future__ import annotations

import torch

from ladle.config.schema import ModelConfig
from ladle.models.hf.names import FUSED, hf_layout
from ladle.models.lora import LoRALinear, full_tensor, merged
from ladle.models.nf4 import base_weight


@torch.no_grad()
def stream_hf(
    model: torch.nn.Module, cfg: ModelConfig, dtype: torch.dtype | None = None, untie: bool = False
):
    """(HF name, tensor) pairs of a live model's weights in the family's names, one tensor at a time:
    each gathered from its shards (FSDP, TP) only when its turn comes, adapters merged in on the
    fly, experts sliced from their stacked parameter; so a rank never holds more than one whole
    weight besides its shards. Every rank of the model's layout must iterate together (the
    gathers are collectives). `untie`: a tied model's embedding also as `lm_head.weight`, for an
    engine that keeps the head apart."""
    modules = dict(model.named_modules())
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    by_ours: dict[str, list[tuple[str, int | None]]] = {}
    for hf, (ours, expert, _) in hf_layout(cfg).items():
        by_ours.setdefault(ours, []).append((hf, expert))
    pending: dict[str, torch.Tensor] = {}  # GLM's gate rows, waiting for the up rows to join them
    for ours, names in by_ours.items():
        module, _, leaf = ours.rpartition(".")
        m = modules.get(module)
        if isinstance(m, LoRALinear) and leaf == "weight":
            full = merged(m, full_tensor)
        elif leaf == "weight" and hasattr(m, "weight_nf4"):  # QLoRA's quantized layer without adapter
            full = base_weight(m)
        else:
            full = full_tensor(tensors[ours])
        if dtype is not None:
            full = full.to(dtype)
        for hf, expert in names:
            t = full if expert is None else full[expert]
            fused = FUSED.fullmatch(hf)
            if fused is None:
                yield hf, t
            elif fused[2] == "":  # the gate's rows: the up's come next
                pending[fused[1]] = t
            else:
                yield fused[1], torch.cat([pending.pop(fused[1]), t])
        if untie and cfg.tie_embeddings and ours == "embed_tokens.weight":
            yield "lm_head.weight", full
        del full
