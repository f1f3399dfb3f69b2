"""The bundled model definitions: the parameter count equals transformers' for the same config
(built on the meta device), and the published size, so a typo in a shape cannot hide."""

import pytest
import torch

from ladle.config.load import build_config, model_presets
from ladle.errors import ConfigError
from ladle.models.hf import hf_config
from ladle.models.llama import count_params

# Published sizes (total parameters, billions, as the model cards and safetensors indexes give them).
PUBLISHED = {
    "llama-3.2-1b": 1.236,
    "llama-3.2-3b": 3.213,
    "llama-3.1-8b": 8.030,
    "llama-3.1-70b": 70.554,
    "llama-2-70b": 68.977,
    "qwen2.5-0.5b": 0.494,
    "qwen2.5-1.5b": 1.544,
    "qwen2.5-7b": 7.616,
    "qwen3-0.6b": 0.596,
    "qwen3-8b": 8.191,
    "qwen3-32b": 32.762,
    "mistral-7b": 7.248,
    "mixtral-8x7b": 46.703,
    "qwen3-30b-a3b": 30.532,
    "glm-4-9b": 9.400,
    "glm-4-32b-0414": 32.566,
    "deepseek-v3": 671.0,  # the card's 671B: the main model, its multi-token prediction layer aside
    "deepseek-v2-lite-class": 15.7,  # V2-Lite's 15.7B
}
# The cards round these two to a tenth or a whole billion; the count is checked against
# transformers' to the parameter all the same.
PUBLISHED_TOLERANCE = {"deepseek-v3": 0.05, "deepseek-v2-lite-class": 0.01}
# Active parameters per token of the MoE models (billions, to one decimal as their model cards
# give them; Qwen's 3.3 is 3.35 cut off, not rounded).
PUBLISHED_ACTIVE = {
    "mixtral-8x7b": 12.9,
    "qwen3-30b-a3b": 3.3,
    "deepseek-v3": 37.5,
    "deepseek-v2-lite-class": 2.65,
}
# DeepSeek-V3's card says 37B activated (37.55B counted, the input embedding's 0.93B included);
# V2-Lite's says 2.4B, without the embedding (2.66B with it).


def _cfg(preset, **model):
    return build_config(
        {"model": {"preset": preset, **model}, "tokenizer": {"path": "t"}, "data": {"path": "d"}}
    )


def test_every_preset_is_listed():
    assert model_presets() == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_counts_match_transformers_and_the_published_size(name):
    import transformers

    cfg = _cfg(name).model
    d = hf_config(cfg)
    conf = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(conf)
    theirs = sum(p.numel() for p in hf.parameters())  # tied weights are counted once
    assert count_params(cfg) == theirs
    assert theirs / 1e9 == pytest.approx(PUBLISHED[name], abs=PUBLISHED_TOLERANCE.get(name, 0.0015))
    if cfg.moe:  # a token uses top_k of the n_experts experts, and every other weight
        share = cfg.moe.top_k / cfg.moe.n_experts
        active = sum(p.numel() * (share if ".experts." in n else 1) for n, p in hf.named_parameters())
        assert count_params(cfg, active=True) == active
        assert active / 1e9 == pytest.approx(PUBLISHED_ACTIVE[name], abs=0.06)
    else:
        assert count_params(cfg, active=True) == theirs


def test_preset_keys_set_beside_it_win_and_unknown_names_are_refused():
    cfg = _cfg("qwen3-8b", max_seq_len=4096)
    assert cfg.model.max_seq_len == 4096 and cfg.model.dim == 4096 and cfg.model.qk_norm
    moe = _cfg("qwen3-30b-a3b", moe={"z_loss_weight": 0.001}).model.moe  # merged key by key
    assert (moe.z_loss_weight, moe.n_experts, moe.top_k, moe.aux_loss_weight) == (0.001, 128, 8, 0.001)
    with pytest.raises(
        ConfigError,
        match=r"unknown model 'qwen3-9b' \(did you mean 'qwen3-8b'\?\); bundled: deepseek-v2-lite-class, deepseek-v3, glm-4-32b-0414, glm-4-9b, llama",
    ):
        _cfg("qwen3-9b")
