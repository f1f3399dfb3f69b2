"""The config's fault switches (`faults.*`, ladle/faults.py): each fault ends with the run
continuing correctly or stopping with the cause named. The rest of issue 18's suite joins here."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ladle.config.load import build_config
from ladle.recipes import load
from ladle.train.loop import TrainingDiverged
from ladle.train.metrics import read_metrics


def config(tiny_config, **faults) -> dict:
    cfg = dict(tiny_config)
    cfg["train"] = {**cfg["train"], "max_steps": 4, "eval_every": 0, "eval_steps": 0}
    cfg["checkpoint"] = {"every": 2, "keep_last": 2}
    cfg["sample"] = {"prompt": ""}
    cfg["faults"] = {"enabled": True, **faults}
    return cfg


def steps(out) -> list[dict]:
    return [r for r in read_metrics(out) if "loss" in r]


def test_a_switch_is_refused_unless_enabled(tiny_config, tmp_path, capsys):
    from ladle.cli import main

    cfg = config(tiny_config, nan_at_step=2)
    cfg["faults"]["enabled"] = False
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["validate", "--config", str(path), "--no-paths"]) == 2
    assert "faults.nan_at_step=2 injects a fault on purpose" in capsys.readouterr().err
    assert main(["validate", "--config", str(path), "--no-paths", "faults.enabled=true"]) == 0


def test_a_nan_step_is_skipped_and_the_run_continues(tiny_config, tmp_path, capsys):
    whole = config(tiny_config)
    whole["output_dir"] = str(tmp_path / "whole")
    assert load("pretrain").run(build_config(whole)) == "completed"
    cfg = config(tiny_config, nan_at_step=2)
    assert load("pretrain").run(build_config(cfg)) == "completed"
    assert "faults: NaN loss at step 2 on rank 0" in capsys.readouterr().out
    got, ref = steps(cfg["output_dir"]), steps(whole["output_dir"])
    assert [r["skipped"] for r in got] == [False, True, False, False]
    assert got[1]["loss"] is None  # NaN, written as null in metrics.jsonl
    events = (Path(cfg["output_dir"]) / "events.log").read_text()
    assert "step 2: non-finite loss (nan)" in events and "update skipped (1/3 in a row)" in events
    # the report names the rank and the samples of the batch, and how to see them
    assert "non-finite loss on rank 0 (loss nan over" in events and "ladle data show" in events
    # the weights never saw the NaN: step 1 as the clean run, and step 3 trains on finite numbers
    assert (
        got[0]["loss"] == ref[0]["loss"]
        and math.isfinite(got[2]["loss"])
        and math.isfinite(got[3]["grad_norm"])
    )


def test_nan_steps_in_a_row_stop_the_run_naming_the_last_good_checkpoint(tiny_config):
    cfg = config(tiny_config, nan_at_step=3)
    cfg["guard"] = {"max_skips": 1, "on_max_skips": "stop"}
    with pytest.raises(
        TrainingDiverged,
        match=r"1 skipped steps in a row, the last at step 3 \(non-finite loss.*guard.on_max_skips=stop.*"
        r"last good checkpoint: \S+/checkpoints/step_00000002\)",
    ):
        load("pretrain").run(build_config(cfg))


def test_a_spike_multiplies_that_steps_loss(tiny_config, tmp_path):
    whole = config(tiny_config)
    whole["output_dir"] = str(tmp_path / "whole")
    assert load("pretrain").run(build_config(whole)) == "completed"
    cfg = config(tiny_config, spike_at_step=2, spike_factor=50.0)
    assert load("pretrain").run(build_config(cfg)) == "completed"
    got, ref = steps(cfg["output_dir"]), steps(whole["output_dir"])
    assert got[1]["loss"] == pytest.approx(50.0 * ref[1]["loss"], rel=1e-5)
    assert all(math.isfinite(r["loss"]) for r in got)


def run_cli(cfg: dict, tmp_path, *args) -> subprocess.CompletedProcess:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "ladle", "run", "pretrain", "--config", str(path), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_a_killed_rank_dies_after_its_step_and_the_resume_continues(tiny_config, tmp_path):
    cfg = config(tiny_config, kill_at_step=3)
    r = run_cli(cfg, tmp_path)
    assert r.returncode != 0 and "faults: kill at step 3 on rank 0" in r.stdout
    assert [x["step"] for x in steps(cfg["output_dir"])] == [1, 2]  # killed before step 3's record
    cfg["faults"] = {"enabled": False}  # the rehearsal's second attempt
    cfg["train"]["resume"] = "auto"
    r = run_cli(cfg, tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert [x["step"] for x in steps(cfg["output_dir"])][-2:] == [3, 4]  # from the step-2 checkpoint


def test_a_sleeping_rank_holds_the_others_in_the_first_collective(tiny_config, tmp_path):
    cfg = config(tiny_config, sleep_at_step=2, sleep_rank=1, sleep_s=3.0)
    cfg["train"]["threads"] = 1
    r = run_cli(cfg, tmp_path, "--nproc", "2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "faults: rank 1 sleeps 3 s in step 2" in r.stdout
    got = steps(cfg["output_dir"])  # rank 0 logs: its step 2 waited for rank 1
    assert got[1]["step_s"] >= 2.5 > got[2]["step_s"]


def test_the_collective_timeout_is_the_configs(tiny_config, monkeypatch):
    from ladle import distributed

    seen = []
    real = distributed.init
    monkeypatch.setattr(
        distributed,
        "init",
        lambda device, timeout_s=600.0, **kw: seen.append(timeout_s) or real(device, timeout_s),
    )
    cfg = config(tiny_config)
    cfg["train"]["max_steps"] = 1
    cfg["scheduler"] = {"name": "constant", "warmup_steps": 0}
    cfg["dist"] = {"timeout_s": 42}
    cfg["watchdog"] = {"timeout_s": 20}  # below it, to name a hung rank first
    assert load("pretrain").run(build_config(cfg)) == "completed"
    assert seen == [42.0]
