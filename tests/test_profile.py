"""Profiled steps (`profiler.*`): traces written, the step-time table, and the loop's warnings."""

import json
from pathlib import Path

import pytest
import yaml

from ladle.cli import main
from ladle.config.schema import ProfilerConfig
from ladle.train.profile import Warnings, breakdown, table


def run(tiny_config, tmp_path, *overrides, nproc=1):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config))
    args = ["run", "pretrain", "--config", str(cfg), *overrides]
    if nproc > 1:
        import subprocess
        import sys

        proc = subprocess.run(
            [sys.executable, "-m", "ladle", *args, "--nproc", str(nproc)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        assert main(args) == 0
    return Path(tiny_config["output_dir"])


def test_profiled_steps_write_a_trace_and_the_breakdown(tiny_config, tmp_path, capsys):
    out = run(
        tiny_config,
        tmp_path,
        "profiler.enabled=true",
        "profiler.start_step=3",
        "profiler.steps=2",
        "train.max_steps=6",
    )
    trace = out / "profile" / "rank0.steps3-4.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::mm") for e in events)  # the step's matmuls are in it
    card = json.loads((out / "run_card.json").read_text())["profile"]
    parts = ("compute_s", "comm_exposed_s", "data_wait_s", "optimizer_s", "host_overhead_s")
    assert card["step_s"] > 0 and sum(card[k] for k in parts) == pytest.approx(card["step_s"], rel=1e-6)
    assert card["comm_exposed_s"] == 0 and card["comm_share"] == 0  # one process: no collectives
    text = capsys.readouterr().out
    assert "step time by category, steps 3-4" in text and "host overhead" in text
    assert "step time by category" in (out / "events.log").read_text()


def test_a_profile_longer_than_the_run_ends_with_it(tiny_config, tmp_path):
    out = run(
        tiny_config,
        tmp_path,
        "profiler.enabled=true",
        "profiler.start_step=3",
        "profiler.steps=10",
        "train.max_steps=4",
        "train.eval_every=0",
    )
    assert (out / "profile" / "rank0.steps3-4.pt.trace.json").is_file()
    assert json.loads((out / "run_card.json").read_text())["profile"]["step_s"] > 0


@pytest.mark.slow
def test_two_ranks_see_their_collectives(tiny_config, tmp_path):
    out = run(
        tiny_config,
        tmp_path,
        "profiler.enabled=true",
        "profiler.start_step=2",
        "profiler.steps=2",
        "train.max_steps=4",
        "parallel.dp_shard=2",
        nproc=2,
    )
    assert (out / "profile" / "rank1.steps2-3.pt.trace.json").is_file()
    card = json.loads((out / "run_card.json").read_text())["profile"]
    assert card["comm_exposed_s"] > 0 and 0 < card["comm_share"] < 1


def test_breakdown_of_an_accelerator_trace_splits_exposed_and_overlapped():
    # compute kernels 0-100 and 150-200 us; an NCCL kernel 80-170 us: 40 us overlapped, 50 exposed
    k = lambda name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    trace = {
        "traceEvents": [
            k("ampere_gemm", 0, 100),
            k("ncclDevKernel_AllGather", 80, 90),
            k("flash_fwd", 150, 50),
        ]
    }
    timers = {"step_s": 400e-6, "data_s": 20e-6, "fwd_bwd_s": 300e-6, "optim_s": 30e-6}
    b = breakdown(trace, timers, 1)
    assert b["compute_s"] == pytest.approx(150e-6) and b["comm_overlapped_s"] == pytest.approx(40e-6)
    assert b["comm_exposed_s"] == pytest.approx(50e-6) and b["comm_share"] == pytest.approx(90 / 400)
    assert b["host_overhead_s"] == pytest.approx((400 - 20 - 30 - 150 - 50) * 1e-6)


def test_an_rl_step_s_generation_is_its_own_category_not_data_wait():
    # the rollouts of an RL step (gen_s) are a row of their own; a run without them shows none
    timers = {"step_s": 400e-6, "data_s": 20e-6, "gen_s": 200e-6, "fwd_bwd_s": 100e-6, "optim_s": 30e-6}
    b = breakdown({"traceEvents": []}, timers, 1)
    assert b["generation_s"] == pytest.approx(200e-6) and b["data_wait_s"] == pytest.approx(20e-6)
    assert b["host_overhead_s"] == pytest.approx((400 - 20 - 200 - 100 - 30) * 1e-6)
    assert "  generation " in table(b, 1, 1)
    plain = breakdown({"traceEvents": []}, {**timers, "gen_s": 0.0}, 1)
    assert "generation_s" not in plain and "generation" not in table(plain, 1, 1)


def test_warnings_for_data_wait_and_low_mfu_are_said_once():
    w = Warnings(ProfilerConfig(mfu_floor=0.2, patience=2), accelerator=True)
    assert w.check({"step": 10, "step_s": 1.0, "data_s": 0.1, "mfu": 0.1}) == []
    said = w.check({"step": 20, "step_s": 1.0, "data_s": 0.3, "mfu": 0.1})
    assert len(said) == 2 and "data wait is 30% of the step time" in said[0] and "MFU 10.0%" in said[1]
    assert w.check({"step": 30, "step_s": 1.0, "data_s": 0.5, "mfu": 0.05}) == []
    cpu = Warnings(ProfilerConfig(), accelerator=False)
    assert cpu.check({"step": 1, "step_s": 1.0, "data_s": 0.0, "mfu": 0.001}) == []  # MFU: accelerators only
