import math

import pytest
import torch

from ladle.config.schema import ModelConfig
from ladle.models.generation import filter_logits, generate, sample_next
from ladle.models.llama import build_model

PROMPTS = [[5, 17, 3, 88, 41, 2, 60], [9, 30, 72]]


def tiny_model(**kw):
    torch.manual_seed(0)
    base = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, init_std=0.2)
    return build_model(ModelConfig(**{**base, **kw})).eval()


def test_greedy_matches_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM

    from ladle.models.hf import hf_config, to_hf_name

    model = tiny_model()
    ours = generate(model, PROMPTS, max_new_tokens=12)
    # Each prompt alone gives the same tokens: left padding and the pad mask change nothing.
    for p, o in zip(PROMPTS, ours, strict=True):
        assert generate(model, [p], max_new_tokens=12) == [o]

    hf_cfg = LlamaConfig(**hf_config(model.cfg, pad_id=0))
    hf_cfg._attn_implementation = "sdpa"
    hf = LlamaForCausalLM(hf_cfg).eval()
    hf.load_state_dict({to_hf_name(k): v for k, v in model.state_dict().items()})
    P = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in PROMPTS])
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


def test_cache_logits_equal_full_recompute():
    model = tiny_model()
    tokens = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2, 16)
        parts = [model(tokens[:, :6], cache=cache)]
        parts += [model(tokens[:, t : t + 1], cache=cache) for t in range(6, 10)]
    assert cache.length == 10
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_logits_to_keep_computes_only_the_last_positions():
    model = tiny_model(tie_embeddings=True)
    tokens = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        full = model(tokens)
        assert model(tokens, logits_to_keep=3).shape == (2, 3, 97)
        torch.testing.assert_close(model(tokens, logits_to_keep=3), full[:, -3:])
        cache = model.new_cache(2, 16)
        last = model(tokens, cache=cache, logits_to_keep=1)
        assert cache.length == 10  # the whole prompt is cached all the same
    torch.testing.assert_close(last, full[:, -1:], atol=1e-5, rtol=1e-5)


def test_top_k_1_equals_greedy():
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    greedy = generate(model, PROMPTS, max_new_tokens=8)
    assert generate(model, PROMPTS, max_new_tokens=8, temperature=1.5, top_k=1, generator=g) == greedy


def test_sampling_is_seeded():
    model = tiny_model()
    a = generate(
        model, PROMPTS, max_new_tokens=8, temperature=1.0, generator=torch.Generator().manual_seed(1)
    )
    b = generate(
        model, PROMPTS, max_new_tokens=8, temperature=1.0, generator=torch.Generator().manual_seed(1)
    )
    assert a == b


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = probs.log()

    def kept(p):
        return set(torch.isfinite(filter_logits(logits, top_p=p))[0].nonzero().flatten().tolist())

    assert kept(0.4) == {1}
    assert kept(0.7) == {1, 3}
    assert kept(0.9) == {1, 3, 0}
    assert kept(0.97) == {0, 1, 2, 3}
    assert kept(1.0) == {0, 1, 2, 3}
    assert kept(1e-9) == {1}  # the most likely token always survives
    assert set(torch.isfinite(filter_logits(logits, top_k=2))[0].nonzero().flatten().tolist()) == {1, 3}
    # Renormalised sampling only ever picks kept tokens.
    g = torch.Generator().manual_seed(0)
    picks = {sample_next(logits.expand(200, 4), 1.0, 0, 0.7, g)[i].item() for i in range(200)}
    assert picks == {1, 3}
    assert math.isclose(filter_logits(logits, top_p=0.7).softmax(-1)[0, 1].item(), 0.5 / 0.8, rel_tol=1e-5)


def test_eos_stops_sequence():
    model = tiny_model()
    free = generate(model, PROMPTS, max_new_tokens=10)
    eos = free[0][3]
    out = generate(model, PROMPTS, max_new_tokens=10, eos_id=eos)
    cut = free[0].index(eos)
    assert out[0] == free[0][: cut + 1]
    stop1 = free[1].index(eos) + 1 if eos in free[1] else 10
    assert out[1] == free[1][:stop1]


def test_stop_strings_and_truncation():
    from ladle.models.generation import stop_strings, truncate_at_stop

    decode = lambda ids: "".join(chr(97 + i) for i in ids)  # noqa: E731
    stop = stop_strings(decode, ["cd", "", "zz"])
    assert not stop([0, 1, 2]) and stop([0, 1, 2, 3]) and stop(list(range(30)) + [2, 3])
    assert truncate_at_stop("abcdefcd", ["cd", "f"]) == "ab" and truncate_at_stop("abc", ["x"]) == "abc"
    model = tiny_model()
    free = generate(model, PROMPTS, max_new_tokens=8)
    first = free[0][2]
    out = generate(model, PROMPTS, max_new_tokens=8, stop=lambda toks: toks[-1] == first)
    assert out[0] == free[0][: free[0].index(first) + 1]


def test_padding_each_step_to_a_multiple_changes_nothing():
    # tensor parallelism's sequence shards need a multiple of tp positions per forward: the
    # prompts padded to it and each decode step led by pads that no real token attends to give the
    # same tokens and log-probs as one position a step
    from ladle.models.generation import sample

    model = tiny_model()
    prompts = [[5, 9, 2], [7, 1, 3, 3, 8], [4]]

    def run(m):
        gens = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
        return sample(
            model,
            prompts,
            max_new_tokens=6,
            temperature=1.0,
            row_generators=gens,
            prepack=False,
            seq_multiple=m,
        )

    one = run(1)
    for m in (2, 4):
        got = run(m)
        assert got.tokens == one.tokens
        for a, b in zip(got.logps, one.logps, strict=True):
            assert a == pytest.approx(b, abs=1e-5)


@pytest.mark.parametrize("kind", ["dense", "mla"])
def test_a_prompts_samples_share_its_prefill_and_sample_as_without(kind):
    """Rows with the same prompt are prefilled once and get copies of its cache: the same tokens
    and log-probs as prefilling every row, the same keyed streams."""
    from ladle.models.generation import sample

    mla = {  # DeepSeek-V3's latent attention (its cache: the latent and the roped key) and experts
        "family": "deepseek_v3",
        "mla": {"kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4},
        "moe": {"n_experts": 4, "top_k": 2, "ffn_dim": 16, "scoring": "sigmoid"},
    }
    model = tiny_model(**(mla if kind == "mla" else {}))
    prompts = [[5, 6, 7]] * 3 + [[9, 10]] * 3 + [[11, 12, 13, 14]]
    got = {}
    for share in (True, False):
        gens = [torch.Generator().manual_seed(100 + i) for i in range(len(prompts))]
        got[share] = sample(
            model, prompts, max_new_tokens=8, temperature=1.0, row_generators=gens, share_prefix=share
        )
    assert got[True].tokens == got[False].tokens
    for a, b in zip(got[True].logps, got[False].logps, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    assert len({tuple(t) for t in got[True].tokens[:3]}) > 1  # the samples of one prompt differ
