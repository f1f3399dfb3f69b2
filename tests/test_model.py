import itertools
import math

import pytest
import torch

from ladle.config.schema import ModelConfig, RopeScaling
from ladle.models.llama import Llama, build_model, count_params


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=128, init_std=0.1)
    return ModelConfig(**{**base, **kw})


def test_shapes_and_dtype():
    torch.manual_seed(0)
    model = build_model(tiny(n_kv_heads=2))
    logits = model(torch.randint(0, 97, (3, 11)))
    assert logits.shape == (3, 11, 97)
    assert logits.dtype == torch.float32


@pytest.mark.parametrize(
    "tied,bias,qk_norm,kv,head_dim",
    list(itertools.product([False, True], [False, True], [False, True], [None, 2], [None, 12])),
)
def test_count_params_matches_model(tied, bias, qk_norm, kv, head_dim):
    cfg = tiny(tie_embeddings=tied, qkv_bias=bias, qk_norm=qk_norm, n_kv_heads=kv, head_dim=head_dim)
    with torch.device("meta"):
        model = Llama(cfg)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    # exclude_embeddings: everything but the input table, the head counted once either way.
    assert count_params(cfg, exclude_embeddings=True) == count_params(cfg) - cfg.vocab_size * cfg.dim * (
        0 if tied else 1
    )


def test_tied_state_dict_has_no_head_key():
    model = build_model(tiny(tie_embeddings=True))
    sd = model.state_dict()
    assert "lm_head.weight" not in sd
    assert not any("inv_freq" in k for k in sd)
    other = build_model(tiny(tie_embeddings=True))
    other.load_state_dict(sd)  # strict round trip
    x = torch.randint(0, 97, (1, 5))
    torch.testing.assert_close(other(x), model(x))


def test_packed_documents_equal_separate_runs():
    torch.manual_seed(0)
    model = build_model(tiny(n_kv_heads=2))
    lens = [5, 9, 4]
    docs = [torch.randint(0, 97, (n,)) for n in lens]
    tokens = torch.cat(docs)[None]  # (1, 18)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])[None]
    positions = torch.cat([torch.arange(n) for n in lens])[None]
    packed = model(tokens, positions=positions, doc_ids=doc_ids)[0]
    start = 0
    for d in docs:
        alone = model(d[None])[0]
        torch.testing.assert_close(packed[start : start + len(d)], alone, atol=1e-5, rtol=1e-5)
        start += len(d)

    # Changing document 1 leaves document 2's logits untouched.
    changed = tokens.clone()
    changed[0, 5:14] = (changed[0, 5:14] + 1) % 97
    packed2 = model(changed, positions=positions, doc_ids=doc_ids)[0]
    torch.testing.assert_close(packed2[14:], packed[14:], atol=1e-6, rtol=0)
    assert not torch.allclose(packed2[5:14], packed[5:14])


def test_batch_mixing_packed_and_single_document_rows(monkeypatch):
    """Rows with a boundary take the masked path, the others the causal fast path: each row still
    equals its documents run alone, and the gradients agree with an all-masked reference."""
    from ladle.models.llama import attention_mask

    torch.manual_seed(1)
    model = build_model(tiny(n_kv_heads=2))
    T = 12
    tokens = torch.randint(0, 97, (3, T))
    doc_ids = torch.tensor([[0] * T, [0] * 7 + [1] * 5, [0] * T])
    positions = torch.stack([torch.arange(T), torch.cat([torch.arange(7), torch.arange(5)]), torch.arange(T)])
    out = model(tokens, positions=positions, doc_ids=doc_ids)
    torch.testing.assert_close(out[0], model(tokens[:1])[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[2], model(tokens[2:])[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, :7], model(tokens[1:2, :7])[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, 7:], model(tokens[1:2, 7:])[0], atol=1e-5, rtol=1e-5)

    with torch.autocast("cpu", dtype=torch.bfloat16):  # the mixed path under autocast too
        low = model(tokens, positions=positions, doc_ids=doc_ids)
    torch.testing.assert_close(low.float(), out, atol=0.1, rtol=0.1)

    out.sum().backward()
    mixed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # the reference: one explicit mask for every row
    import ladle.models.llama as llama

    class AllMasked(llama.PackedMask):
        def __init__(self, d):
            self.order, self.n_plain = torch.arange(len(d)), 0
            self.mask = attention_mask(d, d, 0)

    monkeypatch.setattr(llama, "PackedMask", AllMasked)
    model(tokens, positions=positions, doc_ids=doc_ids).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, mixed[n], atol=1e-5, rtol=1e-4)


def test_meta_build_init():
    torch.manual_seed(0)
    cfg = tiny(dim=64, n_layers=2, init_std=0.02)
    model = build_model(cfg)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert torch.isfinite(model(torch.randint(0, 97, (2, 8)))).all()
    out_std = model.layers[0].self_attn.o_proj.weight.std().item()
    q_std = model.layers[0].self_attn.q_proj.weight.std().item()
    assert out_std == pytest.approx(0.02 / math.sqrt(4), rel=0.1)
    assert q_std == pytest.approx(0.02, rel=0.1)
    assert model.layers[1].mlp.down_proj.weight.std().item() == pytest.approx(0.01, rel=0.1)
    assert (model.norm.weight == 1).all()
    # The RoPE buffer is recomputed after to_empty (uninitialised memory otherwise), in fp32.
    ref = Llama(cfg).rotary_emb.inv_freq
    torch.testing.assert_close(model.rotary_emb.inv_freq, ref, atol=0, rtol=0)
    bf16 = build_model(cfg, dtype=torch.bfloat16)
    assert bf16.embed_tokens.weight.dtype == torch.bfloat16
    assert bf16.rotary_emb.inv_freq.dtype == torch.float32


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ladle.models.hf import hf_config

    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
    cfg = tiny(dim=64, n_heads=2, rope_theta=500000.0, rope_scaling=scaling)  # head_dim 32
    ours = Llama(cfg).rotary_emb.inv_freq
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**hf_config(cfg)), "cpu")
    torch.testing.assert_close(ours, theirs.float(), atol=0, rtol=1e-6)
    # The head size spans all three regimes (kept, interpolated, divided by factor).
    plain = Llama(cfg.model_copy(update={"rope_scaling": None})).rotary_emb.inv_freq
    ratio = plain / ours
    assert (ratio == 1).any() and (ratio == 8).any() and ((ratio > 1) & (ratio < 8)).any()


def _hf_logits(hf_cls, hf_cfg, model, tokens):
    hf = hf_cls(hf_cfg).eval()
    sd = {("model." + k if not k.startswith("lm_head.") else k): v for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}
    if missing:  # tied: HF shares the head with the embedding
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        return hf(tokens).logits


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(tie_embeddings=True, n_kv_heads=2),
        dict(head_dim=12, n_kv_heads=1, rope_scaling=RopeScaling(original_max_seq_len=16)),
    ],
)
def test_logits_match_transformers_llama(kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    from ladle.models.hf import hf_config

    torch.manual_seed(0)
    cfg = tiny(**kw)
    model = build_model(cfg)
    tokens = torch.randint(0, 97, (2, 13))
    hf_cfg = LlamaConfig(**hf_config(cfg))
    hf_cfg._attn_implementation = "eager"
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(
        ours, _hf_logits(LlamaForCausalLM, hf_cfg, model, tokens), atol=1e-5, rtol=1e-5
    )


def _qwen_dict(cfg, model_type):
    from ladle.models.hf import hf_config

    d = hf_config(cfg.model_copy(update={"qkv_bias": False, "qk_norm": False}))
    for k in ("attention_bias", "mlp_bias", "pretraining_tp"):
        d.pop(k)
    return {**d, "model_type": model_type}


def test_qkv_bias_matches_transformers_qwen2():
    # HF Llama's attention_bias also adds an o_proj bias, so Qwen2 is the reference for qkv_bias.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = tiny(qkv_bias=True, n_kv_heads=2)
    model = build_model(cfg)
    with torch.no_grad():
        for layer in model.layers:  # init zeroes biases: make them matter
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_(0, 0.5)
    tokens = torch.randint(0, 97, (2, 9))
    hf_cfg = Qwen2Config(**_qwen_dict(cfg, "qwen2"))
    hf_cfg._attn_implementation = "eager"
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(
        ours, _hf_logits(Qwen2ForCausalLM, hf_cfg, model, tokens), atol=1e-5, rtol=1e-5
    )


def test_qk_norm_matches_transformers_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = tiny(qk_norm=True, n_kv_heads=2)
    model = build_model(cfg)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    tokens = torch.randint(0, 97, (2, 9))
    hf_cfg = Qwen3Config(**{**_qwen_dict(cfg, "qwen3"), "attention_bias": False})
    hf_cfg._attn_implementation = "eager"
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(
        ours, _hf_logits(Qwen3ForCausalLM, hf_cfg, model, tokens), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize(
    "x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]
)
def test_rmsnorm_bitwise_equals_transformers(x_dtype, w_dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from ladle.models.layers import RMSNorm

    torch.manual_seed(0)
    x = (torch.randn(4, 9, 48) * 3).to(x_dtype)
    ours, ref = RMSNorm(48, 1e-5), LlamaRMSNorm(48, eps=1e-5)
    w = torch.rand(48) + 0.5
    ours.weight.data, ref.weight.data = w.to(w_dtype), w.to(w_dtype)
    assert torch.equal(ours(x), ref(x))


@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_split_equals_one_call(masked):
    # T >= 128 on CPU takes the two-call path; it must equal one SDPA call, gradients included.
    import torch.nn.functional as F

    from ladle.models.layers import sdpa
    from ladle.models.llama import attention_mask

    torch.manual_seed(0)
    T = 128
    q = torch.randn(2, 4, T, 16, requires_grad=True)
    k = torch.randn(2, 2, T, 16, requires_grad=True)
    v = torch.randn(2, 2, T, 16, requires_grad=True)
    docs = torch.cat([torch.zeros(2, 50), torch.ones(2, 40), torch.full((2, 38), 2)], 1).long()
    mask = attention_mask(docs, docs, 0) if masked else None
    grads = []
    for fn in (sdpa, None):
        if fn is None:
            kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
            y = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=mask is None)
        else:
            y = fn(q, k, v, mask)
        g = torch.autograd.grad((y * torch.linspace(-1, 1, 16)).sum(), (q, k, v))
        grads.append((y.detach(), *g))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_attention_groups_query_heads_as_rows(dtype, tol, monkeypatch):
    # A decode step on CPU (one query row, GQA, the cache's mask) puts the query heads that share
    # a kv head in as rows of one head; the result is attention as defined, computed in fp64.
    import torch.nn.functional as F

    from ladle.models.layers import sdpa

    torch.manual_seed(0)
    B, H, K, D, S = 3, 8, 2, 16, 37
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, K, S, D), torch.randn(B, K, S, D)
    mask = torch.rand(B, 1, 1, S) > 0.3
    mask[..., -1] = True  # a query always sees itself
    shapes = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda q, *a, **kw: shapes.append(q.shape) or real(q, *a, **kw)
    )
    y = sdpa(q.to(dtype), k.to(dtype), v.to(dtype), mask)
    assert shapes == [(B, K, H // K, D)] and y.shape == (B, H, 1, D) and y.dtype == dtype
    kk, vv = k.double().repeat_interleave(H // K, 1), v.double().repeat_interleave(H // K, 1)
    scores = (q.double() @ kk.transpose(-1, -2) / math.sqrt(D)).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(y.double(), scores.softmax(-1) @ vv, atol=tol, rtol=tol)


def test_keep_computes_the_head_at_the_kept_positions_only():
    from ladle.config.schema import ModelConfig
    from ladle.models.llama import build_model

    torch.manual_seed(3)
    model = build_model(
        ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
    )
    tokens = torch.randint(0, 64, (3, 10))
    keep = torch.rand(3, 10, generator=torch.Generator().manual_seed(1)) > 0.5
    full = model(tokens)
    got = model(tokens, keep=keep)
    assert got.shape == (int(keep.sum()), 64)
    assert torch.allclose(got, full[keep], atol=1e-6)
