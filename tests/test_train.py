"""The pretrain recipe end to end on a tiny model: resume equivalence, signals, guards, precision,
checkpoint safety, and the run directory's files."""

import errno
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from ladle.checkpoint.catalogue import latest_checkpoint
from ladle.cli import main
from ladle.config.load import build_config
from ladle.errors import CheckpointError, ConfigError, DataError
from ladle.recipes import pretrain
from ladle.train.metrics import read_metrics

DESIGN_FIELDS = {
    "step",
    "tokens",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "mfu",
    "step_s",
    "data_s",
    "fwd_bwd_s",
    "optim_s",
    "mem_peak_bytes",
}


def run(cfg_dict, *overrides):
    return pretrain.run(build_config(cfg_dict, list(overrides)))


def losses(run_dir):
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(run_dir) if "loss" in r}


def val_losses(run_dir):
    return {r["step"]: r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r}


def test_resume_gives_identical_losses(tiny_config, tmp_path):
    full = tmp_path / "full"
    assert run(tiny_config, f"output_dir={full}") == "completed"
    split = tmp_path / "split"
    assert run(tiny_config, f"output_dir={split}", "train.exit_at_step=10") == "exit"
    assert latest_checkpoint(split).name == "step_00000010"
    assert run(tiny_config, f"output_dir={split}", "train.resume=auto") == "completed"
    events = (split / "events.log").read_text()
    assert "resumed from" in events and "train.exit_at_step: 10 -> 0" in events
    a, b = losses(full), losses(split)
    assert sorted(a) == sorted(b) == list(range(1, 21))
    assert a == b  # bit-identical: same weights, optimizer state, schedule and samples
    assert val_losses(full) == val_losses(split)
    assert a[20][0] < a[1][0]


def test_metrics_run_card_and_checkpoint_layout(tiny_config):
    run(tiny_config)
    out = Path(tiny_config["output_dir"])
    recs = read_metrics(out)
    steps = [r for r in recs if "loss" in r]
    assert len(steps) == 20 and DESIGN_FIELDS <= set(steps[0])
    assert steps[-1]["tokens"] == 20 * 2 * 2 * 32
    assert all(r["data_s"] >= 0 and r["mfu"] > 0 for r in steps)
    assert [r["step"] for r in recs if "val_loss" in r] == [5, 10, 15, 20]
    card = json.loads((out / "run_card.json").read_text())
    assert card["status"] == "completed" and card["world_size"] == 1
    assert len(card["config_hash"]) == 64 and "measured" in card["mfu_peak_source"]
    assert card["final"]["step"] == 20 and "val_loss" in card["final"] and "sample" in card["final"]
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["latest", "step_00000015", "step_00000020"]  # keep_last=2
    step = out / "checkpoints" / "step_00000020"
    assert {"trainer_state.json", "config.yaml", "rng", ".metadata"} <= {p.name for p in step.iterdir()}
    state = json.loads((step / "trainer_state.json").read_text())
    assert state["step"] == 20 and state["data"]["consumed_samples"] == 20 * 4
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["max_steps"] == 20
    assert "checkpoint saved: step 20" in (out / "events.log").read_text()


def test_gradient_accumulation_matches_a_single_big_batch(tiny_config, tmp_path):
    # 1 microbatch of 8 against 8 microbatches of 1: the same loss and gradient norm.
    run(
        tiny_config,
        f"output_dir={tmp_path / 'a'}",
        "train.micro_batch_size=8",
        "train.grad_accum_steps=1",
        "train.max_steps=3",
        "train.eval_steps=0",
    )
    run(
        tiny_config,
        f"output_dir={tmp_path / 'b'}",
        "train.micro_batch_size=1",
        "train.grad_accum_steps=8",
        "train.max_steps=3",
        "train.eval_steps=0",
    )
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    for s in a:
        assert a[s][0] == pytest.approx(b[s][0], rel=1e-5)
        assert a[s][1] == pytest.approx(b[s][1], rel=1e-4)


def test_refuses_to_start_over_a_runs_checkpoints(tiny_config):
    run(tiny_config, "train.max_steps=3", "scheduler.warmup_steps=1")
    out = Path(tiny_config["output_dir"])
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(ConfigError, match="already holds checkpoints .* set train.resume=auto"):
        run(tiny_config, "train.max_steps=3", "scheduler.warmup_steps=1", "optim.lr=1e-3")
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_resume_refuses_another_model_shape(tiny_config):
    run(tiny_config, "train.max_steps=3", "scheduler.warmup_steps=1")
    with pytest.raises(CheckpointError, match=r"model differs in model.dim \(32 there, 64 here\)"):
        run(tiny_config, "train.max_steps=6", "scheduler.warmup_steps=1", "train.resume=auto", "model.dim=64")


def test_full_disk_keeps_the_previous_checkpoint(tiny_config, monkeypatch):
    import torch.distributed.checkpoint as dcp

    real_save = dcp.save
    calls = {"n": 0}

    def flaky_save(state, checkpoint_id):
        calls["n"] += 1
        if calls["n"] == 2:  # the second save: write part of it, then the disk is full
            real_save({"model": state["model"]}, checkpoint_id=checkpoint_id)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(dcp, "save", flaky_save)
    with pytest.raises(CheckpointError, match="No space left on device.*step_00000005 is intact"):
        run(tiny_config)
    out = Path(tiny_config["output_dir"])
    assert latest_checkpoint(out).name == "step_00000005"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_00000005"]
    monkeypatch.setattr(dcp, "save", real_save)
    assert run(tiny_config, "train.resume=auto") == "completed"  # and it resumes from there


def test_async_checkpoints_complete_and_resume(tiny_config, tmp_path):
    assert run(tiny_config, "checkpoint.async_save=true", "train.exit_at_step=10") == "exit"
    out = Path(tiny_config["output_dir"])
    assert latest_checkpoint(out).name == "step_00000010"
    assert "loop stalled" in (out / "events.log").read_text()
    run(tiny_config, "checkpoint.async_save=true", "train.resume=auto")
    run(tiny_config, f"output_dir={tmp_path / 'sync'}")
    assert losses(out) == losses(tmp_path / "sync")


def test_non_finite_loss_never_reaches_the_weights(tiny_config):
    from ladle import device as dev
    from ladle import distributed as dist
    from ladle.launch.checks import check
    from ladle.recipes import base, pretrain
    from ladle.train import loop
    from ladle.train.loss import CausalLMLoss

    cfg = build_config(tiny_config, ["train.eval_steps=0", "checkpoint.every=0"])
    cpu = torch.device("cpu")
    dist.init(cpu)
    trainer = base.build_trainer(pretrain.RECIPE, cfg, cpu, check(cfg), None)
    weights = {}

    class NaNFromStepThree(CausalLMLoss):
        calls = 0

        def __call__(self, model, batch):
            self.calls += 1
            if self.calls == 5:  # the first microbatch of step 3: keep the weights after step 2
                weights.update({k: v.clone() for k, v in model.state_dict().items()})
            out = super().__call__(model, batch)
            if self.calls > 4:  # 2 microbatches a step
                out.sum = out.sum * float("nan")
            return out

    trainer.loss = NaNFromStepThree()
    with pytest.raises(
        loop.TrainingDiverged, match=r"3 skipped steps in a row, the last at step 5 \(non-finite loss"
    ):
        trainer.fit()
    trainer.loader.close()
    assert dev.synchronize(cpu) is None and weights
    after = trainer.model.state_dict()
    assert all(torch.equal(weights[k], after[k]) for k in weights)  # no update from a bad step
    events = (Path(cfg.output_dir) / "events.log").read_text()
    assert "step 3: non-finite loss (nan)" in events and "update skipped (1/3 in a row)" in events
    assert "update skipped (3/3 in a row)" in events


@pytest.mark.parametrize("mode", ["bf16-mixed", "fp16-mixed", "bf16"])
def test_precision_modes_train(tiny_config, mode):
    # fp16 matmuls on the CPU run on slow reference kernels: keep this short
    run(
        tiny_config,
        f"precision.mode={mode}",
        "train.max_steps=3",
        "scheduler.warmup_steps=1",
        "train.eval_every=0",
        "checkpoint.every=0",
        "train.grad_accum_steps=1",
    )
    recs = [r for r in read_metrics(tiny_config["output_dir"]) if "loss" in r]
    assert len(recs) == 3 and all(r["loss"] is not None for r in recs)
    if mode == "fp16-mixed":
        assert recs[0]["loss_scale"] == 2.0**16
    else:
        assert "loss_scale" not in recs[0]


@pytest.mark.parametrize(
    "mode, bf16, fp32, resolved, said",
    [
        (
            "auto",
            0.001,
            0.12,
            "fp32",
            "precision.mode=auto: fp32 (this CPU's bf16 GEMM runs at 0.001 TFLOP/s",
        ),
        (
            "auto",
            0.40,
            0.20,
            "bf16-mixed",
            "precision.mode=auto: bf16-mixed (this CPU's bf16 GEMM runs at 0.400",
        ),
        ("bf16-mixed", 0.001, 0.12, "bf16-mixed", "precision.mode=bf16-mixed on a CPU that emulates bf16"),
        ("bf16-mixed", 0.40, 0.20, "bf16-mixed", None),
        ("fp32", 0.001, 0.12, "fp32", None),
    ],
)
def test_precision_auto_takes_bf16_only_where_the_cpu_computes_it(
    tiny_config, monkeypatch, mode, bf16, fp32, resolved, said
):
    from ladle import device as dev
    from ladle.train.precision import resolve_mode

    monkeypatch.setattr(dev, "measure_gemm_tflops", lambda device, name: {"bf16": bf16, "fp32": fp32}[name])
    cfg, note = resolve_mode(build_config(tiny_config, [f"precision.mode={mode}"]), torch.device("cpu"))
    assert cfg.precision.mode == resolved
    assert note == said if said is None else note.startswith(said)


def test_precision_auto_runs_and_records_the_mode_it_chose(tiny_config):
    run(
        tiny_config,
        "precision.mode=auto",
        "train.max_steps=3",
        "scheduler.warmup_steps=1",
        "train.eval_every=0",
    )
    out = Path(tiny_config["output_dir"])
    chosen = yaml.safe_load((out / "config.yaml").read_text())["precision"]["mode"]
    assert chosen in ("fp32", "bf16-mixed")
    assert f"precision.mode=auto: {chosen} (this CPU's bf16 GEMM runs at" in (out / "events.log").read_text()


def test_data_made_with_another_tokenizer_is_refused(tiny_config, corpus, tmp_path):
    from ladle.data.tokenizer import train_tokenizer

    other = train_tokenizer([str(corpus)], vocab_size=300, output=str(tmp_path / "other"))
    with pytest.raises(DataError, match="prepared with a different tokenizer"):
        run(tiny_config, f"tokenizer.path={other}")
    assert not Path(tiny_config["output_dir"]).exists()


def test_missing_data_says_to_prepare_it(tiny_config, tmp_path):
    with pytest.raises(DataError, match="run `ladle data prepare` first"):
        run(tiny_config, f"data.path={tmp_path / 'nope'}")


def test_vocab_larger_than_the_model_is_refused(tiny_config):
    with pytest.raises(ConfigError, match=r"model.vocab_size \(300\) is smaller than the vocabulary"):
        run(tiny_config, "model.vocab_size=300")


def ladle_cmd(*args: str) -> list[str]:
    """The `ladle` command as a subprocess of this interpreter."""
    return [sys.executable, "-m", "ladle", *args]


def _write_config(cfg_dict, path, **train):
    cfg = json.loads(json.dumps(cfg_dict))
    cfg["train"].update(train)
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_sigterm_saves_and_resume_continues_exactly(tiny_config, tmp_path):
    cfg_file = _write_config(tiny_config, tmp_path / "c.yaml", max_steps=20)
    full = tmp_path / "full"
    assert main(["run", "pretrain", "--config", str(cfg_file), f"output_dir={full}"]) == 0
    out = tmp_path / "term"
    cmd = ladle_cmd("run", "pretrain", "--config", str(cfg_file), f"output_dir={out}", "checkpoint.every=0")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    metrics = out / "metrics.jsonl"
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, text
    stopped = latest_checkpoint(out)
    assert stopped is not None and "stopped at step" in text and "SIGTERM" in text
    k = int(stopped.name.split("_")[1])
    assert 1 <= k < 20
    assert (
        main(
            [
                "run",
                "pretrain",
                "--config",
                str(cfg_file),
                f"output_dir={out}",
                "checkpoint.every=0",
                "train.resume=auto",
            ]
        )
        == 0
    )
    assert losses(out) == losses(full)


def test_cli_run_exit_codes(tiny_config, tmp_path, capsys):
    cfg_file = _write_config(tiny_config, tmp_path / "c.yaml", max_steps=2)
    assert main(["run", "pretrain", "--config", str(cfg_file), "scheduler.warmup_steps=1"]) == 0
    assert main(["run", "pretrain", "--config", str(cfg_file), "scheduler.warmup_steps=1"]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err
    assert main(["run", "pretrian", "--config", str(cfg_file)]) == 2
    assert "did you mean 'pretrain'" in capsys.readouterr().err
    assert main(["validate", "--config", str(cfg_file), "model.n_head=2"]) == 2
    assert "did you mean 'model.n_heads'" in capsys.readouterr().err
    assert main(["validate", "--config", str(cfg_file), "scheduler.warmup_steps=1"]) == 0
    assert "max_steps: 2" in capsys.readouterr().out


@pytest.mark.slow
def test_compiled_blocks_train_like_eager(tiny_config, tmp_path):
    # train.compile: inductor-compiled blocks give the eager losses (to fusion rounding), a
    # validation under no_grad and the end-of-run sample work, and checkpoint names are unchanged.
    common = ["train.max_steps=4", "train.eval_every=2", "scheduler.warmup_steps=1", "precision.mode=fp32"]
    run(tiny_config, f"output_dir={tmp_path / 'eager'}", *common)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    run(tiny_config, f"output_dir={tmp_path / 'compiled'}", *common, "train.compile=true")
    assert counters["stats"]["unique_graphs"] > graphs  # it did compile
    a, b = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for s in a:
        assert b[s][0] == pytest.approx(a[s][0], rel=1e-4)
    assert val_losses(tmp_path / "compiled")[4] == pytest.approx(val_losses(tmp_path / "eager")[4], rel=1e-4)
    metadata = (latest_checkpoint(tmp_path / "compiled") / ".metadata").read_bytes()
    assert b"_orig_mod" not in metadata and b"layers.0.mlp.up_proj.weight" in metadata


def _hf_checkpoint(folder, qwen3=False):
    """A random tiny transformers checkpoint with tiny_config's shape."""
    import transformers as tf

    kw = dict(
        vocab_size=512,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    cls, conf = (tf.Qwen3ForCausalLM, tf.Qwen3Config) if qwen3 else (tf.LlamaForCausalLM, tf.LlamaConfig)
    model = cls(conf(**kw, **({"head_dim": 12} if qwen3 else {})))  # head_dim != dim / heads
    model.save_pretrained(folder)
    return {k.removeprefix("model."): v for k, v in model.state_dict().items()}


def test_init_from_starts_from_the_hf_weights_and_shape(tiny_config, tmp_path, capsys):
    hf_weights = _hf_checkpoint(tmp_path / "hf", qwen3=True)
    cfg = {**tiny_config, "model": {"init_from": str(tmp_path / "hf"), "max_seq_len": 64}}
    assert main(["validate", "--config", str(_write_config(cfg, tmp_path / "c.yaml"))]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)["model"]
    assert shown["family"] == "qwen3" and shown["head_dim"] == 12 and shown["max_seq_len"] == 64
    run(cfg, "train.max_steps=1", "optim.lr=1e-12", "scheduler.name=constant", "train.eval_every=0")
    out = Path(tiny_config["output_dir"])
    saved = yaml.safe_load((out / "config.yaml").read_text())["model"]
    assert (
        saved["family"] == "qwen3"
        and saved["qk_norm"]
        and saved["head_dim"] == 12
        and saved["max_seq_len"] == 64
    )
    assert "weights from" in (out / "events.log").read_text()
    from ladle.ops.export import load_any_model

    model, _ = load_any_model(latest_checkpoint(out))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, hf_weights[name], atol=1e-6, rtol=0)  # lr 1e-12: untouched


def test_init_from_refuses_a_conflicting_shape(tiny_config, tmp_path):
    _hf_checkpoint(tmp_path / "hf")
    tiny_config["model"] = {**tiny_config["model"], "init_from": str(tmp_path / "hf")}
    run(tiny_config, "train.max_steps=3", "train.eval_every=0")  # the same shape spelled out: fine
    # head_dim written out as dim / n_heads (8) is the shape the checkpoint has too
    run(
        tiny_config,
        "train.max_steps=3",
        "train.eval_every=0",
        "model.head_dim=8",
        f"output_dir={tmp_path / 'hd'}",
    )
    with pytest.raises(ConfigError, match=r"model.dim=48 \(config.json: 32\).*remove those keys"):
        run(tiny_config, "model.dim=48", f"output_dir={tmp_path / 'other'}")
    assert not (tmp_path / "other").exists()
    with pytest.raises(CheckpointError, match="no config.json"):
        run(tiny_config, f"model.init_from={tmp_path}", f"output_dir={tmp_path / 'other'}")


TINY_MOE = {"family": "qwen3_moe", "qk_norm": True, "moe": {"n_experts": 4, "top_k": 2, "ffn_dim": 16}}


def test_moe_trains_and_records_expert_load(tiny_config, tmp_path):
    tiny_config["model"] = {**tiny_config["model"], **TINY_MOE}
    tiny_config["train"]["eval_every"] = 0
    assert run(tiny_config, "train.max_steps=8") == "completed"
    recs = [r for r in read_metrics(tiny_config["output_dir"]) if "loss" in r]
    for r in recs:
        # 2 microbatches x 2 rows x 32 tokens x top_k 2 = 256 assignments per layer, over 4 experts
        assert 0 <= r["moe_tokens_min"] <= 256 / 4 <= r["moe_tokens_max"] <= 256
        assert r["moe_imbalance"] == pytest.approx(r["moe_imbalance"]) and r["moe_imbalance"] >= 1.0
        assert r["moe_aux_loss"] >= 2.0 - 1e-4  # top_k when perfectly balanced, more otherwise
        assert r["moe_z_loss"] > 0
    assert recs[-1]["loss"] < recs[0]["loss"]
    events = (Path(tiny_config["output_dir"]) / "events.log").read_text()
    assert "experts a token uses" in events

    # The logged loss is the language-model loss; the router losses only add to the gradient.
    def first_step(aux, z, name):
        run(tiny_config, "train.max_steps=1", "scheduler.name=constant", f"model.moe.aux_loss_weight={aux}",
            f"model.moe.z_loss_weight={z}", f"output_dir={tmp_path / name}")  # fmt: skip
        return losses(tmp_path / name)[1]

    plain, weighted = first_step(0, 0, "plain"), first_step(10.0, 1.0, "weighted")
    assert weighted[0] == plain[0] and weighted[1] != plain[1]


def test_moe_init_from_keeps_the_runs_loss_weights(tiny_config, tmp_path, capsys):
    import transformers as tf

    conf = tf.Qwen3MoeConfig(
        vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        max_position_embeddings=256, router_aux_loss_coef=0.01,
    )  # fmt: skip
    tf.Qwen3MoeForCausalLM(conf).save_pretrained(tmp_path / "hf")
    model = {"init_from": str(tmp_path / "hf"), "max_seq_len": 64, "moe": {"z_loss_weight": 0.1}}
    cfg = {**tiny_config, "model": model}
    assert main(["validate", "--config", str(_write_config(cfg, tmp_path / "c.yaml"))]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)["model"]
    assert shown["family"] == "qwen3_moe"
    assert shown["moe"] == {
        "n_experts": 4, "top_k": 2, "ffn_dim": 16, "norm_topk_prob": True,
        "aux_loss_weight": 0.01, "z_loss_weight": 0.1, "dispatch": "auto",
        # Qwen3-MoE's softmax router: DeepSeek's fields keep their plain defaults
        "scoring": "softmax", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
        "n_shared_experts": 0, "dense_layers": 0, "bias_update_rate": 0.0, "aux_loss_scope": "batch",
    }  # fmt: skip
    model["moe"]["n_experts"] = 8
    with pytest.raises(ConfigError, match=r"model.moe.n_experts=8 \(config.json: 4\)"):
        run({**tiny_config, "model": model})
