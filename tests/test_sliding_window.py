"""Sliding-window attention (Mistral's `sliding_window`, Qwen2's `use_sliding_window` from
`max_window_layers` on): equal to transformers when the sequence is longer than the window, in
training, packed and document-masked, and in generation with the KV cache. (Under context
parallelism: tests/test_parallel.py.)"""

import json

import pytest
import torch

from ladle.config.schema import ModelConfig
from ladle.errors import CheckpointError
from ladle.models.hf import hf_config, load_hf, model_config_from_hf, save_hf
from ladle.models.llama import build_model

COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)
TOKENS = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))


def hf_model(family: str):
    import transformers as tf

    if family == "mistral":
        config = tf.MistralConfig(**COMMON, sliding_window=5, head_dim=8)
        cls = tf.MistralForCausalLM
    else:  # layer 0 in full, layers 1 and 2 through the window
        config = tf.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=5, max_window_layers=1)
        cls = tf.Qwen2ForCausalLM
    torch.manual_seed(0)
    return cls(config).eval()


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_logits_equal_transformers_past_the_window_and_export_round_trips(tmp_path, family):
    from transformers import AutoModelForCausalLM

    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    model, cfg = load_hf(tmp_path / "hf")
    assert cfg.sliding_window == 5 and cfg.max_window_layers == (1 if family == "qwen2" else 0)
    with torch.no_grad():
        ref = hf(TOKENS).logits
        ours = model(TOKENS)
        full = build_model(cfg.model_copy(update={"sliding_window": None, "max_window_layers": 0}))
        full.load_state_dict(model.state_dict())
        assert not torch.allclose(full(TOKENS), ref, atol=1e-3)  # the window changes the logits here
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    save_hf(model.state_dict(), cfg, tmp_path / "out")
    d = json.loads((tmp_path / "out" / "config.json").read_text())
    assert d["sliding_window"] == 5
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_greedy_generation_with_the_kv_cache_equals_transformers(tmp_path, family):
    from ladle.models.generation import generate

    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    model, _ = load_hf(tmp_path / "hf")
    prompts = [TOKENS[0, :11].tolist(), TOKENS[1, :4].tolist()]  # one past the window, one inside it
    ours = generate(model.eval(), prompts, max_new_tokens=12)
    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = (torch.arange(P)[None] >= torch.tensor([[P - len(p)] for p in prompts])).long()
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    assert out[:, P:].tolist() == ours


def test_cached_decoding_equals_the_full_forward():
    cfg = ModelConfig(
        vocab_size=97,
        dim=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        family="qwen2",
        sliding_window=5,
        max_window_layers=1,
    )
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():
        full = model(TOKENS)
        cache = model.new_cache(2, 24)
        steps = [model(TOKENS[:, :7], cache=cache)] + [
            model(TOKENS[:, t : t + 1], cache=cache) for t in range(7, 24)
        ]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_packed_documents_each_see_their_own_window():
    cfg = ModelConfig(
        vocab_size=97,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        family="mistral",
        sliding_window=4,
    )
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    cuts = [0, 9, 17, 24]  # row 0: three documents; row 1: one (the causal fast path's row)
    doc_ids = torch.stack(
        [torch.bucketize(torch.arange(24), torch.tensor(cuts[1:-1]), right=True), torch.zeros(24).long()]
    )
    positions = torch.stack([torch.arange(24) - torch.tensor(cuts)[doc_ids[0]], torch.arange(24)])
    with torch.no_grad():
        packed = model(TOKENS, positions=positions, doc_ids=doc_ids)
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            alone = model(TOKENS[:1, a:b])
            torch.testing.assert_close(packed[0, a:b], alone[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed[1], model(TOKENS[1:])[0], atol=1e-5, rtol=1e-5)


def test_a_reward_models_last_position_keeps_the_window():
    cfg = ModelConfig(
        vocab_size=97,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        family="mistral",
        sliding_window=4,
        head="score",
    )
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    at = torch.tensor([23, 10])
    with torch.no_grad():
        every = model(TOKENS)
        last = model(TOKENS, at=at)
    torch.testing.assert_close(last[:, 0], every[torch.arange(2), at], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "use_sliding_window": True,
                "sliding_window": 5,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            },
            "is not full attention up to one layer and sliding windows after it",
        ),
        (
            {"architectures": ["LlamaForCausalLM"], "layer_types": ["sliding_attention"] * 3},
            "asks for attention ladle does not compute",
        ),
    ],
)
def test_window_patterns_ladle_cannot_compute_are_refused(change, message):
    with pytest.raises(CheckpointError, match=message):
        model_config_from_hf({**COMMON, "tie_word_embeddings": False, **change}, "config.json")


def test_window_settings_a_family_cannot_express_are_refused():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="Llama has no sliding window"):
        ModelConfig(family="llama", sliding_window=8)
    with pytest.raises(ValidationError, match="family mistral windows every layer"):
        ModelConfig(family="mistral", sliding_window=8, max_window_layers=2)
    cfg = ModelConfig(family="qwen2", qkv_bias=True, n_layers=4, sliding_window=8, max_window_layers=2)
    d = hf_config(cfg)
    assert d["use_sliding_window"] and d["sliding_window"] == 8 and d["max_window_layers"] == 2
