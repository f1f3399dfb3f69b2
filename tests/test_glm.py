"""GLM-4 (`GlmForCausalLM`, glm-4-9b-chat-hf) and GLM-4-0414 (`Glm4ForCausalLM`): tiny random
checkpoints written by transformers load with equal logits and greedy tokens, export loads back
in transformers with equal logits; the fused gate_up_proj is split at load and joined at export."""

import json

import pytest
import torch

from ladle.config.schema import ModelConfig
from ladle.errors import CheckpointError
from ladle.models.hf import hf_config, load_hf, save_hf
from ladle.models.layers import apply_rope
from ladle.models.llama import count_params

TOKENS = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(5))
COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    intermediate_size=48,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=None,
)


def hf_model(family: str):
    import transformers as tf

    cls = {"glm": "Glm", "glm4": "Glm4"}[family]
    config = getattr(tf, f"{cls}Config")(**COMMON, partial_rotary_factor=0.5)
    torch.manual_seed(0)
    model = getattr(tf, f"{cls}ForCausalLM")(config).eval()
    with torch.no_grad():  # norms at one and biases at zero would hide mistakes in them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("family", ["glm", "glm4"])
def test_glm_logits_and_export_equal_transformers(tmp_path, family):
    from transformers import AutoModelForCausalLM

    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    model, cfg = load_hf(tmp_path / "hf")
    assert cfg.family == family and cfg.qkv_bias and cfg.rope_interleaved and cfg.rotary_dim == 6
    assert cfg.post_norms == (family == "glm4")
    assert count_params(cfg) == sum(p.numel() for p in hf.parameters())
    with torch.no_grad():
        ref = hf(TOKENS).logits
        torch.testing.assert_close(model(TOKENS), ref, atol=1e-5, rtol=1e-5)
    save_hf(model.state_dict(), cfg, tmp_path / "out")
    d = json.loads((tmp_path / "out" / "config.json").read_text())
    assert d["architectures"] == [{"glm": "GlmForCausalLM", "glm4": "Glm4ForCausalLM"}[family]]
    from safetensors import safe_open

    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        fused = f.get_tensor("model.layers.0.mlp.gate_up_proj.weight")
    assert "model.layers.0.mlp.gate_proj.weight" not in keys and fused.shape == (96, 32)
    torch.testing.assert_close(fused, hf.state_dict()["model.layers.0.mlp.gate_up_proj.weight"])
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["glm", "glm4"])
def test_glm_greedy_generation_equals_transformers(tmp_path, family):
    from ladle.models.generation import generate

    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    model, _ = load_hf(tmp_path / "hf")
    prompts = [TOKENS[0, :9].tolist(), TOKENS[1, :3].tolist()]
    ours = generate(model.eval(), prompts, max_new_tokens=8)
    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = (torch.arange(P)[None] >= torch.tensor([[P - len(p)] for p in prompts])).long()
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    assert out[:, P:].tolist() == ours


def test_interleaved_partial_rope_against_its_formula():
    # pairs (0, 1), (2, 3) of the first 4 of 6 dimensions rotate by position x frequency; 4, 5 pass
    x = torch.randn(1, 1, 1, 6)
    theta = torch.tensor([0.7, 0.2])
    cos = torch.cos(theta).repeat_interleave(2)[None, None]
    sin = torch.sin(theta).repeat_interleave(2)[None, None]
    y = apply_rope(x, cos, sin, interleaved=True)[0, 0, 0]
    x = x[0, 0, 0]
    for i, t in enumerate(theta):
        a, b = x[2 * i], x[2 * i + 1]
        torch.testing.assert_close(
            y[2 * i : 2 * i + 2], torch.stack([a * t.cos() - b * t.sin(), a * t.sin() + b * t.cos()])
        )
    torch.testing.assert_close(y[4:], x[4:])


def test_glm_layouts_other_families_cannot_express_are_refused():
    cfg = ModelConfig(
        family="llama", vocab_size=97, dim=32, n_layers=1, n_heads=4, ffn_dim=48, post_norms=True
    )
    with pytest.raises(CheckpointError, match="cannot express rope_interleaved=False, post_norms=True"):
        hf_config(cfg)
    cfg = ModelConfig(family="glm", qkv_bias=True, vocab_size=97, dim=32, n_layers=1, n_heads=4, ffn_dim=48)
    with pytest.raises(CheckpointError, match="GLM-4 is family glm"):
        hf_config(cfg)  # GLM without its interleaved rotary
