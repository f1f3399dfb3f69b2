"""Activation checkpointing: memory saved against time lost, on bench-30m.

Each mode runs in a fresh process (so peak memory is its own): the model is built, one warm-up
forward + backward runs, then `--steps` timed ones on random tokens (micro-batch 8 x 512, fp32
unless --dtype). Reported per mode: the median step time (forward + backward) and the peak
memory of forward + backward above the memory held before it (the accelerator allocator's peak,
or on a CPU the process's peak RSS (VmHWM) above its RSS before the timed steps, with glibc
told to map and unmap every large block, so RSS follows the live tensors). Prints one JSON line:

    python bench/activation_checkpoint.py [--steps 3] [--device cpu] [--compile]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

MODES = {
    "none": {"mode": "none"},
    "selective op": {"mode": "selective", "selective": "op"},
    "selective 2": {"mode": "selective", "selective": 2},
    "full": {"mode": "full"},
}

CHILD = r"""
import json, sys, time
import torch
sys.path.insert(0, sys.argv[4])
from bench30m import BENCH_30M
from ladle import device as dev
from ladle.config.schema import ActivationCheckpointConfig, ModelConfig
from ladle.models.llama import build_model
from ladle.parallel.ac import apply_ac
from ladle.train.loss import cross_entropy_sum

def rss_kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])

ac, steps, device = json.loads(sys.argv[1]), int(sys.argv[2]), torch.device(sys.argv[3])
compile_, dtype = sys.argv[5] == "1", getattr(torch, sys.argv[6])
torch.manual_seed(0)
model = build_model(ModelConfig(**BENCH_30M), device=device, dtype=dtype)
apply_ac(model, ActivationCheckpointConfig(**ac), device)
if compile_:
    for b in model.layers:
        b.compile()
tokens = torch.randint(0, BENCH_30M["vocab_size"], (8, 513), device=device)

def step():
    loss = cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
    loss.backward()
    model.zero_grad(set_to_none=False)  # keep the gradient buffers: not part of what AC saves

step()  # warm-up: gradients allocated, kernels (or compiled graphs) ready
dev.synchronize(device)
if device.type == "cpu":
    before = rss_kb("VmRSS:")
else:
    torch.get_device_module(device.type).reset_peak_memory_stats(device)
    before = torch.get_device_module(device.type).memory_allocated(device) // 1024
times = []
for _ in range(steps):
    t0 = time.perf_counter()
    step()
    dev.synchronize(device)
    times.append(time.perf_counter() - t0)
peak = rss_kb("VmHWM:") if device.type == "cpu" else torch.get_device_module(device.type).max_memory_allocated(device) // 1024
print(json.dumps({"step_s": sorted(times)[len(times) // 2], "peak_over_before_mib": (peak - before) / 1024}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    res = {}
    for name, ac in MODES.items():
        cmd = [sys.executable, "-c", CHILD, json.dumps(ac), str(args.steps), args.device, here]
        cmd += ["1" if args.compile else "0", args.dtype]
        # A fixed mmap threshold: glibc then maps every block above 128 KiB on its own and unmaps
        # it when freed, so RSS follows the live tensors (the dynamic threshold would keep freed
        # activations in the heap after the warm-up and hide the next step's peak).
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
        res[name] = json.loads(out.stdout.strip().splitlines()[-1])
        print(name, res[name], file=sys.stderr)
    none = res["none"]
    summary = {
        "bench": "activation_checkpoint",
        "model": "bench-30m",
        "batch": "8 x 512",
        "dtype": args.dtype,
        "device": args.device,
        "compile": args.compile,
        "machine": platform.machine(),
    }
    for name, r in res.items():
        summary[name] = {
            "step_s": round(r["step_s"], 3),
            "activation_mib": round(r["peak_over_before_mib"], 1),
            "memory_vs_none": round(r["peak_over_before_mib"] / none["peak_over_before_mib"], 3),
            "time_vs_none": round(r["step_s"] / none["step_s"], 3),
        }
    summary["steps"] = args.steps
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
