"""The hang watchdog (issue 18, part 2): a rank made to sleep inside a step is named within the
timeout, every rank's stacks are dumped, and the job exits non-zero for the launcher to restart."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ladle.config.load import build_config
from ladle.errors import ConfigError
from ladle.watchdog import EXIT_HANG, describe_hang, flight_recorder_env


def test_a_sleeping_rank_is_named_every_stack_dumped_and_the_job_exits(tiny_config, tmp_path):
    cfg = dict(tiny_config)
    cfg["train"] = {**cfg["train"], "max_steps": 4, "eval_every": 0, "eval_steps": 0, "threads": 1}
    cfg["sample"] = {"prompt": ""}
    cfg["faults"] = {"enabled": True, "sleep_at_step": 2, "sleep_rank": 1, "sleep_s": 120.0}
    cfg["watchdog"] = {"timeout_s": 4}
    cfg["dist"] = {"timeout_s": 100}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "ladle", "run", "pretrain", "--config", str(path), "--nproc", "2"]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - t0
    assert r.returncode != 0 and took < 90, (took, r.stdout[-2000:] + r.stderr[-2000:])
    assert f"exitcode  : {EXIT_HANG}" in r.stdout + r.stderr  # torchrun's summary of the failed ranks
    hang = Path(cfg["output_dir"]) / "hang"
    report = (hang / "report.txt").read_text()
    assert "Not in a collective while others wait in one: rank 1." in report
    assert "rank 1: 'faults: sleep 120 s' at step 2" in report
    assert "rank 0: 'collective: all_reduce (the loss count of the batch)' at step 2" in report
    assert report in (Path(cfg["output_dir"]) / "events.log").read_text()
    stacks = {r: (hang / f"stacks_rank{r}.txt").read_text() for r in (0, 1)}
    assert "faults.py" in stacks[1] and "in stop" in stacks[1]  # where rank 1 stopped
    assert "unit.py" in stacks[0] and "forward_backward" in stacks[0]  # where rank 0 waits


def test_a_rank_whose_heartbeat_stopped_is_named_dead():
    now = 1000.0
    beats = {
        0: {"phase": "collective: barrier", "step": 7, "for_s": 30.0, "at": now - 1},
        1: {"phase": "forward", "step": 7, "for_s": 2.0, "at": now - 200, "host": "node-b"},
        2: None,
    }
    text = describe_hang(0, 60, beats, now, 60, Path("/run/hang"))
    assert "Dead or lost: ranks 1, 2." in text
    assert (
        "rank 1: no heartbeat for 200 s (dead, or its host node-b is lost); last in 'forward' at step 7"
        in text
    )
    assert "rank 2: no heartbeat ever" in text and "rank 0: 'collective: barrier' at step 7 for 31 s" in text
    assert "Not in a collective" not in text  # the waiting rank is not to blame
    assert f"exiting with status {EXIT_HANG}" in text


def test_the_nccl_flight_recorder_is_on_under_cuda_with_its_dump_beside_the_stacks(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")  # a user's own setting wins
    env = flight_recorder_env("cuda", "/run/hang")
    assert env == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/run/hang/nccl_trace_rank_",
    }
    assert flight_recorder_env("cpu", "/run/hang") == {} == flight_recorder_env("npu", "/run/hang")


def test_the_watchdog_must_fire_before_the_collective_timeout(tiny_config):
    with pytest.raises(ConfigError, match=r"watchdog.timeout_s \(700\) must be below dist.timeout_s \(600\)"):
        build_config(tiny_config, ["watchdog.timeout_s=700"])
    assert build_config(tiny_config, ["watchdog.timeout_s=0"]).watchdog.timeout_s == 0
