"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): multi-head latent attention with its low-rank query and
key-value projections and decoupled RoPE, the MoE with shared experts, sigmoid scores, the
score-correction bias and group-limited top-k, routed scaling and the first dense layers. A tiny
random checkpoint written by transformers loads with equal logits and greedy tokens; the export
loads back in transformers with equal logits; the KV cache holds the latent."""

import json

import pytest
import torch

from ladle.errors import CheckpointError
from ladle.models.hf import load_hf, model_config_from_hf, save_hf
from ladle.models.llama import count_params

TOKENS = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(7))
SHAPE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=12,
    qk_nope_head_dim=8,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=1,
)


YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 8,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 1.0,
}  # fmt: skip


def hf_model(**change):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**{**SHAPE, **change})).eval()
    with torch.no_grad():  # transformers starts the router, its bias and the norms flat: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"q_lora_rank": None, "rope_interleave": False, "n_group": 1, "topk_group": 1},
        # V3's long context: YaRN frequencies, its attention factor on cos/sin (mscale over
        # mscale_all_dim) and mscale_all_dim's softmax sharpening; positions past the original 8
        {"rope_parameters": YARN},
    ],
    ids=["v3", "plain-q-rope-halves-no-groups", "yarn"],
)
def test_logits_and_export_equal_transformers(tmp_path, change):
    from transformers import AutoModelForCausalLM

    hf = hf_model(**change)
    hf.save_pretrained(tmp_path / "hf")
    model, cfg = load_hf(tmp_path / "hf")
    assert cfg.family == "deepseek_v3" and cfg.mla.kv_lora_rank == 16 and cfg.moe.dense_layers == 1
    assert count_params(cfg) == sum(p.numel() for p in hf.parameters())
    with torch.no_grad():
        ref = hf(TOKENS).logits
        torch.testing.assert_close(model(TOKENS), ref, atol=1e-5, rtol=1e-5)
    save_hf(model.state_dict(), cfg, tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, ref, atol=1e-5, rtol=1e-5)
    d = json.loads((tmp_path / "out" / "config.json").read_text())
    assert d["first_k_dense_replace"] == 1 and d["n_group"] == change.get("n_group", 4)


def test_greedy_generation_with_the_latent_cache_equals_transformers(tmp_path):
    from ladle.models.generation import generate

    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    model, cfg = load_hf(tmp_path / "hf")
    prompts = [TOKENS[0, :9].tolist(), TOKENS[1, :4].tolist()]
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
    cache = model.new_cache(2, 16)
    with torch.no_grad():
        model(TOKENS[:, :5], cache=cache)
    k, v = cache.k[0], cache.v[0]  # the shared roped key part and the latent, one "head" each
    assert k.shape == (2, 1, 16, cfg.mla.qk_rope_head_dim) and v.shape == (2, 1, 16, cfg.mla.kv_lora_rank)


def test_group_limited_routing_against_its_formula():
    from ladle.config.schema import ModelConfig
    from ladle.models.moe import MoE

    cfg = ModelConfig(
        family="deepseek_v3",
        dim=8,
        n_layers=1,
        n_heads=2,
        mla={"kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 2},
        moe={
            "n_experts": 8,
            "top_k": 2,
            "ffn_dim": 4,
            "scoring": "sigmoid",
            "n_group": 4,
            "topk_group": 1,
            "routed_scaling_factor": 2.0,
        },
    )
    moe = MoE(cfg)
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[:, 0] = torch.tensor([0.1, 0.2, 3.0, -1.0, 0.5, 0.4, 0.0, 0.3])  # scores from x[0]
        moe.gate.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, -5.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    x = torch.zeros(1, 8)
    x[0, 0] = 1.0
    _, scores, weights, chosen = moe._route_sigmoid(x)
    s = torch.sigmoid(torch.tensor([0.1, 0.2, 3.0, -1.0, 0.5, 0.4, 0.0, 0.3]))
    # choice = s + bias; groups (0,1) (2,3) (4,5) (6,7): sums of the two best; group 2 wins (expert 2's
    # high score is pushed down by its bias), so experts 4 and 5 are chosen, weighted by their plain scores
    assert sorted(chosen[0].tolist()) == [4, 5]
    w = s[[4, 5]] / s[[4, 5]].sum() * 2.0
    torch.testing.assert_close(weights[0].sort().values, w.sort().values)


def test_what_ladle_does_not_compute_is_refused():
    base = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **SHAPE,
        "tie_word_embeddings": False,
    }
    with pytest.raises(CheckpointError, match="topk_method 'greedy'"):
        model_config_from_hf({**base, "topk_method": "greedy"}, "config.json")
    with pytest.raises(
        CheckpointError, match="rope type 'longrope' is not supported; supported: default, llama3, yarn"
    ):
        model_config_from_hf(
            {**base, "rope_parameters": {"rope_type": "longrope", "factor": 40.0, "rope_theta": 1e4}}, "c"
        )


def test_the_tiny_deepseek_config_trains(tiny_config, tmp_path):
    import yaml

    from ladle.cli import main
    from ladle.config.load import read_yaml, resolve_config_path
    from ladle.train.metrics import read_metrics

    model = read_yaml(resolve_config_path("tiny/pretrain-mla-moe"))["model"]
    tiny_config["model"] = {
        **model,
        "vocab_size": 512,
        "dim": 64,
        "n_layers": 3,
        "n_heads": 4,
        "ffn_dim": 128,
        "max_seq_len": 64,
    }
    tiny_config["model"]["mla"] = {
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
    }
    tiny_config["model"]["moe"] = {**model["moe"], "ffn_dim": 32}
    tiny_config["train"].update(max_steps=12, eval_every=0)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config))
    assert main(["run", "pretrain", "--config", str(cfg)]) == 0
    recs = [r for r in read_metrics(tiny_config["output_dir"]) if "loss" in r]
    assert recs[-1]["loss"] < recs[0]["loss"] and all(r["moe_imbalance"] >= 1 for r in recs)
    # train.compile: the blocks compiled, latent attention and the MoE layer eager inside them
    compiled = tmp_path / "compiled"
    assert (
        main(["run", "pretrain", "--config", str(cfg), f"output_dir={compiled}", "train.compile=true"]) == 0
    )
    for a, b in zip(recs, [r for r in read_metrics(compiled) if "loss" in r], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)


def _tiny_moe(**moe):
    from ladle.config.schema import ModelConfig
    from ladle.models.moe import MoE

    cfg = ModelConfig(
        family="deepseek_v3",
        dim=8,
        n_layers=1,
        n_heads=2,
        mla={"kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 2},
        moe={"n_experts": 4, "top_k": 2, "ffn_dim": 4, "scoring": "sigmoid", **moe},
    )
    torch.manual_seed(0)
    m = MoE(cfg)
    from ladle.models.moe import init_moe

    init_moe(m, 0.5, 0.5)
    return m


def test_the_bias_update_follows_its_formula():
    from ladle.models.moe import update_correction_bias

    moe = _tiny_moe(bias_update_rate=0.01)
    counts = torch.tensor([[10.0, 2.0, 6.0, 6.0]])  # one MoE layer; mean 6
    update_correction_bias(moe, counts)
    torch.testing.assert_close(moe.gate.e_score_correction_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    update_correction_bias(_tiny_moe(), counts)  # rate 0: nothing moves (checked below)
    still = _tiny_moe()
    update_correction_bias(still, counts)
    assert torch.count_nonzero(still.gate.e_score_correction_bias) == 0


def test_the_sequence_wise_balance_loss_against_its_formula():
    moe = _tiny_moe(aux_loss_scope="sequence")
    x = torch.randn(3, 5, 8)
    _, (aux, _, _) = moe(x)
    logits, scores, _, chosen = moe._route_sigmoid(x.reshape(-1, 8))
    p = (scores / scores.sum(-1, keepdim=True)).view(3, 5, 4)
    want = []
    for b in range(3):
        picks = torch.bincount(chosen.view(3, 5 * 2)[b], minlength=4).float() / 5
        want.append(4 * (picks * p[b].mean(0)).sum())
    torch.testing.assert_close(aux, torch.stack(want).mean())


def test_the_bias_moves_in_training_and_is_checkpointed(tiny_config, tmp_path):
    # 5 steps at rate 0.01: each bias has moved by a multiple of 0.01 up to 0.05, and not all by 0;
    # the checkpoint holds it (a persistent buffer of the router), so a resume continues from it.
    from pathlib import Path

    import yaml

    from ladle.checkpoint.dcp import load_model_weights
    from ladle.cli import main
    from ladle.config.load import build_config
    from ladle.models.llama import build_model

    tiny_config["model"] = {
        "family": "deepseek_v3",
        "vocab_size": 512,
        "dim": 32,
        "n_layers": 2,
        "n_heads": 4,
        "ffn_dim": 64,
        "max_seq_len": 64,
        "mla": {"kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4},
        "moe": {
            "n_experts": 4,
            "top_k": 2,
            "ffn_dim": 16,
            "scoring": "sigmoid",
            "bias_update_rate": 0.01,
            "dense_layers": 1,
        },
    }
    tiny_config["train"].update(max_steps=5, eval_every=0)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config))
    assert main(["run", "pretrain", "--config", str(cfg)]) == 0
    model = build_model(build_config(yaml.safe_load(cfg.read_text())).model)
    load_model_weights(Path(tiny_config["output_dir"]) / "checkpoints" / "step_00000005", model)
    bias = model.state_dict()["layers.1.mlp.gate.e_score_correction_bias"]
    steps = bias / 0.01
    assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 5 and bias.abs().sum() > 0


@pytest.mark.parametrize(
    "parallel, world, message",
    [
        ({"tp": 3, "dp_shard": 1}, 3, r"tp=3 does not divide model\.n_heads=8"),
        ({"tp": 2, "ep": 2, "dp_shard": 2}, 4, r"tp=2 with ep=2 is not supported yet"),
        ({"cp": 2, "dp_shard": 1}, 2, r"cp > 1 with model\.mla .* is not supported yet"),
    ],
)
def test_layouts_the_architecture_cannot_take_are_refused(tiny_config, parallel, world, message):
    from ladle.config.load import build_config, read_yaml, resolve_config_path
    from ladle.errors import ConfigError
    from ladle.parallel.mesh import check_layout

    tiny_config["model"] = read_yaml(resolve_config_path("tiny/pretrain-mla-moe"))["model"]
    tiny_config["parallel"] = parallel
    with pytest.raises(ConfigError, match=message):
        check_layout(build_config(tiny_config), world)


@pytest.mark.parametrize("scope", ["batch", "sequence"])
def test_the_router_scores_in_fp32_under_bf16_autocast(scope):
    # transformers' router casts to fp32, which autocast would undo: the scores, and so the
    # choice of experts, must be the fp32 ones, and the balancing loss must not mix dtypes.
    from ladle.config import ModelConfig
    from ladle.models.moe import MoE

    cfg = ModelConfig(
        **{
            "family": "deepseek_v3", "vocab_size": 97, "dim": 32, "n_layers": 2, "n_heads": 4,
            "mla": {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8},
            "moe": {"n_experts": 8, "top_k": 2, "ffn_dim": 16, "scoring": "sigmoid", "n_group": 4,
                    "topk_group": 2, "aux_loss_scope": scope},
        }
    )  # fmt: skip
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 16, 32)
    logits, *_, chosen = moe._route_sigmoid(x.reshape(-1, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf_logits, *_, bf_chosen = moe._route_sigmoid(x.reshape(-1, 32))
        y, (aux, z, counts) = moe(x)
    assert bf_logits.dtype == torch.float32 and torch.equal(bf_chosen, chosen)
    (y.float().sum() + aux).backward()
    assert aux.dtype == torch.float32 and moe.gate.weight.grad is not None


def test_the_multi_token_prediction_layer_is_left_unread_with_a_warning(tmp_path):
    # V3's checkpoint holds its MTP module as the block after the last (model.layers.61.*), which
    # transformers does not load either: ladle loads the main model, says so, and still refuses
    # an extra tensor that the config does not account for.
    from safetensors.torch import load_file, save_file

    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    f = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(f)
    mtp = {"model.layers.3.eh_proj.weight": torch.ones(32, 64), "model.layers.3.enorm.weight": torch.ones(32)}
    save_file({**tensors, **mtp}, f, metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: .*model\.layers\.3\.e"):
        load_hf(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.warns(UserWarning, match=r"multi-token prediction layer \(2 tensors, .*\) is not loaded"):
        model, _ = load_hf(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf(TOKENS).logits, atol=1e-5, rtol=1e-5)
    # a crafted count is only a bound on block indices (no work in its size); a non-number is none
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 10**12}))
    with pytest.warns(UserWarning, match=r"multi-token prediction layer"):
        load_hf(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": "many"}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: .*model\.layers\.3\.e"):
        load_hf(tmp_path / "hf")


@pytest.mark.parametrize(
    "rope",
    [
        {"factor": 0, "original_max_position_embeddings": 8},
        {"original_max_position_embeddings": 0},  # the factor would be max / 0
        {"factor": 4, "original_max_position_embeddings": "x"},
    ],
)
def test_a_malformed_yarn_scaling_is_refused_by_name(rope):
    import transformers as tf

    d = tf.DeepseekV3Config(**SHAPE).to_dict()
    d.update(rope_scaling=None, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **rope})
    with pytest.raises(
        CheckpointError, match=r"config\.json: rope type 'yarn': .* is not a valid RoPE scaling"
    ):
        model_config_from_hf(d, "config.json")
