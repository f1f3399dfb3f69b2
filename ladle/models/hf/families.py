"""The Hugging Face architectures ladle reads and writes: each family's name, architecture and
model_type, the features it can express, its MoE module names, and the one-to-one config keys."""

from __future__ import annotations

import torch

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
# one `gate_up_proj`, which ladle splits at load and joins at export (`FUSED`).
GLM = {
    "glm": {"rope_interleaved": True, "post_norms": False},
    "glm4": {"rope_interleaved": True, "post_norms": True},
}


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


DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
