"""config.json <-> ModelConfig: a family's config written as transformers writes it (RoPE in both
its <5 and 5 forms), and read as transformers reads it (sliding windows, RoPE scaling, MoE and
DeepSeek-V3's latent attention), refusing by name what ladle does not compute."""

from __future__ import annotations

import json
from pathlib import Path

from ladle.config.schema import ModelConfig, RopeScaling
from ladle.errors import CheckpointError
from ladle.models.hf.families import (
    CONFIG_MAP,
    FAMILIES,
    FAMILY_FEATURES,
    FAMILY_OF,
    GLM,
    MLA_KEYS,
    MOE_NAMES,
    SCORE_SUFFIX,
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_ROPE_TYPES,
)


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
    rope_scaling, rope_parameters = _rope_to_hf(cfg)
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
    _moe_to_hf(cfg, d)
    return d


def _rope_to_hf(cfg: ModelConfig) -> tuple[dict | None, dict]:
    """(`rope_scaling`, transformers<5's; `rope_parameters`, transformers 5's)."""
    rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.family in GLM:
        rope_parameters["partial_rotary_factor"] = cfg.partial_rotary_factor
    if cfg.rope_scaling is None:
        return None, rope_parameters
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
    return rope_scaling, {**rope_parameters, **rope_scaling}


def _moe_to_hf(cfg: ModelConfig, d: dict) -> None:
    """The experts' (and DeepSeek-V3's latent attention's) keys of config.json, into `d`."""
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
