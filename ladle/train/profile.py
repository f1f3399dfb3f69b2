"""Profiling a few steps (`profiler.*`) and the step-time breakdown, and the loop's warnings.

`profiler.enabled` records steps `start_step` .. `start_step + steps - 1` with torch.profiler
(torch_npu's on an NPU) and writes each rank's trace to `OUTPUT_DIR/profile/` as
`rank{R}.steps{A}-{B}.pt.trace.json`: Chrome trace format, which Perfetto (ui.perfetto.dev) and
TensorBoard's profile plugin open. From the trace and the loop's own timers it splits the mean
step time into:

- data wait: the loop waiting for its batch (`data_s`);
- generation: the RL recipes' rollouts, sampled and scored before the step's update (`gen_s`;
  shown when a run generates);
- optimizer: clipping and the optimizer step (`optim_s`);
- compute: the union of compute intervals in forward and backward (device kernels on an
  accelerator; on a CPU, the forward and backward less the blocking collectives);
- communication: the union of collective intervals (NCCL/HCCL kernels; gloo's blocking calls on
  a CPU), split into exposed (nothing computes meanwhile) and overlapped;
- host overhead: what is left (the Python loop, kernel launches, an idle device).

Rank 0 prints the table, writes it to events.log and adds it to run_card.json ("profile",
with `comm_share`). The loop warns (events.log) when data wait passes `profiler.data_wait_warn`
of the step time, and, on an accelerator, when MFU stays under `profiler.mfu_floor` for
`profiler.patience` logged windows in a row.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

COMM = re.compile(
    r"nccl|hccl|gloo|c10d|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|_functional_collectives",
    re.I,
)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(x, y) -> float:
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, b - a)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def breakdown(trace: dict, timers: dict, steps: int) -> dict:
    """Mean seconds a step per category, from a Chrome trace (dict) and the loop's summed timers
    over the profiled steps (`step_s`, `data_s`, `fwd_bwd_s`, `optim_s`, and `gen_s` when the
    run generates its batches)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if device:  # an accelerator: what its streams ran
        comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in device if COMM.search(e["name"])])
        compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in device if not COMM.search(e["name"])])
        comm_s, compute_s = _length(comm) / 1e6, _length(compute) / 1e6
        overlapped = _intersect(comm, compute) / 1e6
    else:  # a CPU: gloo's collectives block the calling thread; the rest of fwd/bwd computes
        top = [e for e in events if e.get("cat") == "cpu_op" and COMM.search(e["name"])]
        comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in top])
        comm_s = _length(comm) / 1e6
        compute_s = max(0.0, timers["fwd_bwd_s"] - comm_s)
        overlapped = 0.0
    n = max(1, steps)
    step = timers["step_s"] / n
    out = {
        "step_s": step,
        "data_wait_s": timers["data_s"] / n,
        "optimizer_s": timers["optim_s"] / n,
        "compute_s": compute_s / n,
        "comm_exposed_s": (comm_s - overlapped) / n,
        "comm_overlapped_s": overlapped / n,
    }
    if timers.get("gen_s"):  # the RL recipes' rollouts
        out["generation_s"] = timers["gen_s"] / n
    accounted = out["data_wait_s"] + out.get("generation_s", 0.0) + out["optimizer_s"] + out["compute_s"]
    accounted += out["comm_exposed_s"]
    out["host_overhead_s"] = max(0.0, step - accounted)
    out["comm_share"] = (out["comm_exposed_s"] + out["comm_overlapped_s"]) / step if step else 0.0
    return out


def table(b: dict, first: int, last: int) -> str:
    step = b["step_s"] or 1.0
    rows = [
        ("compute", b["compute_s"]),
        ("communication, exposed", b["comm_exposed_s"]),
        ("communication, overlapped", b["comm_overlapped_s"]),
        ("data wait", b["data_wait_s"]),
        *([("generation", b["generation_s"])] if b.get("generation_s") else []),
        ("optimizer", b["optimizer_s"]),
        ("host overhead", b["host_overhead_s"]),
    ]
    lines = [f"step time by category, steps {first}-{last} (rank 0), {b['step_s'] * 1e3:.1f} ms a step:"]
    for name, s in rows:
        note = "  (under compute)" if name.endswith("overlapped") else ""
        lines.append(f"  {name:<27}{s * 1e3:>10.1f} ms{s / step:>7.1%}{note}")
    return "\n".join(lines)


class Profiler:
    """Started by the loop before step `start_step`, stopped after `start_step + steps - 1`."""

    def __init__(self, cfg, run_dir: Path, device: torch.device, rank: int):
        self.cfg, self.dir, self.device, self.rank = cfg, Path(run_dir) / "profile", device, rank
        self.first = cfg.start_step
        self.last = cfg.start_step + cfg.steps - 1
        self.prof = None
        self.timers = {"step_s": 0.0, "data_s": 0.0, "gen_s": 0.0, "fwd_bwd_s": 0.0, "optim_s": 0.0}
        self.result: dict | None = None

    def before(self, step: int) -> None:
        """Called with the number of the step about to run."""
        if not self.cfg.enabled or step != self.first or self.prof is not None:
            return
        self.prof = _profiler(self.device)
        self.prof.__enter__()

    def after(self, step: int, timers: dict) -> dict | None:
        """Called once step `step` is done, with its timers; returns the breakdown after the last."""
        if self.prof is None or self.result is not None:
            return None
        for k in self.timers:
            self.timers[k] += timers[k]
        return self.finish(step) if step >= self.last else None

    def finish(self, step: int) -> dict | None:
        """Stops a profile still running (the run ended first) with the steps it has; the breakdown."""
        if self.prof is None:
            return None
        self.last = step
        self.prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank{self.rank}.steps{self.first}-{self.last}.pt.trace.json"
        self.prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
        self.result = breakdown(trace, self.timers, self.last - self.first + 1)
        self.result["trace"] = str(path)
        self.prof = None
        return self.result


def _profiler(device: torch.device):
    if device.type == "npu":  # torch_npu's profiler: the same interface, NPU activities
        import torch_npu

        p = torch_npu.profiler
        return p.profile(activities=[p.ProfilerActivity.CPU, p.ProfilerActivity.NPU])
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


class Warnings:
    """The loop's performance warnings, each said once a run (on rank 0)."""

    def __init__(self, cfg, accelerator: bool):
        self.cfg, self.accelerator = cfg, accelerator
        self.low_mfu = 0
        self.said: set[str] = set()

    def check(self, rec: dict) -> list[str]:
        out = []
        c = self.cfg
        step = rec.get("step_s") or 0.0
        if step and rec.get("data_s", 0.0) > c.data_wait_warn * step and "data" not in self.said:
            self.said.add("data")
            out.append(
                f"step {rec['step']}: data wait is {rec['data_s'] / step:.0%} of the step time "
                f"(above profiler.data_wait_warn={c.data_wait_warn:g}); `ladle bench data` times the loader "
                "(docs/troubleshooting.md, Slow data)"
            )
        if self.accelerator and c.mfu_floor > 0 and "mfu" in rec:
            self.low_mfu = self.low_mfu + 1 if rec["mfu"] < c.mfu_floor else 0
            if self.low_mfu >= c.patience and "mfu" not in self.said:
                self.said.add("mfu")
                out.append(
                    f"step {rec['step']}: MFU {rec['mfu']:.1%} has stayed under profiler.mfu_floor="
                    f"{c.mfu_floor:g} for {self.low_mfu} logged windows; profiler.enabled=true shows where "
                    "the step time goes"
                )
        return out
