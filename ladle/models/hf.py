"""Hugging Face checkpoints in and out: config.json <-> ModelConfig, safetensors <-> our state_dict.

Dense families: `LlamaForCausalLM`, `Qwen2ForCausalLM` (q/k/v bias), `Qwen3ForCausalLM` (QK-norm,
free head_dim), `MistralForCausalLM`, each with or without a sliding window, `GlmForCausalLM` and
`Glm4ForCausalLM` (GLM-4: partial interleaved RoPE, q/k/v bias, a fused gate_up_proj split at
load and joined at export; 0414's post-norms); mixtures of experts:
`MixtralForCausalLM`, `Qwen3MoeForCausalLM` (QK-norm) and `DeepseekV3ForCausalLM` (latent
attention, shared experts, the router's correction bias `mlp.gate.e_score_correction_bias`). They share module names, so the name
map is a prefix (our modules mirror HF's `LlamaModel`): `model.` + our key, except the head
`lm_head.weight`, which is absent when embeddings are tied, and the experts: HF checkpoints hold
one tensor per expert (`model.layers.0.block_sparse_moe.experts.3.w1.weight` in Mixtral,
`model.layers.0.mlp.experts.3.gate_proj.weight` in Qwen3-MoE), ladle one stacked parameter per
kind (`layers.0.mlp.experts.gate_proj`, expert 3 its slice [3]). `hf_layout` is that map.
A reward model (`model.head: score`) is the family's `...ForSequenceClassification` with
`num_labels` 1: the same decoder and a top-level `score.weight` instead of `lm_head.weight`; a
causal LM's folder read into it leaves the score head to its own init (`HFWeights.holds`).
No transformers import here: the folder format is plain JSON + safetensors.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

from ladle.config.schema import ModelConfig, RopeScaling
from ladle.errors import CheckpointError
from ladle.models.llama import Llama

# What each architecture expresses, as (qkv_bias, qk_norm): Qwen2 always has q/k/v biases and no
# QK-norm, Qwen3 always QK-norm (published without biases), Llama and Mistral neither (Llama's
# attention_bias would also put a bias on o_proj).
FAMILY_FEATURES = {
    "llama": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
    "mistral": (False, False),
    "glm": (True, False),
    "glm4": (True, False),
    "mixtral": (False, False),
    "qwen3_moe": (False, True),
    "deepseek_v3": (False, False),
}
# GLM-4's own layout: RoPE on adjacent pairs (of the first partial_rotary_factor of each head),
# and in GLM-4-0414 (`glm4`) a norm after attention and after the MLP; HF fuses gate and up into
# one `gate_up_proj`, which ladle splits at load and joins at export (`_FUSED`).
GLM = {
    "glm": {"rope_interleaved": True, "post_norms": False},
    "glm4": {"rope_interleaved": True, "post_norms": True},
}
_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.gate_up_proj\.weight)\[(\d*):(\d*)\]")
# family -> (architecture, model_type)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "glm": ("GlmForCausalLM", "glm"),
    "glm4": ("Glm4ForCausalLM", "glm4"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "deepseek_v3"),
}
# MoE families: the HF module holding router and experts, and its per-expert names for our
# (gate_proj, up_proj, down_proj).
MOE_NAMES = {
    "mixtral": ("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}),
    "qwen3_moe": ("mlp", {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}),
    "deepseek_v3": ("mlp", {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}),
}
# DeepSeek-V3's config.json keys for model.mla and model.moe
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
SCORE_SUFFIX = "ForSequenceClassification"  # a reward model: the decoder and a scalar `score` head
SUPPORTED_ARCHITECTURES = tuple(arch for arch, _ in FAMILIES.values())
FAMILY_OF = (
    {arch: fam for fam, (arch, _) in FAMILIES.items()}
    | {arch.replace("ForCausalLM", SCORE_SUFFIX): fam for fam, (arch, _) in FAMILIES.items()}
    | {mt: fam for fam, (_, mt) in FAMILIES.items()}
)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# ModelConfig field -> HF config key, for the fields that map one to one.
CONFIG_MAP = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "ffn_dim": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "init_std": "initializer_range",
}

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def to_hf_name(name: str) -> str:
    return name if name.startswith(("lm_head.", "score.")) else "model." + name


_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.(gate\.weight|experts\.(gate_proj|up_proj|down_proj))")


def hf_layout(cfg: ModelConfig) -> dict[str, tuple[str, int | None, tuple]]:
    """Every tensor of the family's HF checkpoint, in our module order: HF key -> (our state_dict
    key, expert index or None for the whole tensor, shape)."""
    with torch.device("meta"):
        ours = Llama(cfg).state_dict()
    layout = {}
    for name, t in ours.items():
        if cfg.family in GLM and name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            F = t.shape[0]  # HF's gate_up_proj holds gate's rows, then up's
            rows = f"[:{F}]" if ".gate_proj." in name else f"[{F}:]"
            layout[to_hf_name(name.rsplit(".", 2)[0]) + ".gate_up_proj.weight" + rows] = (
                name,
                None,
                tuple(t.shape),
            )
            continue
        m = _EXPERTS.fullmatch(name) if cfg.moe else None
        if m is None:
            layout[to_hf_name(name)] = (name, None, tuple(t.shape))
            continue
        block, names = MOE_NAMES[cfg.family]
        prefix = f"model.layers.{m[1]}.{block}"
        if m[3] is None:  # the router
            layout[f"{prefix}.gate.weight"] = (name, None, tuple(t.shape))
        else:
            for e in range(t.shape[0]):
                layout[f"{prefix}.experts.{e}.{names[m[3]]}.weight"] = (name, e, tuple(t.shape[1:]))
    return layout


# --- config ---------------------------------------------------------------------------------------


def hf_config(
    cfg: ModelConfig, *, bos_id=None, eos_id=None, pad_id=None, torch_dtype: str = "float32"
) -> dict:
    """config.json contents for the family's architecture (`model.family`). RoPE is written in both
    the transformers<5 form (`rope_theta`, `rope_scaling`) and the transformers 5 form
    (`rope_parameters`)."""
    arch, model_type = FAMILIES[cfg.family]
    if cfg.head == "score":
        arch = arch.replace("ForCausalLM", SCORE_SUFFIX)
    if (cfg.qkv_bias, cfg.qk_norm) != FAMILY_FEATURES[cfg.family]:
        raise CheckpointError(
            f"model.family={cfg.family} ({arch}) cannot express qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm}; "
            "set model.family to qwen2 for q/k/v biases, qwen3 for QK-norm, llama or mistral for neither"
        )
    glm = GLM.get(cfg.family, {"rope_interleaved": False, "post_norms": False})
    if cfg.family == "deepseek_v3":  # DeepSeek's rope_interleave is a config switch
        glm = {"post_norms": False}
    if any(getattr(cfg, k) != v for k, v in glm.items()) or (
        cfg.family not in GLM and cfg.partial_rotary_factor != 1
    ):
        raise CheckpointError(
            f"model.family={cfg.family} ({arch}) cannot express rope_interleaved={cfg.rope_interleaved}, "
            f"post_norms={cfg.post_norms}, partial_rotary_factor={cfg.partial_rotary_factor}; GLM-4 is family glm "
            "(interleaved, partial rotary), GLM-4-0414 family glm4 (also post_norms)"
        )
    rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.family in GLM:
        rope_parameters["partial_rotary_factor"] = cfg.partial_rotary_factor
    rope_scaling = None
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope_scaling = {
            "rope_type": s.type,
            "factor": s.factor,
            "original_max_position_embeddings": s.original_max_seq_len,
        }
        if s.type == "llama3":
            rope_scaling.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
        else:
            rope_scaling.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate)
            for k in ("mscale", "mscale_all_dim", "attention_factor"):
                if getattr(s, k) is not None:
                    rope_scaling[k] = getattr(s, k)
        rope_parameters = {**rope_parameters, **rope_scaling}
    d = {"architectures": [arch], "model_type": model_type}
    d.update({hf: getattr(cfg, ours) for ours, hf in CONFIG_MAP.items()})
    d.update(
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_size,
        hidden_act="silu",
        attention_dropout=0.0,
        rope_theta=cfg.rope_theta,
        rope_scaling=rope_scaling,
        rope_parameters=rope_parameters,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_cache=True,
        torch_dtype=torch_dtype,
        dtype=torch_dtype,
    )
    if cfg.head == "score":  # transformers scores the last token that is not pad_token_id
        d.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    if cfg.family in ("llama", "qwen3"):
        d["attention_bias"] = False
    if cfg.family in GLM:
        d.update(attention_bias=True, partial_rotary_factor=cfg.partial_rotary_factor)
    if cfg.family == "llama":
        d.update(mlp_bias=False, pretraining_tp=1)
    window = cfg.sliding_window
    if cfg.family in ("qwen2", "qwen3", "qwen3_moe"):
        d.update(
            use_sliding_window=window is not None,
            sliding_window=window,
            max_window_layers=cfg.max_window_layers if window is not None else cfg.n_layers,
        )
    if cfg.family in ("mistral", "mixtral"):
        if cfg.max_window_layers:
            raise CheckpointError(
                f"model.family={cfg.family} has its sliding window in every layer; "
                f"model.max_window_layers={cfg.max_window_layers} exports as family qwen2 only"
            )
        d["sliding_window"] = window
    m = cfg.moe
    if cfg.family == "mixtral":
        if not m.norm_topk_prob:
            raise CheckpointError(
                "model.family=mixtral always renormalises the top-k router weights; set "
                "model.moe.norm_topk_prob: true, or model.family: qwen3_moe"
            )
        d.update(
            num_local_experts=m.n_experts,
            intermediate_size=m.ffn_dim,
            router_jitter_noise=0.0,
        )
    if cfg.family == "qwen3_moe":
        d.update(
            attention_bias=False,
            num_experts=m.n_experts,
            moe_intermediate_size=m.ffn_dim,
            norm_topk_prob=m.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if cfg.family == "deepseek_v3":
        a = cfg.mla
        d.update({k: getattr(a, k) for k in MLA_KEYS})
        d.update(
            head_dim=a.qk_rope_head_dim,
            qk_head_dim=a.qk_nope_head_dim + a.qk_rope_head_dim,
            num_key_value_heads=cfg.n_heads,
            rope_interleave=cfg.rope_interleaved,
            attention_bias=False,
            n_routed_experts=m.n_experts,
            moe_intermediate_size=m.ffn_dim,
            n_shared_experts=m.n_shared_experts,
            n_group=m.n_group,
            topk_group=m.topk_group,
            routed_scaling_factor=m.routed_scaling_factor,
            norm_topk_prob=m.norm_topk_prob,
            first_k_dense_replace=m.dense_layers,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            num_nextn_predict_layers=0,
        )
    elif m is not None and (m.scoring != "softmax" or m.n_shared_experts or m.dense_layers):
        raise CheckpointError(
            f"model.family={cfg.family} cannot express moe.scoring={m.scoring}, n_shared_experts="
            f"{m.n_shared_experts}, dense_layers={m.dense_layers}; those are family deepseek_v3's"
        )
    if m is not None:
        d.update(
            num_experts_per_tok=m.top_k, router_aux_loss_coef=m.aux_loss_weight, output_router_logits=False
        )
    return d


def _window_from_hf(d: dict, family: str, path) -> dict:
    """model.sliding_window / max_window_layers from a config.json, as transformers reads it:
    Mistral and Mixtral window every layer when `sliding_window` is set; the Qwen families only
    with `use_sliding_window`, from layer `max_window_layers` on (or as `layer_types` says)."""
    window = d.get("sliding_window")
    n = d.get("num_hidden_layers", 0)
    if family in ("mistral", "mixtral"):
        return {"sliding_window": window, "max_window_layers": 0} if window is not None else {}
    if family not in ("qwen2", "qwen3", "qwen3_moe") or not d.get("use_sliding_window") or window is None:
        if "layer_types" in d and any(t != "full_attention" for t in d["layer_types"] or []):
            raise CheckpointError(
                f"{path}: layer_types {d['layer_types']} asks for attention ladle does not compute"
            )
        return {}
    first = d.get("max_window_layers", 0)
    types = d.get("layer_types")
    if types:  # explicit per-layer kinds: ladle computes a full prefix, then windows
        windowed = [i for i, t in enumerate(types) if t == "sliding_attention"]
        first = windowed[0] if windowed else n
        if windowed != list(range(first, n)) or any(
            t not in ("sliding_attention", "full_attention") for t in types
        ):
            raise CheckpointError(
                f"{path}: layer_types {types} is not full attention up to one layer and sliding windows "
                "after it, the pattern ladle computes (model.max_window_layers)"
            )
    if first >= n:
        return {}  # no layer is windowed
    return {"sliding_window": window, "max_window_layers": first}


def model_config_from_hf(d: dict, path) -> ModelConfig:
    """ModelConfig from a config.json dict of a supported architecture; `path` names the file in
    errors. Anything ladle's model would not compute exactly is refused, never approximated."""
    archs = d.get("architectures") or [d.get("model_type")]
    families = [FAMILY_OF[a] for a in archs if a in FAMILY_OF]
    if not families:
        # A folder's own modelling code (auto_map, transformers' trust_remote_code) is never
        # imported: ladle computes only the architectures it implements.
        remote = (
            f" Its auto_map names remote code ({', '.join(sorted(d['auto_map']))}), which ladle never imports."
            if isinstance(d.get("auto_map"), dict) and d["auto_map"]
            else ""
        )
        raise CheckpointError(
            f"{path}: architecture {archs} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}."
            + remote
        )
    family = families[0]
    if d.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {d['hidden_act']!r} is not supported, only 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key) and not (family in GLM and key == "attention_bias"):
            raise CheckpointError(
                f"{path}: {key}: true is not supported ({FAMILIES[family][0]} in ladle has no such biases)"
            )
    if family in GLM and d.get("attention_bias") is False:
        raise CheckpointError(
            f"{path}: attention_bias: false is not supported for GLM (its q/k/v have biases)"
        )
    window_fields = _window_from_hf(d, family, path)
    missing = [hf for hf in CONFIG_MAP.values() if hf not in d and hf != "initializer_range"]
    if missing:
        raise CheckpointError(f"{path}: missing keys {missing}")

    # transformers 5 nests RoPE in `rope_parameters`; older configs use `rope_theta` + `rope_scaling`.
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{path}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    rope_scaling = _rope_scaling_from_hf(rope, rope_type, d, path)

    fields = {ours: d[hf] for ours, hf in CONFIG_MAP.items() if hf in d}
    fields.update(window_fields)
    if family == "deepseek_v3":
        fields.update(_deepseek_from_hf(d, path))
    if family in GLM:
        fields.update(GLM[family])
        fields["partial_rotary_factor"] = rope.get(
            "partial_rotary_factor", d.get("partial_rotary_factor", 0.5)
        )
    elif rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError(f"{path}: partial_rotary_factor is supported for GLM only")
    if family in MOE_NAMES:
        fields["moe"] = _moe_from_hf(d, family, path)
    n_heads, dim = d["num_attention_heads"], d["hidden_size"]
    kv = d.get("num_key_value_heads") or n_heads
    head_dim = d.get("head_dim") or dim // n_heads
    if family == "deepseek_v3":  # MLA: its head sizes are model.mla's; head_dim there is the rope part
        kv, head_dim = n_heads, dim // n_heads
    try:
        return ModelConfig(
            **fields,
            n_kv_heads=None if kv == n_heads else kv,
            head_dim=None if head_dim * n_heads == dim else head_dim,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            family=family,
            qkv_bias=FAMILY_FEATURES[family][0],
            qk_norm=FAMILY_FEATURES[family][1],
            head="score" if any(a.endswith(SCORE_SUFFIX) for a in archs) else "lm",
        )
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        raise CheckpointError(f"{path}: config does not describe a valid model: {e}") from e


def _rope_scaling_from_hf(rope: dict, rope_type: str, d: dict, path) -> RopeScaling | None:
    """model.rope_scaling from a config's RoPE entries (llama3 or yarn; None for default). A
    missing, mistyped or out-of-range entry is a CheckpointError naming them."""
    if rope_type not in ("llama3", "yarn"):
        return None
    original = rope.get("original_max_position_embeddings", d.get("max_position_embeddings"))
    try:
        if rope_type == "llama3":
            return RopeScaling(
                factor=rope["factor"],
                low_freq_factor=rope["low_freq_factor"],
                high_freq_factor=rope["high_freq_factor"],
                original_max_seq_len=original,
            )
        yarn = {
            k: rope[k]
            for k in ("mscale", "mscale_all_dim", "attention_factor", "truncate")
            if rope.get(k) is not None
        }
        # DeepSeek-V3 may leave the factor out: the ratio of the two contexts (as transformers)
        factor = rope.get("factor")
        if factor is None:
            factor = d["max_position_embeddings"] / original
        return RopeScaling(
            type="yarn",
            factor=factor,
            original_max_seq_len=original,
            beta_fast=rope.get("beta_fast") or 32.0,
            beta_slow=rope.get("beta_slow") or 1.0,
            **yarn,
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:  # pydantic's errors are ValueErrors
        raise CheckpointError(
            f"{path}: rope type {rope_type!r}: {rope} is not a valid RoPE scaling ({e!r})"
        ) from e


def _deepseek_from_hf(d: dict, path) -> dict:
    """model.mla and rope layout of a DeepSeek-V3 config.json; what ladle does not compute is refused."""
    if d.get("topk_method", "noaux_tc") != "noaux_tc" or d.get("scoring_func", "sigmoid") != "sigmoid":
        raise CheckpointError(
            f"{path}: topk_method {d.get('topk_method')!r} / scoring_func {d.get('scoring_func')!r} are not "
            "supported; supported: noaux_tc with sigmoid scores (DeepSeek-V3's)"
        )
    missing = [k for k in MLA_KEYS if k not in d]
    if missing:
        raise CheckpointError(f"{path}: multi-head latent attention needs {missing}")
    return {"mla": {k: d[k] for k in MLA_KEYS}, "rope_interleaved": bool(d.get("rope_interleave", True))}


def _moe_from_hf(d: dict, family: str, path) -> dict:
    """The moe section of a Mixtral or Qwen3-MoE config.json; options ladle's MoE does not compute
    (router jitter, dense layers between sparse ones) are refused."""
    if family == "mixtral":
        if d.get("router_jitter_noise", 0.0):
            raise CheckpointError(
                f"{path}: router_jitter_noise {d['router_jitter_noise']} is not supported; supported: 0.0"
            )
        n, ffn, norm = d.get("num_local_experts"), d.get("intermediate_size"), True
    elif family == "deepseek_v3":
        n, ffn, norm = (
            d.get("n_routed_experts"),
            d.get("moe_intermediate_size"),
            bool(d.get("norm_topk_prob", True)),
        )
        extra = {
            "scoring": "sigmoid",
            "n_group": d.get("n_group") or 1,
            "topk_group": d.get("topk_group") or 1,
            "routed_scaling_factor": d.get("routed_scaling_factor", 1.0),
            "n_shared_experts": d.get("n_shared_experts") or 0,
            "dense_layers": d.get("first_k_dense_replace", 0),
        }
    else:
        if d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1:
            raise CheckpointError(
                f"{path}: dense layers between MoE layers (mlp_only_layers={d.get('mlp_only_layers')}, "
                f"decoder_sparse_step={d.get('decoder_sparse_step')}) are not supported; "
                "supported: every layer sparse (mlp_only_layers [], decoder_sparse_step 1)"
            )
        n = d.get("num_experts", d.get("num_local_experts"))
        ffn, norm = d.get("moe_intermediate_size"), bool(d.get("norm_topk_prob", False))
    if n is None or ffn is None or "num_experts_per_tok" not in d:
        raise CheckpointError(
            f"{path}: an MoE config needs the number of experts, their size and num_experts_per_tok"
        )
    return {
        "n_experts": n,
        "top_k": d["num_experts_per_tok"],
        "ffn_dim": ffn,
        "norm_topk_prob": norm,
        "aux_loss_weight": d.get("router_aux_loss_coef", 0.001),
        **(extra if family == "deepseek_v3" else {}),
    }


# --- save ------------------------------------------------------------------------------------------


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int, dtype) -> list[list[str]]:
    """Group names, in order, into shards of at most max_bytes (a bigger tensor gets a shard alone)."""
    shards, size = [[]], 0
    for name, t in tensors.items():
        nbytes = t.numel() * (dtype or t.dtype).itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def save_hf(
    state_dict: dict[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir,
    *,
    tokenizer_dir=None,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
    bos_id=None,
    eos_id=None,
    pad_id=None,
    overwrite: bool = False,
) -> Path:
    """Write a Hugging Face folder of the family's architecture that
    `transformers.AutoModelForCausalLM.from_pretrained` loads.

    state_dict uses our names (`Llama.state_dict()`); dtype=None keeps each tensor's dtype. Everything is
    written to a temp folder beside out_dir and renamed at the end, so a failure leaves nothing behind.
    An existing non-empty out_dir is an error unless overwrite=True.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise CheckpointError(f"{out_dir} already exists and is not empty; remove it or pick another folder")
    tok_files = []
    if tokenizer_dir is not None:
        tok_files = [Path(tokenizer_dir) / f for f in TOKENIZER_FILES if (Path(tokenizer_dir) / f).is_file()]
        if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
            raise CheckpointError(f"{tokenizer_dir}: no tokenizer.json to copy into the export")

    # Check names and shapes against the model the config describes before writing anything.
    with torch.device("meta"):
        expected = {k: tuple(t.shape) for k, t in Llama(cfg).state_dict().items()}
    sd = {k: v for k, v in state_dict.items() if not (cfg.tie_embeddings and k == "lm_head.weight")}
    _check_names_shapes({k: tuple(v.shape) for k, v in sd.items()}, expected, "state_dict")
    tensors = {  # HF names, our module order; experts one tensor each
        hf: sd[ours] if e is None else sd[ours][e] for hf, (ours, e, _) in hf_layout(cfg).items()
    }
    tensors = _join_fused(tensors)

    out_dtype = dtype or next(iter(tensors.values())).dtype
    config = hf_config(
        cfg, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, torch_dtype=_DTYPE_NAMES.get(out_dtype, "float32")
    )
    generation = {k: v for k, v in (("bos_token_id", bos_id), ("eos_token_id", eos_id)) if v is not None}
    if pad_id is not None:
        generation["pad_token_id"] = pad_id

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    file_mode = tmp.stat().st_mode & 0o666  # what the umask gives a new file
    try:
        shards = _shards(tensors, max_shard_bytes, dtype)
        weight_map, total = {}, 0
        for i, names in enumerate(shards):
            fname = SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            # Convert one shard at a time so peak CPU memory is about one shard, not the whole model.
            part = {n: tensors[n].detach().to("cpu", dtype or tensors[n].dtype).contiguous() for n in names}
            save_file(part, tmp / fname, metadata={"format": "pt"})
            os.chmod(tmp / fname, file_mode)  # safetensors creates 0600; share like the other files
            total += sum(t.numel() * t.element_size() for t in part.values())
            weight_map.update(dict.fromkeys(names, fname))
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        for f in tok_files:
            shutil.copy2(f, tmp / f.name)
        if tok_files and not (tmp / "tokenizer_config.json").exists():
            # Without it AutoTokenizer would pick LlamaTokenizerFast, which adds its own special tokens.
            tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len}
            (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
        if out_dir.exists():  # empty, or overwrite=True: swap, then drop the old one
            old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# --- load ------------------------------------------------------------------------------------------


def _check_names_shapes(
    found: dict[str, tuple], expected: dict[str, tuple], source: str, files: dict | None = None
) -> None:
    """CheckpointError listing missing, unexpected and mis-shaped tensors in `source` (name ->
    shape); `files` (name -> path) adds the file each unexpected or mis-shaped tensor came from."""

    def at(k):
        return f" in {Path(files[k]).name}" if files else ""

    missing = [k for k in expected if k not in found]
    unexpected = [k + at(k) for k in found if k not in expected]
    misshaped = [
        f"{k} {list(found[k])}{at(k)} (config expects {list(expected[k])})"
        for k in found
        if k in expected and tuple(found[k]) != tuple(expected[k])
    ]

    def fmt(names):
        return ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")

    problems = []
    if missing:
        problems.append(f"missing tensors: {fmt(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {fmt(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped tensors: {fmt(misshaped)}")
    if problems:
        raise CheckpointError(
            f"{source} does not match the model config: " + "; ".join(problems) + ". "
            "Check that config.json belongs to these weights."
        )


def _weight_files(folder: Path) -> list[Path]:
    if (folder / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{folder / INDEX_FILE}: not a valid safetensors index ({e})") from e
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{folder / INDEX_FILE} lists shards that are not in {folder}: {absent}")
        return files
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    hint = (
        " (pytorch_model.bin is not supported: re-save with safe_serialization)"
        if any(folder.glob("pytorch_model*.bin"))
        else ""
    )
    raise CheckpointError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} with the weights{hint}")


def is_hf_folder(path) -> bool:
    return (Path(path) / "config.json").is_file()


def read_hf_config(path) -> ModelConfig:
    """ModelConfig of a Hugging Face model folder's config.json."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder; expected a Hugging Face model folder")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{folder}: no config.json; expected a Hugging Face model folder")
    try:
        d = json.loads(config_file.read_text())
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e})") from e
    return model_config_from_hf(d, config_file)


def load_hf(path, *, device="cpu", dtype: torch.dtype = torch.float32) -> tuple[Llama, ModelConfig]:
    """Load a Hugging Face folder of a supported architecture into our Llama on `device` in `dtype`.

    Tensors are read one at a time with plain file reads straight into the materialised model, so
    peak memory is the model plus one tensor (see load_hf_weights). Tied checkpoints that still
    carry lm_head.weight are accepted (the copy is ignored, as transformers does).
    """
    cfg = read_hf_config(path)
    with torch.device("meta"):
        model = Llama(cfg)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    model.init_buffers()
    load_hf_weights(model, path)
    return model, cfg


def load_hf_weights(model: Llama, path) -> list[str]:
    """Fill `model` (its own device and dtype) from the safetensors of a Hugging Face folder, tensor
    by tensor; every missing, unexpected or mis-shaped tensor is reported by name first. Returns
    the names left as they were: a score head the folder (a causal LM's) does not hold."""
    weights = HFWeights(path, model.cfg)
    params = model.state_dict()
    weights.read_into(params)
    return [n for n in params if n not in weights.held]


def _join_fused(tensors: dict) -> dict:
    """GLM's gate_up_proj from the row ranges `hf_layout` names (gate's rows, then up's)."""
    out = {}
    for name, t in tensors.items():
        m = _FUSED.fullmatch(name)
        if m is None:
            out[name] = t
        elif m[2] == "":  # the first part: join it with the second, which follows it in the layout
            out[m[1]] = t
        else:
            out[m[1]] = torch.cat([out[m[1]], t])
    return out


def _split_fused(header: dict) -> dict:
    """A GLM header's gate_up_proj entries as two entries for the row ranges `hf_layout` names,
    each a byte range of the fused tensor (rows are contiguous), so reads stay plain reads."""
    out = {}
    for name, info in header.items():
        if not name.endswith("mlp.gate_up_proj.weight") or len(info.get("shape", ())) != 2:
            out[name] = info
            continue
        rows, cols = info["shape"]
        start, end = info["data_offsets"]
        mid = start + (end - start) // 2
        half = rows // 2
        out[f"{name}[:{half}]"] = {**info, "shape": [half, cols], "data_offsets": [start, mid]}
        out[f"{name}[{half}:]"] = {**info, "shape": [rows - half, cols], "data_offsets": [mid, end]}
    return out


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _mtp_layers(folder: Path, cfg: ModelConfig) -> range:
    """DeepSeek-V3's multi-token prediction layers (`num_nextn_predict_layers`, stored as the
    blocks after the last one: model.layers.61.* in V3), which ladle does not train yet: their
    block indices. Their tensors are left unread with a warning, as transformers leaves them; the
    model is the main one. Any other extra tensor is still refused by name."""
    n = 0
    if cfg.family == "deepseek_v3":
        try:
            n = int(json.loads((folder / "config.json").read_text()).get("num_nextn_predict_layers") or 0)
        except (OSError, ValueError, TypeError):
            n = 0
    return range(cfg.n_layers, cfg.n_layers + max(n, 0))


class HFWeights:
    """The safetensors of a Hugging Face folder, checked against a model config once (headers
    only: every missing, unexpected or mis-shaped tensor is reported by HF name before anything is
    read), then read into any subset of our parameters: all of them (`load_hf_weights`), or one
    block at a time into full tensors that a sharded model takes its shards from."""

    def __init__(self, path, cfg: ModelConfig):
        folder = Path(path)
        self.files = _weight_files(folder)
        self.layout = hf_layout(cfg)
        self.headers = {f: _read_header(f) for f in self.files}
        if cfg.family in GLM:
            self.headers = {f: (start, _split_fused(h)) for f, (start, h) in self.headers.items()}
        found, self.where = {}, {}
        # A reward model started from a causal LM: its head is not in the files (it starts from
        # the seeded init, `holds`), and the LM head in them is not read.
        skip = "lm_head.weight" if cfg.tie_embeddings or cfg.head == "score" else None
        mtp, unread = _mtp_layers(folder, cfg), []
        for f, (_, header) in self.headers.items():
            for hf_key, info in header.items():
                layer = _LAYER.match(hf_key)
                if layer and int(layer[1]) in mtp:
                    unread.append(hf_key)
                elif hf_key != skip:
                    found[hf_key] = tuple(info["shape"])
                    self.where[hf_key] = f
        if unread:
            warnings.warn(
                f"{folder}: the multi-token prediction layer ({len(unread)} tensors, "
                f"model.layers.{mtp.start}.* on) is not loaded: ladle trains the main model only, as "
                "transformers loads it",
                stacklevel=2,
            )
        expected = {k: shape for k, (_, _, shape) in self.layout.items()}
        if cfg.head == "score" and "score.weight" not in found:
            del expected["score.weight"]
        _check_names_shapes(found, expected, str(folder), self.where)
        self.held = {ours for hf, (ours, _, _) in self.layout.items() if hf in self.where}

    def holds(self, names) -> bool:
        """Whether the files hold every one of these tensors (our names)."""
        return all(n in self.held for n in names)

    def read_into(self, params: dict[str, torch.Tensor]) -> None:
        """Read the tensors of `params` (our names; CPU or accelerator tensors) from the files.

        Plain positional reads (os.preadv) straight into each tensor when the dtype matches (else
        through one temporary per tensor, cast by copy_). No mmap, so the file's pages never count
        as this process's memory: peak RSS is the model plus a few tensors. Most of the time is
        first-touching freshly allocated memory, which the kernel does in parallel, so the reads
        run on a few threads in chunks of READ_CHUNK bytes."""
        jobs = []
        fds = {f: os.open(f, os.O_RDONLY) for f in self.files}
        try:
            for f, (data_start, header) in self.headers.items():
                for hf_key, info in header.items():
                    ours, e, _ = self.layout.get(hf_key, (None, None, None))
                    if self.where.get(hf_key) == f and ours in params:
                        dst = params[ours] if e is None else params[ours][e]
                        jobs += _read_jobs(fds[f], f, data_start, info, dst)
            with torch.no_grad(), ThreadPoolExecutor(min(READ_THREADS, os.cpu_count() or 1)) as pool:
                for _ in pool.map(lambda job: job(), jobs):
                    pass
        finally:
            for fd in fds.values():
                os.close(fd)


READ_THREADS = 4
READ_CHUNK = 64 << 20


def _read_header(f: Path) -> tuple[int, dict]:
    """(offset of the data, {name: {dtype, shape, data_offsets}}) of a safetensors file, checked
    against the file's size so a truncated or corrupt file is named before anything is read."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError(f"header of {n} bytes in a file of {size}")
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        for name, info in header.items():
            if info.get("dtype") not in _ST_DTYPES:
                raise CheckpointError(
                    f"{f}: tensor {name} has dtype {info.get('dtype')!r}, which ladle does not load; "
                    f"supported: {', '.join(_ST_DTYPES)}"
                )
            start, end = info["data_offsets"]
            nbytes = math.prod(info["shape"]) * _ST_DTYPES[info["dtype"]].itemsize
            if end - start != nbytes or 8 + n + end > size:
                raise ValueError(f"tensor {name} lies outside the file or disagrees with its shape")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{f}: cannot read safetensors file ({e}); it is truncated or corrupt: re-export or re-download it"
        ) from e
    return 8 + n, header


_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _read_jobs(fd: int, f: Path, data_start: int, info: dict, dst: torch.Tensor) -> list:
    """Callables that read one safetensors entry (little-endian, as this machine) into `dst`:
    READ_CHUNK-sized pieces straight into it when it is a contiguous CPU tensor of the file's
    dtype, else one read into a temporary and a cast copy."""
    dtype = _ST_DTYPES[info["dtype"]]
    start, end = (data_start + o for o in info["data_offsets"])  # sizes checked by _read_header

    def read(view: memoryview, offset: int) -> None:
        try:
            n = os.preadv(fd, [view], offset)
        except OSError as e:
            raise CheckpointError(f"{f}: cannot read tensor data ({e}): re-export or re-download it") from e
        if n != len(view):
            raise CheckpointError(
                f"{f}: the file ends inside a tensor; it is truncated or corrupt: re-export or re-download it"
            )

    if dst.device.type == "cpu" and dst.dtype == dtype and dst.is_contiguous():
        raw = memoryview(dst.view(-1).view(torch.uint8).numpy())
        return [
            lambda o=o: read(raw[o : o + READ_CHUNK], start + o) for o in range(0, end - start, READ_CHUNK)
        ]

    def convert() -> None:
        tmp = torch.empty(info["shape"], dtype=dtype)
        read(memoryview(tmp.view(-1).view(torch.uint8).numpy()), start)
        dst.copy_(tmp)

    return [convert]
