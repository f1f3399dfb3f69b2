"""Non-finite and spike forensics (issue 18, part 1): a bad step names its samples and rank, a
spike is an event (and a skip), skips in a row roll the run back or stop it, the update-to-weight
ratio is a metric, and `ladle data show` prints the samples a report names."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ladle.checkpoint.catalogue import latest_checkpoint, read_trainer_state
from ladle.config.load import build_config
from ladle.config.schema import GuardConfig
from ladle.data.loader import BatchLayout, PackedSamples, SampleOrder
from ladle.data.prepare import open_split
from ladle.errors import ConfigError
from ladle.recipes import load
from ladle.train.guard import NONFINITE, OK, SPIKE, Guard
from ladle.train.loop import TrainingDiverged
from ladle.train.metrics import read_metrics
from ladle.train.optim import lr_multiplier


def config(tiny_config, guard=None, **faults) -> dict:
    cfg = dict(tiny_config)
    cfg["train"] = {**cfg["train"], "max_steps": 8, "eval_every": 0, "eval_steps": 0}
    cfg["checkpoint"] = {"every": 4, "keep_last": 2}
    cfg["sample"] = {"prompt": ""}
    cfg["faults"] = {"enabled": True, **faults}
    cfg["guard"] = {"window": 5, "min_history": 3, **(guard or {})}
    return cfg


def steps(out) -> list[dict]:
    return [r for r in read_metrics(out) if "loss" in r]


def warnings(out) -> list[str]:
    return [ln for ln in (Path(out) / "events.log").read_text().splitlines() if "WARNING" in ln]


# -- the guard's verdicts, against a formula ----------------------------------------------------
def test_a_spike_is_called_by_its_z_score_over_the_window():
    g = Guard(GuardConfig(window=4, min_history=3, z_threshold=3.0))
    history = [2.0, 2.2, 1.9, 2.1, 2.0]
    for x in history:
        assert g.judge(x, 1.0).kind == OK  # a constant gradient norm: the floor keeps it calm
    window = np.array(history[-4:])  # the window keeps the last 4
    z = (3.0 - window.mean()) / window.std(ddof=1)
    v = g.judge(3.0, 1.0)
    assert v.kind == SPIKE and not v.skip and f"is {z:.1f} standard deviations above its mean" in v.why
    assert list(g.history["loss"]) == [1.9, 2.1, 2.0, 3.0]  # logged, applied: the new normal

    skipping = Guard(GuardConfig(window=4, min_history=3, z_threshold=3.0, skip_spikes=True))
    for x in history:
        skipping.judge(x, 1.0)
    assert skipping.judge(3.0, 1.0).skip and list(skipping.history["loss"]) == list(window)
    assert skipping.judge(2.0, 50.0).why.startswith("spike: grad_norm 50")


def test_non_finite_steps_are_skipped_and_fp16s_inf_gradients_are_the_scalers():
    g = Guard(GuardConfig())
    assert g.judge(float("nan"), 1.0).kind == NONFINITE and g.judge(1.0, float("inf")).skip
    assert g.judge(1.0, float("inf"), scaled=True).kind == OK  # the scaler skips and backs off
    assert Guard(GuardConfig(min_history=2, window=2)).judge(1e9, 1e9).kind == OK  # no history yet
    g.judge(1.0, 2.0)
    again = Guard(GuardConfig())
    again.load_state_dict(json.loads(json.dumps(g.state_dict())))
    # the scaler's step counts its loss, not its inf gradient norm
    assert list(again.history["loss"]) == [1.0, 1.0] and list(again.history["grad_norm"]) == [2.0]


def test_a_moved_setting_says_where_it_went(tiny_config):
    with pytest.raises(ConfigError, match=r"train.max_bad_steps: this setting is now guard.max_skips"):
        build_config(tiny_config, ["train.max_bad_steps=2"])


# -- the update-to-weight ratio, against the weights before and after ------------------------
def test_the_update_ratio_is_the_update_norm_over_the_weight_norm(tiny_config):
    from ladle import distributed as dist
    from ladle.models.llama import build_model
    from ladle.parallel.mesh import Layout, Parallel
    from ladle.train.loss import CausalLMLoss
    from ladle.train.unit import TrainUnit

    cpu = torch.device("cpu")
    dist.init(cpu)
    cfg = build_config(tiny_config)
    torch.manual_seed(0)
    unit = TrainUnit(cfg, build_model(cfg.model, device=cpu, init=True), cpu, Parallel(Layout(), cpu))
    tokens = torch.randint(0, 512, (2, 17))
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    result = unit.forward_backward([batch], CausalLMLoss())
    old = [p.detach().clone() for p in unit.model.parameters()]
    got = unit.step(result.loss, measure=True).update_ratio
    new = list(unit.model.parameters())
    delta = torch.cat([(n.detach() - o).flatten() for n, o in zip(new, old, strict=True)])
    want = float(delta.norm() / torch.cat([o.flatten() for o in old]).norm())
    assert got == pytest.approx(want, rel=1e-4) and 0 < got < 1


# -- in a run -------------------------------------------------------------------------------
def test_a_spike_is_an_event_naming_its_samples_and_is_skipped(tiny_config):
    cfg = config(tiny_config, {"skip_spikes": True}, spike_at_step=6, spike_factor=1000.0)
    assert load("pretrain").run(build_config(cfg)) == "completed"
    got = steps(cfg["output_dir"])
    assert [r["skipped"] for r in got] == [False] * 5 + [True, False, False]
    (event,) = [w for w in warnings(cfg["output_dir"]) if "spike" in w]  # no false alarm elsewhere
    assert re.search(r"step 6: spike: loss [\d.]+ is [\d.]+ standard deviations above its mean", event)
    assert "update skipped (1/3 in a row)" in event and "highest loss on rank 0" in event
    assert "ladle data show" in event
    # what people watch for divergence, on every logged step that updated
    assert all(r["update_ratio"] > 0 for r in got if not r["skipped"])


def test_skips_in_a_row_roll_back_to_the_last_checkpoint_with_a_lower_lr(tiny_config):
    guard = {"skip_spikes": True, "max_skips": 1, "rollback_lr_factor": 0.5}
    cfg = config(tiny_config, guard, spike_at_step=6, spike_factor=1000.0)
    assert load("pretrain").run(build_config(cfg)) == "completed"
    out = cfg["output_dir"]
    (event,) = [w for w in warnings(out) if "rolled back" in w]
    assert "rolled back from step 6 to step_00000004 (rollback 1/3), lr x 0.5" in event
    got = steps(out)
    assert [r["step"] for r in got] == list(range(1, 9))  # the records of the undone steps dropped
    c = build_config(cfg)
    for r in got:
        factor = 0.5 if r["step"] > 4 else 1.0
        assert r["lr"] == pytest.approx(factor * 3e-3 * lr_multiplier(r["step"] - 1, c.scheduler, 8))
    state = read_trainer_state(latest_checkpoint(out))
    # the data went on past the two undone steps' batches (4 samples a step)
    assert state["data"]["consumed_samples"] == (8 + 2) * 4
    assert state["scheduler"]["base_lrs"] == [pytest.approx(1.5e-3)] * 2 and state["guard"]["rollbacks"] == 1


def test_with_no_checkpoint_to_roll_back_to_the_run_stops_with_the_report(tiny_config):
    cfg = config(tiny_config, {"max_skips": 1}, nan_at_step=2)
    cfg["checkpoint"] = {"every": 0}
    with pytest.raises(
        TrainingDiverged,
        match=r"1 skipped steps in a row, the last at step 2 \(non-finite loss.*non-finite loss on rank 0.*"
        r"samples \[.*Stopped \(no checkpoint to roll back to\)",
    ):
        load("pretrain").run(build_config(cfg))


def test_a_nan_on_one_rank_names_that_rank_and_its_samples(tiny_config, data_dir, tmp_path):
    cfg = config(tiny_config, nan_at_step=2, rank=1)
    cfg["train"] = {**cfg["train"], "max_steps": 3, "threads": 1}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "ladle", "run", "pretrain", "--config", str(path), "--nproc", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (event,) = [w for w in warnings(cfg["output_dir"]) if "non-finite" in w]
    # rank 1's slice of step 2: the loader's rule, computed here from its parts
    train = PackedSamples(open_split(data_dir, "train"), 32)
    order = SampleOrder(len(train), seed=7)
    want = [order(g) for idx in BatchLayout(2, 2, 1, 2).rank_indices(1 * 8) for g in idx]
    docs = sorted({d for i in want for d in train.documents(i)})
    assert (
        f"non-finite loss on rank 1 (loss nan over 128 targets): samples {want} of the train split" in event
    )
    assert f"ladle data show {data_dir} {' '.join(map(str, docs))}`" in event
    assert "rank 0" not in event.split("WARNING")[1]  # rank 0's loss was finite


def test_data_show_prints_the_documents_a_report_names(data_dir, corpus, capsys):
    from ladle.cli import main

    assert main(["data", "show", str(data_dir), "0", "1"]) == 0
    out = capsys.readouterr().out
    texts = [p.read_text() for p in sorted(corpus.iterdir())]
    shown = re.split(r"== document \d+ \([\d,]+ tokens\)\n", out)[1:]
    assert len(shown) == 2 and all(s.rstrip("\n") in {t.rstrip("\n") for t in texts} for s in shown)
    n = open_split(data_dir, "train").num_documents
    assert main(["data", "show", str(data_dir), str(n)]) == 2
    assert f"no document {n} in the train split, which holds {n} (0 to {n - 1})" in capsys.readouterr().err


def test_data_show_prints_a_chat_and_its_trained_tokens(sort_chats, capsys):
    from ladle.cli import main

    assert main(["data", "show", str(sort_chats), "0", "--json"]) == 0
    (rec,) = json.loads(capsys.readouterr().out)["records"]
    answers = [
        m["content"]
        for line in (sort_chats.parent / "task" / "train.jsonl").read_text().splitlines()
        for m in json.loads(line)["messages"]
        if m["role"] == "assistant"
    ]
    assert rec["chat"] == 0 and 0 < rec["trained"] < rec["tokens"]
    assert any(a in rec["trained_text"] for a in answers) and rec["trained_text"] in rec["text"]
    assert not math.isnan(rec["tokens"])
