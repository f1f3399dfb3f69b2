"""Low-rank adapters on a model's linear layers: LoRA, rsLoRA and DoRA, laid out as PEFT lays them.

A targeted `nn.Linear` stays the same module with the same `weight` (so checkpoints, Hugging Face
loading and tensor parallel see the base layer unchanged) and gains `lora_A` (rank x in) and
`lora_B` (out x rank) linears, and with DoRA a `lora_magnitude_vector` (out,). Its class becomes
`LoRALinear`, whose forward adds the adapter:

    LoRA:  y = x W^T + b + s * B(A(dropout(x)))             s = alpha / rank (rsLoRA: alpha / sqrt(rank))
    DoRA:  y = x W^T + b + (m / |W + s B A| - 1) * dropout(x) W^T + (m / |W + s B A|) * s * B(A(dropout(x)))

with |.| the norm of each output row, detached as in the DoRA paper (section 4.3) and PEFT. At
init B = 0 and m = |W|, so the adapted model is the base model. The state-dict keys of the
adapters are PEFT's without its `base_model.model.` prefix and `default` adapter name (e.g.
`layers.0.self_attn.q_proj.lora_A.weight` is PEFT's `base_model.model.model.layers.0.self_attn.
q_proj.lora_A.weight` for the HF key `model.layers.0...`), see `peft_state_dict`.

`modules_to_save` (PEFT's option of that name) trains the input embedding and/or the output head
in full beside the adapters: a base that never saw the chat markers or the task's words cannot
learn them through low-rank updates of its block linears alone (the LoRA demo: loss 3.7 after 50
steps without, 0.85 with the embedding trained).

Adapters are added after tensor parallel (`apply_lora` on DTensor weights: A is replicated and B
follows the base layer's output sharding for a column-parallel layer; A follows its input sharding
for a row-parallel one) and before FSDP, which shards them with their block.
"""

from __future__ import annotations

import contextlib
import hashlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ladle.errors import ConfigError
from ladle.models.nf4 import base_weight, nf4_linear

PEFT_PREFIX = "base_model.model."


class LoRALinear(nn.Linear):
    """An nn.Linear with an adapter (see the module docstring); made by `add_adapter`."""

    r: int
    scaling: float
    use_dora: bool
    adapters_off = False  # set per module by `adapters_disabled`

    def base(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """x W^T (+ b): the frozen layer, its weight in NF4 under QLoRA (ladle/models/nf4.py)."""
        b = self.bias if bias else None
        if hasattr(self, "weight_nf4"):
            return nf4_linear(x, self.weight_nf4, b)
        return F.linear(x, self.weight, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.adapters_off:
            return y
        d = self.lora_dropout(x)
        lora = self.lora_B(self.lora_A(d)) * self.scaling
        if not self.use_dora:
            return y + lora
        scale = (self.lora_magnitude_vector / self.weight_norm().detach()).to(y.dtype)  # (out,)
        base = y - self.bias if self.bias is not None else y
        if not isinstance(self.lora_dropout, nn.Identity):
            base = self.base(d, bias=False)
        return y + (scale - 1) * base + scale * lora

    def delta_weight(self) -> torch.Tensor:
        """s * B A: what merging adds to W (out x in)."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def weight_norm(self) -> torch.Tensor:
        with torch.no_grad():
            w = base_weight(self, torch.float32)
        return (w + self.delta_weight().float()).norm(p=2, dim=1)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        return merged(self)


@torch.no_grad()
def merged(m: LoRALinear, full=lambda t: t) -> torch.Tensor:
    """`m`'s weight with its adapter folded in (what merging writes). `full` gathers each part
    first: `full_tensor` for a whole copy of a sharded layer (an inference engine's)."""
    w = base_weight(m, torch.float32) if hasattr(m, "weight_nf4") else full(m.weight).float()
    w = w + ((full(m.lora_B.weight) @ full(m.lora_A.weight)) * m.scaling).float()
    if m.use_dora:
        w = w * (full(m.lora_magnitude_vector).float() / w.norm(p=2, dim=1))[:, None]
    return w.to(m.lora_A.weight.dtype)


def add_adapter(m: nn.Linear, r: int, alpha: float, dropout: float, rslora: bool, dora: bool) -> None:
    """Turn `m` into a LoRALinear in place (its own weight and bias untouched, frozen)."""
    w = m.weight_nf4.packed if hasattr(m, "weight_nf4") else m.weight
    dev, dt = w.device, (m.weight_nf4.orig_dtype if hasattr(m, "weight_nf4") else w.dtype)
    m.lora_A = nn.Linear(m.in_features, r, bias=False, device=dev, dtype=dt)
    m.lora_B = nn.Linear(r, m.out_features, bias=False, device=dev, dtype=dt)
    m.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
    if dora:
        m.lora_magnitude_vector = nn.Parameter(torch.ones(m.out_features, device=dev, dtype=dt))
    m.r, m.scaling, m.use_dora = r, alpha / (math.sqrt(r) if rslora else r), dora
    m.__class__ = LoRALinear


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The base model for the duration (PEFT's `disable_adapter`): a DPO reference that is the
    policy's own frozen base, no second copy. `modules_to_save` are trained in place, so a model
    with them has no base left to switch to (the DPO recipe builds a frozen copy then)."""
    mods = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in mods:
        m.adapters_off = True
    try:
        yield model
    finally:
        for m in mods:
            del m.adapters_off


def target_names(model: nn.Module, targets: list[str]) -> list[str]:
    """Names of the linear modules whose last name part is in `targets`; every target must match
    something, else a ConfigError that lists the model's linear modules."""
    linears = [
        n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, LoRALinear)
    ]
    kinds = sorted({n.rsplit(".", 1)[-1] for n in linears})
    missing = [t for t in targets if t not in kinds]
    if missing:
        raise ConfigError(
            f"lora.targets: no module named {missing[0]!r} in this model; its linear modules are {', '.join(kinds)}"
        )
    return [n for n in linears if n.rsplit(".", 1)[-1] in targets]


def saved_modules(model: nn.Module, names: list[str]) -> list[nn.Module]:
    """The modules of `lora.modules_to_save` present in `model` (a pipeline stage may hold none).
    With tied embeddings there is no `lm_head` module: the head is `embed_tokens`' matrix."""
    tied = getattr(getattr(model, "cfg", None), "tie_embeddings", False)
    wanted = {"embed_tokens" if (n == "lm_head" and tied) else n for n in names}
    return [getattr(model, n) for n in sorted(wanted) if getattr(model, n, None) is not None]


def apply_lora(model: nn.Module, cfg, seed: int = 0) -> list[str]:
    """Freeze every parameter except those of `cfg.modules_to_save`, add adapters to the targeted
    linears and initialise them (`init_adapters`); returns the adapted module names. cfg: the
    `lora` config section."""
    names = target_names(model, cfg.targets)
    for p in model.parameters():
        p.requires_grad_(False)
    for m in saved_modules(model, cfg.modules_to_save):
        m.requires_grad_(True)
    modules = dict(model.named_modules())
    for n in names:
        m = modules[n]
        add_adapter(m, cfg.rank, cfg.alpha, cfg.dropout, cfg.rslora, cfg.dora)
        _place_like_base(m)
    if not any(p.is_meta for p in model.parameters()):
        init_adapters(model, seed)
    return names


def _place_like_base(m: LoRALinear) -> None:
    """Under tensor parallel the base weight is a DTensor: make the adapters DTensors on its mesh
    (column-parallel, Shard(0) weight: A replicated, B Shard(0); row-parallel, Shard(1): A
    Shard(1), B replicated), so that their matmuls follow the base layer's sharding."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    w = getattr(m, "weight", None)  # None: an NF4 base (one device, see check_layout)
    if not isinstance(w, DTensor):
        return
    col = w.placements == (Shard(0),)
    a, b = ([Replicate()], [Shard(0)]) if col else ([Shard(1)], [Replicate()])
    m.lora_A.weight = nn.Parameter(distribute_tensor(m.lora_A.weight.detach(), w.device_mesh, a))
    m.lora_B.weight = nn.Parameter(distribute_tensor(m.lora_B.weight.detach(), w.device_mesh, b))
    if m.use_dora:
        mv = m.lora_magnitude_vector.detach()
        m.lora_magnitude_vector = nn.Parameter(
            distribute_tensor(mv, w.device_mesh, [Shard(0)] if col else [Replicate()])
        )


@torch.no_grad()
def init_adapters(root: nn.Module, seed: int = 0, prefix: str = "") -> None:
    """PEFT's init: A kaiming-uniform (a = sqrt(5)), B zero, m = |W| per output row. Each
    module's A is drawn from a generator seeded by (seed, its name), so the adapters are the same
    whatever the layout or the order in which parts are initialised. `prefix`: `root`'s name."""
    for sub, m in root.named_modules():
        if not isinstance(m, LoRALinear):
            continue
        name = f"{prefix}.{sub}" if prefix and sub else prefix or sub
        g = torch.Generator().manual_seed(
            int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") >> 1
        )
        a = torch.empty(m.lora_A.weight.shape, dtype=torch.float32)
        bound = 1 / math.sqrt(a.shape[1])  # kaiming_uniform_ with a = sqrt(5)
        a.uniform_(-bound, bound, generator=g)
        _copy(m.lora_A.weight, a)
        _copy(m.lora_B.weight, torch.zeros(m.lora_B.weight.shape))
        if m.use_dora:
            w = base_weight(m, torch.float32) if hasattr(m, "weight_nf4") else full_tensor(m.weight).float()
            _copy(m.lora_magnitude_vector, w.norm(p=2, dim=1))


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective over its mesh); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _copy(param: torch.Tensor, value: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        value = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements)
    param.copy_(value.to(device=param.device, dtype=param.dtype))


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and turn the modules back into plain nn.Linear
    (for export: the result is the base architecture)."""
    from ladle.models.nf4 import NF4Linear

    for m in list(model.modules()):
        if isinstance(m, NF4Linear):  # a quantized layer without adapter: its dequantized weight
            m.weight = nn.Parameter(base_weight(m), requires_grad=False)
            del m.weight_nf4
            m.__class__ = nn.Linear
        elif isinstance(m, LoRALinear):
            w = m.merged_weight()
            if hasattr(m, "weight_nf4"):
                m.weight = nn.Parameter(w, requires_grad=False)
                del m.weight_nf4
            else:
                m.weight.copy_(w)
            for attr in ("lora_A", "lora_B", "lora_dropout", "lora_magnitude_vector"):
                if hasattr(m, attr):
                    delattr(m, attr)
            m.__class__ = nn.Linear
    return model


# -- PEFT's files ---------------------------------------------------------------------------------
def peft_state_dict(model: nn.Module, cfg) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's keys (`base_model.model.` + the Hugging Face module path), and
    the modules trained in full as PEFT saves its modules_to_save (`base_model.model.model.
    embed_tokens.weight`, `base_model.model.lm_head.weight`). With tied embeddings PEFT keeps
    both names for the one matrix (`ensure_weight_tying`, see `peft_config`): both are written."""
    from ladle.models.hf import to_hf_name

    out = {
        PEFT_PREFIX + to_hf_name(n): full_tensor(p.detach()).cpu().contiguous()
        for n, p in model.named_parameters()
        if ".lora_" in n
    }
    tied = model.cfg.tie_embeddings
    for name in peft_saved(cfg, tied):
        w = model.embed_tokens.weight if tied else getattr(model, name).weight
        # a copy of its own: safetensors refuses two keys on one storage (the tied case)
        out[PEFT_PREFIX + to_hf_name(f"{name}.weight")] = full_tensor(w.detach()).cpu().clone()
    return out


def peft_saved(cfg, tied: bool) -> list[str]:
    """PEFT's modules_to_save for these options. Tied embeddings trained in full are both names,
    with `ensure_weight_tying`, so that PEFT's copy of the embedding is the head too, as in ladle."""
    return ["embed_tokens", "lm_head"] if (tied and cfg.modules_to_save) else sorted(cfg.modules_to_save)


def peft_config(cfg, base: str | None, tied: bool = False) -> dict:
    """adapter_config.json as PEFT writes it for a LoraConfig of the same options."""
    saved = peft_saved(cfg, tied)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "use_rslora": cfg.rslora,
        "use_dora": cfg.dora,
        "target_modules": sorted(cfg.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": saved or None,
        "ensure_weight_tying": bool(tied and saved),
        "inference_mode": True,
        "revision": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
