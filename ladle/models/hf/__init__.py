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
No transformers import here: the folder format is plain JSON + safetensors. The parts: families.py
(the family table), config.py (config.json both ways), names.py (the weight-name map), reader.py
(safetensors in), export.py (a folder out).
"""

from ladle.models.hf.config import hf_config, is_hf_folder, model_config_from_hf, read_hf_config
from ladle.models.hf.export import save_hf
from ladle.models.hf.names import hf_layout, to_hf_name
from ladle.models.hf.reader import HFWeights, load_hf, load_hf_weights

__all__ = [
    "HFWeights",
    "hf_config",
    "hf_layout",
    "is_hf_folder",
    "load_hf",
    "load_hf_weights",
    "model_config_from_hf",
    "read_hf_config",
    "save_hf",
    "to_hf_name",
]
