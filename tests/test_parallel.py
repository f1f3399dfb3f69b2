"""Parallel layouts: the checks before launch, and each layout trained on several gloo processes
against one process (fp32, same global batch, same samples)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import make_tiny_config

from ladle.checkpoint.dcp import load_model_weights
from ladle.cli import main
from ladle.config.load import build_config
from ladle.errors import ConfigError
from ladle.models.llama import build_model
from ladle.parallel.mesh import check_layout, resolve_layout
from ladle.recipes import pretrain
from ladle.train.metrics import read_metrics

STEPS = 10
# Qwen3's layout (QK-norm, head_dim set): tensor parallel then also shards the per-head norms.
QWEN3 = {"family": "qwen3", "qk_norm": True, "head_dim": 8}


def cfg_of(tiny_config, **parallel):
    d = json.loads(json.dumps(tiny_config))
    d["model"].update(QWEN3)
    d["parallel"] = parallel
    return build_config(d)


# -- the checks, before any process starts -----------------------------------------------------
def test_dp_shard_takes_the_rest(tiny_config):
    lay = resolve_layout(cfg_of(tiny_config, tp=2), 8)
    assert (lay.dp_replicate, lay.dp_shard, lay.tp, lay.dp, lay.world) == (1, 4, 2, 4, 8)
    assert lay.fsdp
    assert not resolve_layout(cfg_of(tiny_config, dp_replicate=4, dp_shard=1), 4).fsdp  # DDP
    assert resolve_layout(
        cfg_of(tiny_config, dp_replicate=2, dp_shard=1, tp=2), 4
    ).fsdp  # DDP composes with nothing


@pytest.mark.parametrize(
    "parallel, world, message",
    [
        ({"tp": 3}, 8, r"tp=3 x pp=1 x cp=1 = 3 does not divide the world size 8"),
        ({"dp_shard": 2, "tp": 2}, 8, r"dp_shard=2 = 4, but the world size is 8; set parallel\.dp_shard=-1"),
        ({"tp": 4, "dp_shard": 1}, 4, r"tp=4 does not divide model\.n_kv_heads=2"),
        (
            {"pp": 4, "dp_shard": 1},
            4,
            r"pp=4 x 1 stages per rank \(1f1b\) = 4 stages for model\.n_layers=2 would leave a stage empty",
        ),
        ({"pp": 2, "dp_shard": 1, "pp_split": [2]}, 2, r"pp_split=\[2\] must be 1 increasing layer indices"),
        ({"pp": 2, "dp_shard": 1, "pp_schedule": "zbv"}, 2, r"2 x 2 stages per rank \(zbv\) = 4 stages"),
        ({"ep": 2}, 2, r"ep=2 on a dense model: expert parallelism needs model\.moe"),
        ({"ep": 2, "dp_shard": 1, "dp_replicate": 2}, 2, r"ep=2 must divide dp_shard=1"),
        ({"cpu_offload": True, "dp_replicate": 2, "dp_shard": 1}, 2, r"cpu_offload needs FSDP"),
        ({"cp": 3, "dp_shard": 1}, 3, r"2 x cp=6 does not divide data\.seq_len=32"),
        ({"cp": 2, "pp": 2, "dp_shard": 1}, 4, r"cp > 1 with pp > 1 is not supported yet"),
        ({"cp": 2, "dp_shard": 1, "cp_attention": "ring"}, 2, r"cp_attention=ring has no document mask"),
    ],
)
def test_layouts_that_do_not_fit_are_refused_with_the_arithmetic(tiny_config, parallel, world, message):
    with pytest.raises(ConfigError, match=message):
        check_layout(cfg_of(tiny_config, **parallel), world)


def test_pp_with_tied_embeddings_is_refused_by_name(tiny_config):
    cfg = cfg_of(tiny_config, pp=2, dp_shard=1)
    cfg.model.tie_embeddings = True
    with pytest.raises(ConfigError, match=r"pp > 1 with model\.tie_embeddings=true is not supported"):
        check_layout(cfg, 2)


def test_async_tp_is_refused_where_it_cannot_run(tiny_config):
    cfg = cfg_of(tiny_config, tp=2, dp_shard=1, async_tp=True)
    cfg.train.device = "cpu"
    with pytest.raises(ConfigError) as e:
        check_layout(cfg, 2)
    assert "parallel.async_tp is an inductor pass over the compiled blocks; set train.compile=true" in str(
        e.value
    )
    assert "parallel.async_tp needs CUDA (symmetric memory), but this run's device is cpu" in str(e.value)
    cfg = cfg_of(tiny_config, dp_shard=2, async_tp=True)
    cfg.train.device = "cpu"
    with pytest.raises(ConfigError, match=r"parallel\.async_tp needs parallel\.tp > 1"):
        check_layout(cfg, 2)


def test_cli_refuses_a_bad_layout_before_torchrun(tiny_config, tmp_path, capsys):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump(tiny_config))
    out = tmp_path / "run"
    assert (
        main(
            [
                "run",
                "pretrain",
                "--config",
                str(cfg_file),
                "--nproc",
                "2",
                "parallel.tp=3",
                f"output_dir={out}",
            ]
        )
        == 2
    )
    assert "tp=3 x pp=1 x cp=1 = 3 does not divide the world size 2" in capsys.readouterr().err
    assert not out.exists()


def test_cli_refuses_to_start_over_a_run_before_torchrun(tiny_config, tmp_path, capsys):
    # each of N processes would otherwise print the refusal and torchrun report a crash
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump(tiny_config))
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    args = ["run", "pretrain", "--config", str(cfg_file), "--nproc", "2", f"output_dir={out}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count(f"output_dir {out} already holds a run's metrics.jsonl; set train.resume=auto") == 1
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


def test_validate_checks_the_layout_for_a_world_size(tiny_config, tmp_path, capsys):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump(tiny_config))
    assert main(["validate", "--config", str(cfg_file), "--nproc", "8", "parallel.tp=2"]) == 0
    assert "layout for 8 processes: dp_shard=4, tp=2 (FSDP2)" in capsys.readouterr().err
    assert main(["validate", "--config", str(cfg_file), "--nproc", "8", "parallel.tp=4"]) == 2
    assert "tp=4 does not divide model.n_kv_heads=2" in capsys.readouterr().err


# -- layouts on gloo against one process ---------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tokenizer_dir, data_dir, tmp_path_factory):
    """One process, fp32: the run every layout must reproduce."""
    return reference_run(tokenizer_dir, data_dir, tmp_path_factory.mktemp("ref"), QWEN3)


# Router losses are means per microbatch (docs/training.md), so only without them does a split
# batch give the single process's loss exactly; the routing itself is compared all the same.
QWEN3_MOE = {
    **QWEN3,
    "family": "qwen3_moe",
    "moe": {"n_experts": 4, "top_k": 2, "ffn_dim": 32, "aux_loss_weight": 0.0, "z_loss_weight": 0.0},
}


@pytest.fixture(scope="module")
def moe_reference(tokenizer_dir, data_dir, tmp_path_factory):
    return reference_run(tokenizer_dir, data_dir, tmp_path_factory.mktemp("moe"), QWEN3_MOE)


def reference_run(tokenizer_dir, data_dir, tmp, model):
    cfg = write_config(make_tiny_config(tokenizer_dir, data_dir, tmp / "one"), tmp / "c.yaml", model)
    assert main(["run", "pretrain", "--config", str(cfg), f"output_dir={tmp / 'one'}"]) == 0
    return cfg, tmp / "one"


def write_config(tiny_config, path, model):
    d = json.loads(json.dumps(tiny_config))
    d["model"].update(model)
    # grad_clip below the norms seen (~0.8): every step is clipped by the norm over all shards.
    d["train"].update(
        max_steps=STEPS, eval_every=5, micro_batch_size=2, grad_accum_steps=2, threads=1, grad_clip=0.5
    )
    d["checkpoint"]["every"] = 5
    path.write_text(yaml.safe_dump(d))
    return path


def launch(cfg_file, out, nproc, *overrides, recipe="pretrain", env=None):
    cmd = [sys.executable, "-m", "ladle", "run", recipe, "--config", str(cfg_file), "--nproc", str(nproc)]
    r = subprocess.run(
        [*cmd, f"output_dir={out}", *overrides], capture_output=True, text=True, timeout=300, env=env
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


def final_weights(run_dir, cfg_file):
    model = build_model(build_config(yaml.safe_load(cfg_file.read_text())).model)
    load_model_weights(run_dir / "checkpoints" / "step_00000010", model)
    return model.state_dict()


def assert_same_run(a, b, cfg_file, *, loss_tol=None, grad_norm_rel=1e-4, skip=(), weight_atol=1e-5):
    """Per-step loss and validation loss to `loss_tol` (default 1e-5 absolute: fp32, the sums run
    in another order over shards), gradient norm to `grad_norm_rel`, and, when `cfg_file` is
    given, the final weights to `weight_atol` (but those whose names end with one of `skip`)."""
    loss_tol = loss_tol or {"abs": 1e-5}
    ra, rb = read_metrics(a), read_metrics(b)
    la = {r["step"]: r for r in ra if "loss" in r}
    lb = {r["step"]: r for r in rb if "loss" in r}
    assert sorted(la) == sorted(lb) == list(range(1, STEPS + 1))
    for s in la:
        assert lb[s]["loss"] == pytest.approx(la[s]["loss"], **loss_tol), s
        assert lb[s]["grad_norm"] == pytest.approx(la[s]["grad_norm"], rel=grad_norm_rel), s
    va = {r["step"]: r["val_loss"] for r in ra if "val_loss" in r}
    vb = {r["step"]: r["val_loss"] for r in rb if "val_loss" in r}
    assert va.keys() == vb.keys() and va
    for s in va:
        assert vb[s] == pytest.approx(va[s], **loss_tol)
    if cfg_file is None:
        return
    wa, wb = final_weights(a, cfg_file), final_weights(b, cfg_file)
    for k in wa:
        if not k.endswith(tuple(skip)):
            torch.testing.assert_close(wb[k], wa[k], atol=weight_atol, rtol=1e-4, msg=k)


LAYOUTS = {
    # name: (processes, overrides); every one keeps the global batch of 2 x 2 accumulation steps
    "fsdp dp_shard=2": (2, ["parallel.dp_shard=2", "train.micro_batch_size=1"]),
    "ddp dp_replicate=2": (2, ["parallel.dp_replicate=2", "parallel.dp_shard=1", "train.micro_batch_size=1"]),
    "tp=2": (2, ["parallel.tp=2", "parallel.dp_shard=1"]),
    "fsdp + selective activation checkpointing": (
        2,
        ["parallel.dp_shard=2", "train.micro_batch_size=1", "activation_checkpoint.mode=selective"],
    ),
    "dp_shard=2 x tp=2": (4, ["parallel.dp_shard=2", "parallel.tp=2", "train.micro_batch_size=1"]),
    # Each sample's 32 tokens split in 2 x 2 chunks of 8 over the CP ranks (document masks kept).
    "cp=2": (2, ["parallel.cp=2", "parallel.dp_shard=1"]),
    "cp=2 x dp_shard=2": (4, ["parallel.cp=2", "parallel.dp_shard=2", "train.micro_batch_size=1"]),
    "cp=2 x tp=2": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.dp_shard=1"]),
    "hsdp dp_replicate=2 x dp_shard=2": (
        4,
        # 4 data ranks: 1 sample each, no accumulation; one validation batch of 4 like the reference's 2 x 2
        [
            "parallel.dp_replicate=2",
            "parallel.dp_shard=2",
            "train.micro_batch_size=1",
            "train.grad_accum_steps=1",
            "train.eval_steps=1",
        ],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_trains_like_one_process(reference, tmp_path, name):
    cfg_file, one = reference
    nproc, overrides = LAYOUTS[name]
    out = tmp_path / "par"
    launch(cfg_file, out, nproc, *overrides)
    assert_same_run(one, out, cfg_file)
    events = (out / "events.log").read_text()
    assert all(f"[rank {r}]" in events for r in range(nproc))
    # The ranks of a TP or CP group train on the same samples: one reads, the others receive.
    shared = "cp" in name or "tp" in name
    assert ("read by the first rank of each" in events) == shared
    card = json.loads((out / "run_card.json").read_text())
    assert card["world_size"] == nproc and card["final"]["sample"].startswith("def ")


# train.compile under a layout: the compiled blocks give the eager single process's run to fusion
# rounding (the fp32 reference is eager; compiled vs eager alone differs by ~1e-5 per step). A
# gradient with a missing reduction, as TP + compile with an attention graph break gave on torch
# 2.13 (docs/training.md), is off by tens of percent from step 1.
COMPILED_LAYOUTS = ["fsdp dp_shard=2", "cp=2 x tp=2"]  # TP compiled (whole blocks) in the second


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPILED_LAYOUTS)
def test_compiled_layout_trains_like_one_process(reference, tmp_path, name):
    cfg_file, one = reference
    nproc, overrides = LAYOUTS[name]
    out = tmp_path / "par"
    launch(cfg_file, out, nproc, *overrides, "train.compile=true")
    assert_same_run(one, out, None, loss_tol={"rel": 1e-4}, grad_norm_rel=1e-3)


@pytest.mark.slow
def test_tensor_parallel_with_tied_embeddings(tokenizer_dir, data_dir, tmp_path):
    # The head reuses the vocabulary-sharded embedding matrix (Qwen2.5-0.5B, Llama-3.2-1B do).
    cfg_file, one = reference_run(tokenizer_dir, data_dir, tmp_path, {**QWEN3, "tie_embeddings": True})
    out = tmp_path / "tp"
    launch(cfg_file, out, 2, "parallel.tp=2", "parallel.dp_shard=1")
    assert_same_run(one, out, cfg_file)


GLM4 = {
    "family": "glm4",
    "qkv_bias": True,
    "rope_interleaved": True,
    "post_norms": True,
    "partial_rotary_factor": 0.5,
    "head_dim": 8,
}


@pytest.mark.slow
def test_glm4_under_tensor_parallel_and_fsdp_trains_like_one_process(tokenizer_dir, data_dir, tmp_path):
    # GLM-4-0414's post-norms on the sequence shards, partial interleaved RoPE, q/k/v biases.
    # The k bias of the dimensions RoPE leaves alone adds q.b to every score of a query alike,
    # which softmax ignores: its gradient is zero but for rounding, which AdamW scales up to lr
    # steps of either sign. So it is left out of the weights compared (losses are compared); the
    # rest within 3e-5 (the head's rows of unseen tokens take AdamW-normalised rounding too).
    cfg_file, one = reference_run(tokenizer_dir, data_dir, tmp_path, GLM4)
    for name, layout in (
        ("tp", ["parallel.tp=2", "parallel.dp_shard=1"]),
        ("fsdp", ["parallel.dp_shard=2", "train.micro_batch_size=1"]),
    ):
        launch(cfg_file, tmp_path / name, 2, *layout)
        assert_same_run(one, tmp_path / name, cfg_file, skip=("k_proj.bias",), weight_atol=3e-5)


# Router losses per sequence (aux_loss_scope=sequence) and the z-loss, a mean over tokens, are
# the same whichever data rank holds a sequence, so they stay on; the correction bias moves.
DEEPSEEK = {
    "family": "deepseek_v3", "rope_interleaved": True, "n_layers": 3,
    "mla": {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8},
    "moe": {"n_experts": 4, "top_k": 2, "ffn_dim": 32, "scoring": "sigmoid", "n_group": 2, "topk_group": 1,
            "routed_scaling_factor": 2.5, "n_shared_experts": 1, "dense_layers": 1, "aux_loss_weight": 0.01,
            "aux_loss_scope": "sequence", "z_loss_weight": 0.001, "bias_update_rate": 0.01},
}  # fmt: skip


def assert_same_routing(one, out, losses):
    """Every step's fewest and most tokens of an expert equal one process's, and the router
    `losses` to 1e-5 (summed over stages and ranks)."""
    ref, rec = ([r for r in read_metrics(d) if "loss" in r] for d in (one, out))
    for a, b in zip(ref, rec, strict=True):
        assert (b["moe_tokens_min"], b["moe_tokens_max"]) == (a["moe_tokens_min"], a["moe_tokens_max"])
        for key in losses:
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)


@pytest.fixture(scope="module")
def deepseek_reference(tokenizer_dir, data_dir, tmp_path_factory):
    return reference_run(tokenizer_dir, data_dir, tmp_path_factory.mktemp("deepseek"), DEEPSEEK)


DEEPSEEK_LAYOUTS = {
    # A dense block and an MoE block on the first stage, an MoE block on the second: each stage
    # adds its own router losses to its backward and reports its layers' expert load.
    "pp=2": (2, ["parallel.pp=2", "parallel.dp_shard=1"]),
    # FSDP over dp_shard=2 (the experts over the ranks that hold the same ones), EP and PP at once.
    "pp=2 x ep=2 in dp_shard=2": (
        4,
        ["parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2", "train.micro_batch_size=1"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", DEEPSEEK_LAYOUTS)
def test_deepseek_v3_trains_like_one_process(deepseek_reference, tmp_path, name):
    # Latent attention, shared experts, group-limited sigmoid routing, a dense first layer.
    cfg_file, one = deepseek_reference
    nproc, overrides = DEEPSEEK_LAYOUTS[name]
    out = tmp_path / "run"
    launch(cfg_file, out, nproc, *overrides)
    assert_same_run(one, out, cfg_file, weight_atol=3e-5)
    assert_same_routing(one, out, ("moe_aux_loss", "moe_z_loss"))


# Tensor parallel: latent attention split by heads, the shared experts like a dense MLP, and each
# rank routing its own sequence shard. The balancing loss of a sequence is not the mean of its
# shards' (it multiplies two means), so these runs and their reference leave it off; the z-loss
# (a mean over tokens) stays on, and the token counts must be the whole batch's.
DEEPSEEK_TP = {**DEEPSEEK, "moe": {**DEEPSEEK["moe"], "aux_loss_weight": 0.0}}


@pytest.fixture(scope="module")
def deepseek_tp_reference(tokenizer_dir, data_dir, tmp_path_factory):
    return reference_run(tokenizer_dir, data_dir, tmp_path_factory.mktemp("deepseek_tp"), DEEPSEEK_TP)


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, overrides",
    [
        (2, ["parallel.tp=2", "parallel.dp_shard=1"]),
        (4, ["parallel.tp=2", "parallel.dp_shard=2", "train.micro_batch_size=1"]),
        (4, ["parallel.tp=2", "parallel.pp=2", "parallel.dp_shard=1"]),
    ],
    ids=["tp=2", "dp_shard=2 x tp=2", "pp=2 x tp=2"],
)
def test_deepseek_v3_under_tensor_parallel_trains_like_one_process(
    deepseek_tp_reference, tmp_path, nproc, overrides
):
    cfg_file, one = deepseek_tp_reference
    out = tmp_path / "run"
    launch(cfg_file, out, nproc, *overrides)
    assert_same_run(one, out, cfg_file, weight_atol=3e-5)
    assert_same_routing(one, out, ("moe_z_loss",))


@pytest.fixture(scope="module")
def deep_reference(tokenizer_dir, data_dir, tmp_path_factory):
    """Four blocks, so that two stages per rank on two ranks each get one."""
    return reference_run(tokenizer_dir, data_dir, tmp_path_factory.mktemp("deep"), {**QWEN3, "n_layers": 4})


PP_LAYOUTS = {
    **{
        f"pp=2 {s}": (2, ["parallel.pp=2", "parallel.dp_shard=1", f"parallel.pp_schedule={s}"])
        # One schedule of each shape: one stage a rank, looped stages, the V. (GPipe and
        # interleaved 1F1B differ from these in torch's ordering only, not in ladle's wiring.)
        for s in ("1f1b", "interleaved_zb", "zbv")
    },
    "pp=2 1f1b with a split after block 3": (
        2,
        ["parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_split=[3]"],
    ),
    "pp=2 x dp_shard=2": (4, ["parallel.pp=2", "parallel.dp_shard=2", "train.micro_batch_size=1"]),
    "pp=2 x tp=2": (4, ["parallel.pp=2", "parallel.tp=2", "parallel.dp_shard=1"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", PP_LAYOUTS)
def test_pipeline_trains_like_one_process(deep_reference, tmp_path, name):
    # The step's two microbatches (grad_accum_steps) are the pipeline's; validation runs the
    # stages forward in order.
    cfg_file, one = deep_reference
    nproc, overrides = PP_LAYOUTS[name]
    out = tmp_path / "pp"
    launch(cfg_file, out, nproc, *overrides)
    assert_same_run(one, out, cfg_file)


def test_pipeline_stages_split_the_layers():
    from ladle.parallel.pp import stage_bounds, stage_ids

    assert stage_bounds(10, 4, None) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert stage_bounds(10, 2, [7]) == [(0, 7), (7, 10)]
    assert stage_ids(0, 2, "1f1b") == [0] and stage_ids(1, 2, "interleaved_1f1b") == [1, 3]
    assert stage_ids(0, 2, "zbv") == [0, 3] and stage_ids(1, 2, "zbv") == [1, 2]  # the V


MOE_LAYOUTS = {
    "ep=2": (2, ["parallel.ep=2", "train.micro_batch_size=1"]),
    # Each TP rank routes its sequence shard through the whole experts (softmax router).
    "tp=2": (2, ["parallel.tp=2", "parallel.dp_shard=1"]),
    "ep=2 in dp_shard=4": (
        4,
        [
            "parallel.ep=2",
            "parallel.dp_shard=4",
            "train.micro_batch_size=1",
            "train.grad_accum_steps=1",
            "train.eval_steps=1",
        ],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", MOE_LAYOUTS)
def test_moe_layouts_train_like_one_process(moe_reference, tmp_path, name):
    # Experts split over 2 ranks, tokens exchanged by all-to-all on gloo; with dp_shard=4 the
    # experts are also FSDP-sharded over the 2 ranks that hold the same ones.
    cfg_file, one = moe_reference
    nproc, overrides = MOE_LAYOUTS[name]
    out = tmp_path / "ep"
    launch(cfg_file, out, nproc, *overrides)
    # 3e-5: AdamW turns the rounding of a near-zero gradient into up to an lr-sized step (one
    # element of the TP run's o_proj, 2.6e-5 off); everything else agrees within 1e-5.
    assert_same_run(one, out, cfg_file, weight_atol=3e-5)
    rec = [r for r in read_metrics(out) if "loss" in r][-1]
    ref = [r for r in read_metrics(one) if "loss" in r][-1]
    assert (rec["moe_tokens_min"], rec["moe_tokens_max"]) == (ref["moe_tokens_min"], ref["moe_tokens_max"])


@pytest.mark.slow
def test_resume_with_another_layout_continues_exactly(reference, tmp_path):
    # FSDP over 2 ranks to step 5, then tensor parallel over 2 ranks from that checkpoint: the
    # same losses and weights as the uninterrupted single process.
    cfg_file, one = reference
    out = tmp_path / "switch"
    launch(cfg_file, out, 2, "parallel.dp_shard=2", "train.micro_batch_size=1", "train.exit_at_step=5")
    launch(cfg_file, out, 2, "parallel.tp=2", "parallel.dp_shard=1", "train.resume=auto")
    assert_same_run(one, out, cfg_file)
    events = (out / "events.log").read_text()
    assert "resumed from" in events and "parallel.tp: 1 -> 2" in events


@pytest.mark.slow
def test_a_killed_rank_comes_back_with_max_restarts(reference, tmp_path):
    """One rank of a 2-process FSDP job SIGKILLed after step 7: torchrun restarts the job, whose
    new attempt resumes from step 5 by itself (no train.resume) and ends like one process."""
    import os

    cfg_file, one = reference
    out = tmp_path / "restarted"
    env = {**os.environ, "LADLE_FAULT": "kill:7:1"}
    text = launch(
        cfg_file, out, 2, "parallel.dp_shard=2", "train.micro_batch_size=1", "--max-restarts", "1", env=env
    )
    assert "LADLE_FAULT: kill at step 7 on rank 1" in text
    events = (out / "events.log").read_text()
    assert (
        "restarted attempt: torchrun restarted the workers of this job (1 restart so far); resuming from "
        in events
    )
    assert f"resumed from {out}/checkpoints/step_00000005 at step 5" in events
    assert_same_run(one, out, cfg_file)


@pytest.mark.slow
def test_two_nodes_on_localhost_lose_one_and_come_back(reference, tmp_path):
    """Two `ladle run --nnodes 2` (one process each) at a c10d rendezvous; the second node is
    lost after step 7 (its launcher, torchrun agent and worker SIGKILLed). A replacement node
    started with the same --rdzv-id joins the surviving node's new rendezvous round, and the job
    resumes from step 5 and ends like one process."""
    import os
    import socket

    cfg_file, one = reference
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "nodes"
    cmd = [sys.executable, "-m", "ladle", "run", "pretrain", "--config", str(cfg_file), "--nproc", "1"]
    cmd += [
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "job-17",
        "--max-restarts",
        "1",
    ]
    cmd += [f"output_dir={out}", "train.micro_batch_size=1"]

    def node(**env):
        return subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **env}
        )

    first = node()
    deadline = time.time() + 120  # the first node hosts the rendezvous store: the lost one must not
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.time() < deadline and first.poll() is None, "the first node did not start"
            time.sleep(0.2)
    lost = node(LADLE_FAULT="kill-node:7")
    text, _ = lost.communicate(timeout=300)
    assert lost.returncode == -9 and "LADLE_FAULT: kill-node at step 7" in text, text[-3000:]
    replacement = node()
    for p in (first, replacement):
        text, _ = p.communicate(timeout=300)
        assert p.returncode == 0, text[-3000:]
    events = (out / "events.log").read_text()
    assert (
        "restarted attempt: " in events
        and f"resumed from {out}/checkpoints/step_00000005 at step 5" in events
    )
    assert json.loads((out / "run_card.json").read_text())["job"]["id"] == "job-17"
    assert_same_run(one, out, cfg_file)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000010"


# -- activation checkpointing ---------------------------------------------------------------------
AC_MODES = {
    "full": {"mode": "full"},
    "selective op": {"mode": "selective", "selective": "op"},
    "selective 2": {"mode": "selective", "selective": 2},
}


@pytest.mark.parametrize("name", AC_MODES)
def test_activation_checkpointing_trains_like_none(tiny_config, tmp_path, name):
    d = json.loads(json.dumps(tiny_config))
    d["model"].update(QWEN3)
    d["train"]["max_steps"] = STEPS
    ref, out = tmp_path / "none", tmp_path / "ac"
    pretrain.run(build_config({**d, "output_dir": str(ref)}))
    pretrain.run(build_config({**d, "output_dir": str(out), "activation_checkpoint": AC_MODES[name]}))
    a = {r["step"]: r for r in read_metrics(ref) if "loss" in r}
    b = {r["step"]: r for r in read_metrics(out) if "loss" in r}
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for s in a:  # recomputation repeats the same fp32 ops: equal to rounding
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], abs=1e-6)
        assert b[s]["grad_norm"] == pytest.approx(a[s]["grad_norm"], rel=1e-6)


def backward_ops(ac: dict | None) -> tuple[dict, int]:
    """(matmuls and norms run during backward, bytes saved for backward outside checkpoints)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ladle.config.schema import ActivationCheckpointConfig, ModelConfig
    from ladle.parallel.ac import apply_ac

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = {"mm": 0, "rsqrt": 0}  # RMSNorm reaches the dispatcher as pow, mean, rsqrt

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            name = "mm" if name == "addmm" else name
            if name in self.ops:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, ffn_dim=64, max_seq_len=16))
    if ac:
        apply_ac(model, ActivationCheckpointConfig(**ac), torch.device("cpu"))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t
    ):
        loss = model(torch.randint(0, 64, (2, 16))).square().mean()
    with Count() as count:
        loss.backward()
    return count.ops, sum(saved)


def test_activation_checkpointing_recomputes_what_its_mode_says():
    none, none_bytes = backward_ops(None)
    full, full_bytes = backward_ops(AC_MODES["full"])
    every2, every2_bytes = backward_ops(AC_MODES["selective 2"])
    op, _ = backward_ops(AC_MODES["selective op"])
    # Each checkpointed block runs its forward again, up to the last op whose output backward
    # needs (checkpoint stops early): q, k, v, o, gate, up; not down, whose output nobody saves.
    per_block_mm = 6
    assert full["mm"] == none["mm"] + 4 * per_block_mm  # all four blocks
    assert every2["mm"] == none["mm"] + 2 * per_block_mm  # blocks 0 and 2
    assert op["mm"] == none["mm"] and op["rsqrt"] > none["rsqrt"]  # matmuls kept, norms redone
    assert full_bytes < every2_bytes < none_bytes


@pytest.mark.slow
@pytest.mark.parametrize("source", ["hf", "ladle"])
def test_init_from_fills_each_ranks_shards(reference, tmp_path, source):
    # The sharded model is built on the meta device and each rank reads its shards out of the
    # Hugging Face files, or DCP reshards a ladle checkpoint into them: the same losses as one
    # process starting from the same weights.
    cfg_file, one = reference
    init = one  # a run directory: its latest checkpoint's weights, not its optimizer or step
    if source == "hf":
        init = tmp_path / "hf"
        assert main(["export", "hf", str(one), str(init)]) == 0
    common = [f"model.init_from={init}", "train.max_steps=3", "scheduler.warmup_steps=1"]
    assert main(["run", "pretrain", "--config", str(cfg_file), f"output_dir={tmp_path / 'a'}", *common]) == 0
    launch(cfg_file, tmp_path / "b", 2, "parallel.tp=2", "parallel.dp_shard=1", *common)
    a = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "a") if "loss" in r}
    b = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "b") if "loss" in r}
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for s in a:
        assert b[s] == pytest.approx(a[s], abs=1e-5)
    first = [r for r in read_metrics(one) if "loss" in r][0]["loss"]
    assert a[1] < first - 0.1  # it did start from the trained weights, not from a fresh init


@pytest.mark.slow
def test_sft_trains_like_one_process_under_fsdp(tokenizer_dir, sort_chats, tmp_path):
    # Packed chats with their loss masks: FSDP over 2 ranks equals one process, per step.
    sft_data = sort_chats
    cfg = make_tiny_config(tokenizer_dir, sft_data, tmp_path / "one")
    cfg["sample"] = {"prompt": ""}
    cfg_file = write_config(cfg, tmp_path / "c.yaml", QWEN3)
    assert main(["run", "sft", "--config", str(cfg_file)]) == 0
    launch(cfg_file, tmp_path / "fsdp", 2, "parallel.dp_shard=2", "train.micro_batch_size=1", recipe="sft")
    ra = {r["step"]: r for r in read_metrics(tmp_path / "one") if "loss" in r}
    rb = {r["step"]: r for r in read_metrics(tmp_path / "fsdp") if "loss" in r}
    assert sorted(ra) == sorted(rb) == list(range(1, STEPS + 1))
    for s in ra:
        assert rb[s]["loss"] == pytest.approx(ra[s]["loss"], abs=1e-5), s
        assert rb[s]["grad_norm"] == pytest.approx(ra[s]["grad_norm"], rel=1e-4), s


LORA = {
    "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "dora": True,
    "modules_to_save": ["embed_tokens", "lm_head"],  # trained in full: sharded, or split over TP
}
LORA_LAYOUTS = {
    "fsdp dp_shard=2": (2, ["parallel.dp_shard=2", "train.micro_batch_size=1"]),
    "tp=2": (2, ["parallel.tp=2", "parallel.dp_shard=1"]),
}


@pytest.fixture(scope="module")
def lora_reference(tokenizer_dir, data_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    cfg = make_tiny_config(tokenizer_dir, data_dir, tmp / "one")
    cfg["lora"] = LORA
    cfg["optim"]["lr"] = 3e-2
    cfg_file = write_config(cfg, tmp / "c.yaml", QWEN3)
    assert main(["run", "pretrain", "--config", str(cfg_file)]) == 0
    return cfg_file, tmp / "one"


@pytest.mark.slow
@pytest.mark.parametrize("name", LORA_LAYOUTS)
def test_dora_adapters_train_like_one_process(lora_reference, tmp_path, name):
    # DoRA on every linear of a frozen base, embedding and head trained in full: under FSDP the
    # adapters are sharded with their block (the root group mixes frozen and trained tensors);
    # under TP they are DTensors placed like their base layer (A replicated and B split for
    # column-parallel layers, A split for row-parallel ones). Loss and gradient norm as one process.
    cfg_file, one = lora_reference
    nproc, overrides = LORA_LAYOUTS[name]
    out = tmp_path / "par"
    launch(cfg_file, out, nproc, *overrides)
    ra = {r["step"]: r for r in read_metrics(one) if "loss" in r}
    rb = {r["step"]: r for r in read_metrics(out) if "loss" in r}
    assert sorted(ra) == sorted(rb) == list(range(1, STEPS + 1))
    for s in ra:
        assert rb[s]["loss"] == pytest.approx(ra[s]["loss"], abs=1e-5), s
        assert rb[s]["grad_norm"] == pytest.approx(ra[s]["grad_norm"], rel=1e-4), s
    assert ra[STEPS]["loss"] < ra[1]["loss"] - 0.03  # the adapters learn (on a random, frozen base)


# -- context parallelism -----------------------------------------------------------------------
def test_cp_shards_follow_pytorchs_head_tail_load_balancer():
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    from ladle.parallel.cp import shard_indices

    for T, cp in [(32, 2), (48, 3), (64, 4)]:
        ours = torch.cat([shard_indices(T, cp, r) for r in range(cp)])
        theirs = _HeadTailLoadBalancer(T, cp, "cpu")._generate_indices()[0]
        assert torch.equal(ours, theirs.long()), (T, cp)


def run_cp_attention(attention: str, *extra: str):
    script = Path(__file__).parent / "dist_cp_attention.py"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        str(script),
        attention,
        *extra,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count(f"context-parallel {attention} attention matches") == 2


def test_cp_attention_keeps_documents_apart_like_one_process():
    # Rows of ~5 packed documents each (the layout runs above rarely cross a boundary): logits
    # of each rank's tokens and the summed gradients equal the unsplit sequence's, fp32, 1e-5.
    run_cp_attention("allgather")


def test_cp_attention_keeps_a_sliding_window_like_one_process():
    # The same with a window of 5 positions in every layer: the gathered keys' mask narrows to it.
    run_cp_attention("allgather", "window")


@pytest.mark.accelerator
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="ring attention: PyTorch has CUDA kernels only")
def test_cp_ring_attention_equals_one_process_on_cuda():
    run_cp_attention("ring")
