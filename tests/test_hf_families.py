"""Each Hugging Face family (dense and MoE) in and out: a random tiny checkpoint written by transformers
loads into ladle with the same logits and loss, and ladle's export loads back in transformers
with the same logits. fp32 tolerance: 1e-5 absolute and relative on logits."""

import json

import pytest
import torch

from ladle.errors import CheckpointError
from ladle.models.hf import load_hf, model_config_from_hf, save_hf

TOKENS = torch.tensor([[5, 17, 3, 88, 41, 2, 60, 7], [1, 9, 9, 30, 72, 11, 4, 0]])
COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
)


def _hf_model(family: str, tied: bool):
    import transformers as tf

    extra = {
        "llama": {},
        "qwen2": {"use_sliding_window": False},
        "qwen3": {
            "head_dim": 12,
            "attention_bias": False,
            "use_sliding_window": False,
        },  # head_dim != dim/heads
        "mistral": {"sliding_window": None, "head_dim": 8},
        "mixtral": {"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2},
        "qwen3_moe": {
            "head_dim": 12,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "norm_topk_prob": True,
            "use_sliding_window": False,
        },
    }[family]
    cls = {
        "llama": "Llama",
        "qwen2": "Qwen2",
        "qwen3": "Qwen3",
        "mistral": "Mistral",
        "mixtral": "Mixtral",
        "qwen3_moe": "Qwen3Moe",
    }[family]
    config = getattr(tf, f"{cls}Config")(**COMMON, **extra, tie_word_embeddings=tied, rope_theta=10000.0)
    torch.manual_seed(0)
    model = getattr(tf, f"{cls}ForCausalLM")(config).eval()
    with torch.no_grad():  # biases start at zero and norm weights at one: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("gate.weight"):  # the MoE router (Qwen3-MoE's starts at zero)
                p.normal_(0.0, 0.5)
    return model


def _logits(hf_folder_or_model):
    from transformers import AutoModelForCausalLM

    m = hf_folder_or_model
    if not isinstance(m, torch.nn.Module):
        m = AutoModelForCausalLM.from_pretrained(m, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        return m(TOKENS).logits, m(TOKENS, labels=TOKENS).loss


@pytest.mark.parametrize(
    "family,tied",
    [
        ("llama", False),
        ("llama", True),
        ("qwen2", True),
        ("qwen3", False),
        ("mistral", False),
        ("mixtral", False),
        ("qwen3_moe", True),
    ],
)
def test_family_round_trip_with_transformers(tmp_path, family, tied):
    from ladle.train.loss import cross_entropy_sum

    hf = _hf_model(family, tied)
    hf.save_pretrained(tmp_path / "hf")
    ref_logits, ref_loss = _logits(hf)

    model, cfg = load_hf(tmp_path / "hf")
    assert cfg.family == family and cfg.qkv_bias == (family == "qwen2")
    assert cfg.qk_norm == (family in ("qwen3", "qwen3_moe"))
    assert (cfg.moe is not None) == (family in ("mixtral", "qwen3_moe"))
    assert cfg.tie_embeddings == tied
    with torch.no_grad():
        ours = model(TOKENS)
        loss = cross_entropy_sum(ours[:, :-1], TOKENS[:, 1:]) / TOKENS[:, 1:].numel()
    torch.testing.assert_close(ours, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)

    out = save_hf(model.state_dict(), cfg, tmp_path / "export")
    exported = json.loads((out / "config.json").read_text())
    assert exported["architectures"] == [type(hf).__name__] and exported["model_type"] == hf.config.model_type
    back_logits, _ = _logits(out)
    torch.testing.assert_close(back_logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert model_config_from_hf(exported, "config.json") == cfg


MIXTRAL = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "supported: LlamaForCausalLM, Qwen2"),
        (  # sliding windows load (tests/test_sliding_window.py); patterns ladle cannot compute do not
            {
                "architectures": ["Qwen2ForCausalLM"],
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 4,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            "is not full attention up to one layer and sliding windows after it",
        ),
        (
            {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": True},
            "attention_bias",
        ),
        (
            {"rope_parameters": {"rope_type": "longrope", "factor": 4.0}},
            "rope type 'longrope' is not supported",
        ),
        (
            {**MIXTRAL, "router_jitter_noise": 0.01},
            r"router_jitter_noise 0.01 is not supported; supported: 0.0",
        ),
        ({**QWEN3_MOE, "mlp_only_layers": [1]}, r"dense layers between MoE layers \(mlp_only_layers=\[1\]"),
        ({**QWEN3_MOE, "decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({**QWEN3_MOE, "num_experts": None}, "needs the number of experts"),
    ],
)
def test_unsupported_configs_are_refused_by_name(change, message):
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **COMMON,
        "tie_word_embeddings": False,
        **change,
    }
    with pytest.raises(CheckpointError, match=message):
        model_config_from_hf(d, "config.json")


def test_export_refuses_a_family_that_cannot_express_the_model():
    from ladle.config.schema import ModelConfig

    cfg = ModelConfig(vocab_size=97, dim=32, n_layers=1, n_heads=4, ffn_dim=64, qkv_bias=True, family="qwen3")
    with pytest.raises(CheckpointError, match="set model.family to qwen2 for q/k/v biases"):
        from ladle.models.hf import hf_config

        hf_config(cfg)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe"])
def test_family_greedy_generation_matches_transformers(tmp_path, family):
    from ladle.models.generation import generate

    hf = _hf_model(family, tied=False)
    hf.save_pretrained(tmp_path / "hf")
    model, _ = load_hf(tmp_path / "hf")
    prompts = [[5, 17, 3, 88, 41, 2, 60], [9, 30, 72]]
    ours = generate(model.eval(), prompts, max_new_tokens=10)
    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=10,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    assert out[:, P:].tolist() == ours


def test_mixtral_export_refuses_unnormalised_router_weights():
    from ladle.config.schema import ModelConfig, MoEConfig
    from ladle.models.hf import hf_config

    moe = MoEConfig(n_experts=4, top_k=2, ffn_dim=16, norm_topk_prob=False)
    cfg = ModelConfig(vocab_size=97, dim=32, n_layers=1, n_heads=4, family="mixtral", moe=moe)
    with pytest.raises(CheckpointError, match="mixtral always renormalises the top-k router weights"):
        hf_config(cfg)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_sharded_moe_checkpoints_load_and_export_sharded(tmp_path, family):
    # transformers writes a sharded folder (index + several files, experts spread over them);
    # ladle loads it, and its own sharded export loads back in transformers.
    hf = _hf_model(family, tied=False)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    ref_logits, _ = _logits(hf)
    model, cfg = load_hf(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), ref_logits, atol=1e-5, rtol=1e-5)

    out = save_hf(model.state_dict(), cfg, tmp_path / "export", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    expert_keys = [k for k in index["weight_map"] if ".experts." in k]
    assert len(expert_keys) == 2 * 3 * cfg.moe.n_experts  # one tensor per expert and projection
    assert len(set(index["weight_map"].values())) > 2
    back_logits, _ = _logits(out)
    torch.testing.assert_close(back_logits, ref_logits, atol=1e-5, rtol=1e-5)


def test_a_missing_expert_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = _hf_model("mixtral", tied=False)
    hf.save_pretrained(tmp_path / "hf")
    f = tmp_path / "hf" / "model.safetensors"
    sd = load_file(f)
    del sd["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"missing tensors: model\.layers\.1\.block_sparse_moe\.experts\.2\.w3\.weight"
    ):
        load_hf(tmp_path / "hf")
