"""Loading a Hugging Face checkpoint: ladle's `load_hf` against `transformers`' `from_pretrained`.

Writes a random ~1.2B-parameter checkpoint with the shape of Llama-3.2-1B (bf16 safetensors,
sharded), then loads it in fresh processes, alternating ladle and transformers, in bf16 on the
CPU. Each child reports its wall time for the load, the time until every weight byte has been
read once (`ready`: transformers maps safetensors lazily, so its load alone does no I/O), its
peak RSS, and the RSS it had before
loading (after imports), so the load's own footprint is peak - before (VmHWM, Linux). Prints
one JSON line:

    python bench/load_hf.py [--repeats 3] [--preset llama-3.2-1b]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
import torch

def hwm_kb():  # VmHWM: this process's peak RSS (unlike ru_maxrss, not inherited through fork/exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

which, folder = sys.argv[1], sys.argv[2]
if which == "transformers":
    import transformers
else:
    from ladle.models.hf import load_hf
before = hwm_kb()
t0 = time.perf_counter()
if which == "transformers":
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
else:
    m, _ = load_hf(folder, dtype=torch.bfloat16)
dt = time.perf_counter() - t0
# Read every byte once: a lazily memory-mapped model only now pays for its I/O and memory.
checksum = sum(int(p.detach().reshape(-1).view(torch.uint8).max()) for p in m.parameters())
ready = time.perf_counter() - t0
n = sum(p.numel() for p in m.parameters())
print(json.dumps({"s": dt, "ready_s": ready, "peak_kb": hwm_kb(), "before_kb": before, "params": n}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--preset", default="llama-3.2-1b")
    args = ap.parse_args()

    import torch

    from ladle.config.load import build_config
    from ladle.models.hf import save_hf
    from ladle.models.llama import build_model

    cfg = build_config(
        {"model": {"preset": args.preset}, "tokenizer": {"path": "-"}, "data": {"path": "-"}}
    ).model
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = build_model(cfg, dtype=torch.bfloat16)
        folder = save_hf(model.state_dict(), cfg, Path(tmp) / "ckpt", max_shard_bytes=1 << 30)
        weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        del model
        res = {"ladle": [], "transformers": []}
        for _ in range(args.repeats):
            for which in res:
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, which, str(folder)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                res[which].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(which, res[which][-1], file=sys.stderr)

    def med(which, f):
        return statistics.median(f(r) for r in res[which])

    gib = 2**30
    summary = {"bench": "load_hf", "preset": args.preset, "weights_gib": round(weight_bytes / gib, 3)}
    for which in res:
        summary[f"{which}_s"] = round(med(which, lambda r: r["s"]), 2)
        summary[f"{which}_ready_s"] = round(med(which, lambda r: r["ready_s"]), 2)
        summary[f"{which}_peak_rss_gib"] = round(med(which, lambda r: r["peak_kb"] * 1024 / gib), 3)
        summary[f"{which}_load_rss_gib"] = round(
            med(which, lambda r: (r["peak_kb"] - r["before_kb"]) * 1024 / gib), 3
        )
    summary["ladle_load_rss_over_weights"] = round(summary["ladle_load_rss_gib"] / summary["weights_gib"], 3)
    summary["speedup_ready"] = round(summary["transformers_ready_s"] / summary["ladle_ready_s"], 3)
    summary["repeats"] = args.repeats
    summary["self_peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib, 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - t0:.0f} s", file=sys.stderr)
