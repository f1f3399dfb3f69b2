"""GRPO's separated placement (ladle/rl/separated.py): the engine's copy of the policy on ranks of
its own, its weights sent after each update, and asynchronous training with `grpo.max_staleness`."""

import json
import subprocess
import sys

import pytest
import yaml
from test_grpo import grpo_config


def run_cli(path, out, *over, nproc=2):
    from ladle.train.metrics import read_metrics

    cmd = [sys.executable, "-m", "ladle", "run", "grpo", "--config", str(path), "--nproc", str(nproc)]
    r = subprocess.run([*cmd, f"output_dir={out}", *over], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [rec for rec in read_metrics(out) if "loss" in rec]


def test_separated_engine_equals_shared_then_trains_asynchronously_and_resumes(
    chat_tokenizer, prompt_data, tmp_path
):
    # One trainer rank and one engine rank. max_staleness 0: each batch generated from the
    # weights just sent, so every step equals the run in one process (same responses, rewards,
    # losses); a skipped weight sync would sample from the start's weights and fail it from
    # step 2. max_staleness 1: batch s generated during step s-1, from weights one update old.
    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    cfg = grpo_config(chat_tokenizer, prompt_data, tmp_path / "shared", rollout_correction="tis")
    cfg["train"].update({"threads": 1, "max_steps": 4})
    cfg["optim"] = {**cfg.get("optim", {}), "lr": 3e-3}  # steps that change the samples
    cfg["checkpoint"] = {"every": 2, "keep_last": 2}
    assert load("grpo").run(build_config(cfg)) == "completed"
    shared = [r for r in read_metrics(tmp_path / "shared") if "loss" in r]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))

    sync = run_cli(path, tmp_path / "sync", "grpo.placement=separated")
    assert len(sync) == len(shared) == 4
    assert len({r["reward_mean"] for r in shared}) > 1  # the policy moved: the samples changed
    for a, b in zip(shared, sync, strict=True):
        for key in ("reward_mean", "response_len_mean", "rollout_kl", "loss", "grad_norm", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
        assert b["staleness_max"] == 0 and b["weight_sync_s"] >= 0

    # two FSDP ranks a group (4 processes): each trainer rank sends its own shards as they lie
    # (FSDP leaves the root's gathered after the engine's forward: it is sharded again first)
    two = run_cli(path, tmp_path / "fsdp", "grpo.placement=separated", "train.grad_accum_steps=1", nproc=4)
    for a, b in zip(shared, two, strict=True):
        for key in ("reward_mean", "loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    # LoRA: after the first sync the adapters alone travel
    cfg_l = {**cfg, "lora": {"rank": 4, "alpha": 8}, "optim": {**cfg["optim"], "lr": 3e-2}}
    cfg_l["output_dir"] = str(tmp_path / "l1")
    lora = tmp_path / "lora.yaml"
    lora.write_text(yaml.safe_dump(cfg_l))
    assert load("grpo").run(build_config(cfg_l)) == "completed"
    for a, b in zip(
        [r for r in read_metrics(tmp_path / "l1") if "loss" in r],
        run_cli(lora, tmp_path / "l2", "grpo.placement=separated"),
        strict=True,
    ):
        for key in ("reward_mean", "loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)

    async_ = run_cli(path, tmp_path / "async", "grpo.placement=separated", "grpo.max_staleness=1")
    # the first step generates batches 0 and 1 from the start's weights; then batch s from
    # the weights after step s-1, trained on after step s: one update old
    assert [r["staleness_max"] for r in async_] == [0, 1, 1, 1]
    assert async_[0]["loss"] == pytest.approx(shared[0]["loss"], rel=1e-5)
    assert async_[1]["reward_mean"] != pytest.approx(shared[1]["reward_mean"])  # stale samples
    assert all(r["rollout_is_weight_mean"] > 0 for r in async_)

    # cut after step 2 (a checkpoint) and resumed: the batches read ahead are not skipped (the
    # checkpoint's position is that of the next batch to train), and are generated again from
    # the checkpoint's weights
    cut = run_cli(
        path, tmp_path / "cut", "grpo.placement=separated", "grpo.max_staleness=1", "train.exit_at_step=2"
    )
    assert len(cut) == 2
    state = json.loads(
        (tmp_path / "cut" / "checkpoints" / "step_00000002" / "trainer_state.json").read_text()
    )
    whole = json.loads(
        (tmp_path / "async" / "checkpoints" / "step_00000002" / "trainer_state.json").read_text()
    )
    assert state["data"] == whole["data"] and state["data"]["consumed_samples"] == 2 * 2 * 2
    resumed = run_cli(
        path, tmp_path / "cut", "grpo.placement=separated", "grpo.max_staleness=1", "train.resume=auto"
    )
    resumed = [r for r in resumed if r["step"] > 2]
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["staleness_max"] for r in resumed] == [0, 1]
    final = json.loads(
        (tmp_path / "cut" / "checkpoints" / "step_00000004" / "trainer_state.json").read_text()
    )
    assert (
        final["data"]
        == json.loads(
            (tmp_path / "async" / "checkpoints" / "step_00000004" / "trainer_state.json").read_text()
        )["data"]
    )


def test_separated_placement_bad_input_is_refused_by_name(chat_tokenizer, prompt_data, tmp_path, capsys):
    from ladle.cli import main

    path = tmp_path / "c.yaml"

    def refused(message, nproc=None, **grpo):
        path.write_text(yaml.safe_dump(grpo_config(chat_tokenizer, prompt_data, tmp_path / "r", **grpo)))
        args = ["run", "grpo", "--config", str(path)]
        assert main(args) == 2
        assert message in capsys.readouterr().err

    refused("grpo.max_staleness", max_staleness=-1)
    refused(
        "grpo.max_staleness=2 generates while the trainer trains, which needs engine ranks of their own: "
        "set grpo.placement: separated",
        max_staleness=2,
    )
    refused(
        "grpo.placement=separated puts the trainer on one group of ranks and the engine (a copy of the policy "
        "that generates) on another: it needs a multiple of 2 ranks",
        placement="separated",
    )
    refused(
        "grpo.dynamic_sampling with grpo.placement=separated", placement="separated", dynamic_sampling=True
    )
    refused("grpo.rollout_correction_cap", rollout_correction_cap=1.0)
    assert not (tmp_path / "r").exists()
