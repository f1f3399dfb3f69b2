"""The memory planner (ladle/plan) against what real runs hold, its layouts, and the checks around
a run: `ladle plan`, the refusal before launch, the out-of-memory report."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ladle.cli import main
from ladle.config.load import apply_preset
from ladle.config.schema import ActivationCheckpointConfig, LadleConfig, LoRAConfig, ModelConfig, OptimConfig
from ladle.errors import ConfigError
from ladle.models.llama import build_model
from ladle.models.lora import apply_lora
from ladle.models.nf4 import quantize_linears
from ladle.parallel.ac import _SAVE, apply_ac
from ladle.parallel.mesh import Layout
from ladle.plan import Target, estimate, layouts, plan
from ladle.plan import activations as act
from ladle.plan import memory as mem
from ladle.plan.estimate import roles
from ladle.plan.measure import SavedTensors, state_bytes
from ladle.train.loss import cross_entropy_sum
from ladle.train.optim import build_optimizer
from ladle.units import parse_size

GiB = 2**30
SHAPE = dict(vocab_size=256, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=512)
MOE = {"family": "qwen3_moe", "moe": {"n_experts": 4, "top_k": 2, "ffn_dim": 64}}
# DeepSeek-V3's shape: latent attention (v narrower than q/k), sigmoid routing in groups, a shared
# expert, the first block dense
DSV3 = {
    "family": "deepseek_v3", "n_kv_heads": None, "rope_interleaved": True,
    "mla": {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16},
    "moe": {"n_experts": 4, "top_k": 2, "ffn_dim": 32, "scoring": "sigmoid", "n_group": 2, "topk_group": 1,
            "n_shared_experts": 1, "dense_layers": 1},
}  # fmt: skip


# -- sizes -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, value",
    [
        ("64GB", 64 * GiB),
        ("64GiB", 64 * GiB),
        ("80g", 80 * GiB),
        ("80 G", 80 * GiB),
        ("512MiB", 512 * 2**20),
        ("1.5t", int(1.5 * 2**40)),
        ("4096", 4096),
    ],
)
def test_device_memory_sizes_parse(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["64 gigs", "GB", "-4GB", "0", "6x4GB"])
def test_a_size_that_does_not_parse_is_refused_by_name(text):
    with pytest.raises(ConfigError, match="--device-memory .* is not a size|must be more than 0"):
        parse_size(text, "--device-memory")


# -- activations: the planner against the bytes saved for backward ------------------------------
def measured(model_kw, ac="none", mode="fp32", B=2, T=256):
    cfg = ModelConfig(**{**SHAPE, **model_kw})
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.bfloat16 if mode == "bf16" else torch.float32)
    if ac != "none":
        ac_cfg = ActivationCheckpointConfig(
            mode="full" if ac == "full" else "selective", selective="op" if ac == "op" else 2
        )
        apply_ac(model, ac_cfg, torch.device("cpu"))
    tokens = torch.randint(0, cfg.vocab_size, (B, T))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16-mixed")
    with SavedTensors(model, keep_ops=_SAVE if ac == "op" else ()) as saved, autocast:
        cross_entropy_sum(model(tokens), tokens)
    return cfg, saved.bytes


def planned(cfg, ac="none", mode="fp32", B=2, T=256):
    """The planner's saved bytes of the same forward: activations and autocast's weight copies."""
    lc = LadleConfig.model_validate(
        {
            "tokenizer": {"path": "t"},
            "data": {"path": "d", "seq_len": T},
            "model": cfg.model_dump(),
            "train": {"micro_batch_size": B, "grad_accum_steps": 1},
            "precision": {"mode": mode},
            "activation_checkpoint": {
                "mode": {"none": "none", "full": "full"}.get(ac, "selective"),
                "selective": "op" if ac == "op" else 2,
            },
        }
    )
    e = estimate(lc, "pretrain", Layout(), Target(1, 2**40, cpu=True))
    return e.parts["activations"] + e.parts.get("autocast weight copies", 0)


CASES = [
    ({}, "none", "fp32"),
    ({}, "full", "fp32"),
    ({}, "op", "fp32"),
    ({}, "selective", "fp32"),
    ({"qk_norm": True}, "none", "fp32"),
    ({"tie_embeddings": True}, "none", "fp32"),
    (MOE, "none", "fp32"),
    (MOE, "op", "fp32"),
    ({}, "none", "bf16-mixed"),
    ({}, "full", "bf16-mixed"),
    ({"qk_norm": True}, "op", "bf16-mixed"),
    (MOE, "none", "bf16-mixed"),
    ({}, "none", "bf16"),
    ({"qk_norm": True}, "selective", "bf16"),
    (MOE, "none", "bf16"),
    (DSV3, "none", "fp32"),
    (DSV3, "full", "fp32"),
    (DSV3, "op", "fp32"),
    (DSV3, "selective", "fp32"),
    (DSV3, "none", "bf16-mixed"),
    (DSV3, "none", "bf16"),
]


@pytest.mark.parametrize("model_kw, ac, mode", CASES, ids=lambda v: str(v)[:30])
def test_activations_match_the_bytes_saved_for_backward(model_kw, ac, mode):
    cfg, real = measured(model_kw, ac, mode)
    mine = planned(cfg, ac, mode)
    assert abs(mine - real) <= 0.10 * real, (mine, real)


def test_short_sequences_take_the_plain_attention_path():
    cfg, real = measured({}, T=64)
    mine = planned(cfg, T=64)
    assert abs(mine - real) <= 0.10 * real, (mine, real)


def test_checkpointing_keeps_less_and_the_modes_are_ordered():
    cfg = ModelConfig(**SHAPE)
    m = act.Micro(2, 256)
    size = {
        ac: sum(v for k, v in act.saved(cfg, m, 3, ac, 2).items() if k != "recompute")
        for ac in ("none", "selective", "op", "full")
    }
    assert size["full"] < size["op"] < size["none"] and size["full"] < size["selective"] < size["none"]


# -- state: exactly the bytes of the real tensors ---------------------------------------------
@pytest.mark.parametrize(
    "model_kw, lora, optim",
    [
        ({}, None, "adamw"),
        ({"tie_embeddings": True}, None, "adamw"),
        ({"family": "qwen2", "qkv_bias": True}, None, "adamw"),
        (MOE, None, "adamw"),
        ({}, LoRAConfig(rank=4), "adamw"),
        ({}, LoRAConfig(rank=4, quantize_base="nf4", dora=True), "adamw"),
        ({"family": "qwen2", "qkv_bias": True}, None, "muon"),
        (MOE, None, "muon"),
        ({}, LoRAConfig(rank=4, dora=True), "muon"),
    ],
    ids=["dense", "tied", "bias", "moe", "lora", "qlora-dora", "muon-bias", "muon-moe", "muon-dora"],
)
def test_state_is_exactly_the_real_tensors(model_kw, lora, optim):
    cfg = ModelConfig(**{**SHAPE, **model_kw})
    model = build_model(cfg)
    if lora:
        model.requires_grad_(False)
        if lora.quantize_base == "nf4":
            quantize_linears(model)
        apply_lora(model, lora)
    opt = build_optimizer(model, OptimConfig(name=optim), torch.device("cpu"))
    tokens = torch.randint(0, 256, (2, 16))
    model(tokens).float().sum().backward()
    opt.step()
    real = state_bytes(model, opt)
    real["params"] += sum(
        b.untyped_storage().nbytes() for n, b in model.named_buffers() if "inv_freq" not in n
    )
    mine = mem.state(mem.tensors(cfg, True, lora), Layout(), 4, cfg.n_layers, optimizer=optim)[0]
    assert {k: mine[k] for k in real} == real


DIST = {
    "fsdp-bf16-full-ac": (
        2,
        {"parallel": {"dp_shard": 2}, "precision": "bf16-mixed", "ac": {"mode": "full"}},
    ),
    "fsdp-op-ac": (2, {"parallel": {"dp_shard": 2}, "ac": {"mode": "selective", "selective": "op"}}),
    "tp-bf16": (2, {"parallel": {"tp": 2}, "precision": "bf16-mixed"}),
    "ep-moe": (2, {"parallel": {"dp_shard": 2, "ep": 2}, "model": MOE}),
    "tp-moe": (2, {"parallel": {"tp": 2}, "model": MOE}),  # token parallel: routed experts whole
    "pp": (2, {"parallel": {"pp": 2}, "accum": 2}),
    "cp": (2, {"parallel": {"cp": 2}}),
    "tp-fsdp": (4, {"parallel": {"tp": 2, "dp_shard": 2}}),
    "fsdp-muon": (2, {"parallel": {"dp_shard": 2}, "optim": "muon"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DIST))
def test_planner_matches_a_real_step_in_each_layout(name, tmp_path):
    nproc, spec = DIST[name]
    out = tmp_path / "rows.json"
    script = Path(__file__).parent / "dist_plan.py"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        json.dumps(spec),
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank, row in enumerate(json.loads(out.read_text())):
        real, mine = row["real"], row["planned"]
        for k in ("params", "grads", "optimizer"):
            assert mine[k] == real[k], (rank, k, mine, real)
        if real["activations"] is not None:  # PP's schedule interleaves forward and backward
            assert abs(mine["activations"] - real["activations"]) <= 0.10 * real["activations"], (
                rank,
                mine,
                real,
            )


def test_fsdp_shards_are_padded_and_tp_splits_by_the_plan():
    cfg = ModelConfig(**{**SHAPE, "vocab_size": 250})  # 250 rows over 4 shards: 63 each, padded
    ts = mem.tensors(cfg)
    emb = next(t for t in ts if t.name == "embed_tokens.weight")
    assert mem.local_shape(emb, Layout(dp_shard=4)) == (63, 64)
    q = next(t for t in ts if t.name == "layers.0.self_attn.q_proj.weight")
    o = next(t for t in ts if t.name == "layers.0.self_attn.o_proj.weight")
    assert mem.local_shape(q, Layout(tp=2)) == (32, 64) and mem.local_shape(o, Layout(tp=2)) == (64, 32)
    norm = next(t for t in ts if t.name == "norm.weight")
    assert mem.local_shape(norm, Layout(tp=2)) == (64,)


# -- layouts, remedies, the report ------------------------------------------------------------
def big_config(**over) -> LadleConfig:
    d = {
        "tokenizer": {"path": "t"},
        "data": {"path": "d", "seq_len": 4096},
        "model": {"preset": "llama-2-70b"},
        "train": {"micro_batch_size": 4, "grad_accum_steps": 8},
        "precision": {"mode": "bf16-mixed"},
        "parallel": {"tp": 8, "pp": 2},
    }
    for k, v in over.items():
        d.setdefault(k, {}).update(v)
    if d["model"].get("preset") != "llama-2-70b":
        d["data"]["seq_len"] = 2048
    apply_preset(d)
    return LadleConfig.model_validate(d)


def test_layouts_keep_the_global_batch_and_tp_within_a_node():
    cfg = big_config()
    target = Target(devices=16, memory=80 * GiB)
    found = layouts(cfg, "pretrain", target, global_batch=32)
    valid = [lay for c, lay, _ in found if lay is not None]
    assert valid and all(lay.world == 16 and lay.tp <= 8 for lay in valid)
    for c, lay, _ in found:
        if lay is not None:
            assert c.train.micro_batch_size * c.train.grad_accum_steps * lay.dp == 32
    whys = [why for _, lay, why in found if lay is None]
    assert any("do not divide the global batch of 32" in w for w in whys)
    assert any("must be at least pp" in w for w in whys)


def test_the_seeds_70b_example():
    """Llama-2-70B on 16 devices: state alone is 16 bytes a parameter over 16 ranks, 64 GiB,
    whatever the TP x PP split; with full checkpointing TP8PP2 fits 80 GB, nothing fits 64 GB."""
    cfg = big_config(activation_checkpoint={"mode": "full"})
    r80 = plan(cfg, "pretrain", Target(devices=16, memory=80 * GiB))
    assert r80.own.fits
    state = sum(v for k, v in r80.own.parts.items() if k in ("parameters", "gradients", "optimizer state"))
    n = 68_976_648_192  # 16 bytes a parameter over 16 ranks, plus the first stage's embedding
    assert 16 * n / 16 < state < 1.02 * 16 * n / 16
    r64 = plan(cfg, "pretrain", Target(devices=16, memory=64 * GiB))
    assert not r64.own.fits and not any(e.fits for e in r64.ranked) and r64.fix is None
    none = plan(big_config(), "pretrain", Target(devices=16, memory=80 * GiB))
    assert not none.own.fits and none.fix and any("activation_checkpoint" in c for c in none.fix[0])


def test_muon_keeps_one_buffer_per_matrix_and_a_workspace():
    """Llama-2-70B TP8 PP2 on 16 devices: Muon's state is AdamW's less one moment of the blocks'
    matrices; its workspace, the largest matrix (the 28672 x 8192 MLP) whole, in bf16 iterates."""
    adamw = estimate(big_config(), "pretrain", Layout(tp=8, pp=2), Target(devices=16, memory=80 * GiB))
    cfg = big_config(optim={"name": "muon"})
    muon = estimate(cfg, "pretrain", Layout(tp=8, pp=2), Target(devices=16, memory=80 * GiB))
    saved = adamw.parts["optimizer state"] - muon.parts["optimizer state"]
    matrices = 4 * 8192 * (8192 + 1024 + 1024 + 8192 + 3 * 28672) // 8  # a block's, TP-local, fp32
    assert saved == 40 * (matrices + 7 * 4)  # the first stage's 40 blocks (and AdamW's step counts)
    whole, gram = 28672 * 8192, 8192**2
    assert muon.parts["optimizer workspace"] == whole * (2 * 4 + 2 * 2) + 3 * gram * 2
    assert "optimizer workspace" not in adamw.parts


def test_pipeline_schedules_hold_different_microbatches():
    from ladle.plan import in_flight

    lay = Layout(pp=4)
    cfg = big_config(parallel={"tp": 1, "pp": 4, "pp_schedule": "gpipe"})
    assert in_flight(cfg, lay, 0) == 8
    cfg = big_config(parallel={"tp": 1, "pp": 4, "pp_schedule": "1f1b"})
    assert [in_flight(cfg, lay, r) for r in range(4)] == [4, 3, 2, 1]
    cfg = big_config(parallel={"tp": 1, "pp": 4, "pp_schedule": "interleaved_1f1b"})
    assert math.isclose(in_flight(cfg, lay, 0), 4 * (1 + 3 / 8))


def test_rl_recipes_hold_their_extra_models():
    from ladle.models.llama import count_params

    base = big_config(model={"preset": "llama-3.2-1b"}, parallel={"tp": 1, "pp": 1})
    t = Target(devices=8, memory=80 * GiB)
    pre = estimate(base, "pretrain", Layout(dp_shard=8), t)
    ppo = estimate(base, "ppo", Layout(dp_shard=8), t)
    assert "reference: parameters" in ppo.parts and "critic: optimizer state" in ppo.parts
    assert "generation (KV cache, logits)" in ppo.parts and ppo.total > pre.total
    # the colocated vLLM engine reserves its share of each device (0.3 by default), or its weights
    # and the KV cache it is given
    on_vllm = base.model_copy(update={"ppo": base.ppo.model_copy(update={"engine": "vllm"})})
    engine = estimate(on_vllm, "ppo", Layout(dp_shard=8), t).parts["vLLM engine (weights, KV cache)"]
    assert engine == int(0.3 * 80 * GiB)
    sized = on_vllm.ppo.model_copy(update={"engine_args": {"kv_cache_memory_bytes": 2 * GiB}})
    est = estimate(on_vllm.model_copy(update={"ppo": sized}), "ppo", Layout(dp_shard=8), t)
    weights = est.parts["vLLM engine (weights, KV cache)"] - 2 * GiB
    assert weights == count_params(base.model) * 2  # bf16, the whole model on every rank
    separated = base.model_copy(update={"ppo": base.ppo.model_copy(update={"placement": "separated"})})
    sep = estimate(separated, "ppo", Layout(dp_shard=4, roles=2), t)
    assert (
        sep.parts.get("policy: parameters") and "critic: parameters" not in sep.parts or sep.total < ppo.total
    )
    # GRPO's separated engine: a group that trains (no KV cache) and one that holds a forward-only
    # copy and generates (no gradients, no optimizer state)
    grpo = base.model_copy(update={"grpo": base.grpo.model_copy(update={"placement": "separated"})})
    both = roles(grpo, "grpo")
    assert [[r.name for r in g] for g in both] == [["policy"], ["engine"]] and not both[1][0].trained
    sep = estimate(grpo, "grpo", Layout(dp_shard=4, roles=2), t)
    # the fuller group is the trainer's: one model (unnamed parts), no KV cache
    assert sep.parts["optimizer state"] > 0 and "generation (KV cache, logits)" not in sep.parts
    shared = estimate(base, "grpo", Layout(dp_shard=4), t)
    assert sep.total < shared.total  # the trainer's ranks hold no KV cache
    # with vLLM the engine ranks hold vLLM's share of the device and no copy of ladle's
    on_vllm = grpo.model_copy(update={"grpo": grpo.grpo.model_copy(update={"engine": "vllm"})})
    assert roles(on_vllm, "grpo")[1] == []
    est = estimate(on_vllm, "grpo", Layout(dp_shard=4, roles=2), t)  # its 0.3 of 80 GiB: the fuller group
    assert set(est.parts) == {
        "vLLM engine (weights, KV cache)",
        "runtime (context, collective buffers)",
        "fragmentation margin",
    }
    assert est.parts["vLLM engine (weights, KV cache)"] == int(0.3 * 80 * GiB)


# -- the command line ------------------------------------------------------------------------
BUNDLED = {  # each bundled config on the devices its name or README gives
    "pretrain/llama-2-70b-16x80g": ("pretrain", 16, "80GB"),
    "pretrain/deepseek-v3-512x80g": ("pretrain", 512, "80GB"),
    "sft/glm4-9b-full-sft-4x64g": ("sft", 4, "64GB"),
    "sft/qwen2.5-7b-lora": ("sft", 1, "80GB"),
    "sft/llama-3.1-8b-full-sft-8dev": ("sft", 8, "80GB"),
    "sft/llama-3.1-70b-lora-8dev": ("sft", 8, "80GB"),
    "sft/qwen3-30b-a3b-lora": ("sft", 8, "80GB"),
    "dpo/llama-3.1-8b-lora": ("dpo", 1, "80GB"),
    "dpo/qwen2.5-7b-full-8dev": ("dpo", 8, "80GB"),
    "reward/llama-3.2-1b": ("reward", 1, "80GB"),
    "rl/qwen2.5-1.5b-grpo-math-1dev": ("grpo", 1, "80GB"),
    "rl/qwen2.5-coder-1.5b-grpo-code-1dev": ("grpo", 1, "80GB"),
    "rl/qwen3-8b-grpo-8dev": ("grpo", 8, "80GB"),
    "rl/qwen2.5-7b-ppo-16dev": ("ppo", 16, "80GB"),
    "rl/qwen2.5-1.5b-distill-7b-8dev": ("distill", 8, "80GB"),
}


def test_every_bundled_config_fits_its_devices(capsys):
    from ladle.config.load import bundled_configs

    assert {n for n in bundled_configs() if not n.startswith("tiny/")} == set(BUNDLED)
    for name, (recipe, devices, memory) in BUNDLED.items():
        args = [
            "plan",
            "--config",
            name,
            "--recipe",
            recipe,
            "--devices",
            str(devices),
            "--device-memory",
            memory,
        ]
        assert main([*args, "--json"]) == 0, name
        got = json.loads(capsys.readouterr().out)["config_layout"]
        assert got["fits"], (name, got["total_bytes"] / GiB)


def write(tmp_path, cfg: dict) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


BIG = {
    "output_dir": "/tmp/x",
    "tokenizer": {"path": "/nowhere"},
    "data": {"path": "/nowhere", "seq_len": 4096},
    "model": {"preset": "llama-2-70b"},
    "train": {"micro_batch_size": 4, "grad_accum_steps": 8},
    "precision": {"mode": "bf16-mixed"},
    "parallel": {"tp": 8, "pp": 2},
    "activation_checkpoint": {"mode": "full"},
}


def test_plan_prints_the_breakdown_and_the_layouts(tmp_path, capsys):
    assert (
        main(["plan", "--config", str(write(tmp_path, BIG)), "--devices", "16", "--device-memory", "80GB"])
        == 0
    )
    out = capsys.readouterr().out
    assert "the config's layout, tp=8 pp=2: fits" in out
    assert "optimizer state" in out and "layouts that fit" in out and "layouts that do not fit" in out
    assert (
        main(
            [
                "plan",
                "--config",
                str(write(tmp_path, BIG)),
                "--devices",
                "16",
                "--device-memory",
                "80g",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["config_layout"]["fits"] and data["layouts"][0]["fits"]
    assert sum(data["config_layout"]["bytes"].values()) == data["config_layout"]["total_bytes"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--devices", "16", "--device-memory", "80 gigs"], "--device-memory '80 gigs' is not a size"),
        (["--devices", "12", "--device-memory", "80GB"], "does not divide the world size 12"),
        (["--devices", "0", "--device-memory", "80GB"], "--devices 0"),
    ],
)
def test_plan_refuses_bad_input(tmp_path, capsys, args, message):
    assert main(["plan", "--config", str(write(tmp_path, BIG)), *args]) == 2
    assert message in capsys.readouterr().err


def test_run_is_refused_before_launch_when_it_will_not_fit(tiny_config, tmp_path, capsys):
    tiny_config["device"] = {"memory": "1MiB"}
    cfg = write(tmp_path, tiny_config)
    out = Path(tiny_config["output_dir"])
    assert main(["run", "pretrain", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "exceeds the 1.00 MiB of one device (device.memory)" in err and "activations" in err
    assert "--no-memory-check" in err and not (out / "checkpoints").exists()
    assert (
        main(
            [
                "run",
                "pretrain",
                "--config",
                str(cfg),
                "--no-memory-check",
                "train.max_steps=3",
                "train.eval_every=0",
                "checkpoint.every=0",
            ]
        )
        == 0
    )


def test_the_refusal_names_the_first_remedy_that_fits(tiny_config, tmp_path):
    from ladle.plan import check_fits

    d = {
        **tiny_config,
        "data": {**tiny_config["data"], "seq_len": 64},
        "train": {**tiny_config["train"], "micro_batch_size": 8, "grad_accum_steps": 1},
    }
    cfg = LadleConfig.model_validate(d)
    lay = Layout()
    t = Target(1, 2**40, cpu=True, runtime=0)
    need = estimate(cfg, "pretrain", lay, t).total
    smaller = estimate(
        cfg.model_copy(
            update={"train": cfg.train.model_copy(update={"micro_batch_size": 4, "grad_accum_steps": 2})}
        ),
        "pretrain",
        lay,
        t,
    ).total
    memory = (need + smaller) // 2
    cfg = cfg.model_copy(update={"device": cfg.device.model_copy(update={"memory": str(memory)})})
    with pytest.raises(
        ConfigError,
        match=r"fits with: train.micro_batch_size=4 train.grad_accum_steps=2 \(the same global batch\)",
    ):
        check_fits(cfg, "pretrain", lay, torch.device("cpu"))


def test_an_out_of_memory_error_is_reported_with_the_breakdown(tiny_config, tmp_path, capsys):
    tiny_config["faults"] = {"enabled": True, "oom_at_step": 3}
    tiny_config["device"] = {"memory": "1GiB"}
    assert main(["run", "pretrain", "--config", str(write(tmp_path, tiny_config))]) == 1
    err = capsys.readouterr().err
    assert "out of memory on rank 0 in step 3" in err and "the planner's estimate" in err
    events = (Path(tiny_config["output_dir"]) / "events.log").read_text()
    assert "ERROR: out of memory on rank 0 in step 3: allocated" in events and "parameters" in events
