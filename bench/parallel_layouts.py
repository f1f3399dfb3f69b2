"""Step time per parallel layout: bench-30m trained by `ladle run pretrain --nproc 2` on the CPU.

Every layout trains the same global batch (4 x 256 tokens per step: 2 microbatches of 2 rows,
split over the data ranks) for `--steps` steps, fp32, one thread per process; reported per
layout: the median step time of the steps after the first two (`step_s` in metrics.jsonl) and
the tokens per second. `--compile` adds each layout with `train.compile=true`. Prints one JSON
line:

    python bench/parallel_layouts.py [--steps 8] [--compile]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from bench30m import BENCH_30M, bench_config

LAYOUTS = {
    "1 process": (1, {"train.micro_batch_size": 2}),
    "ddp dp_replicate=2": (2, {"parallel.dp_replicate": 2, "parallel.dp_shard": 1}),
    "fsdp dp_shard=2": (2, {"parallel.dp_shard": 2}),
    "tp=2": (2, {"parallel.tp": 2, "parallel.dp_shard": 1, "train.micro_batch_size": 2}),
    "cp=2": (2, {"parallel.cp": 2, "parallel.dp_shard": 1, "train.micro_batch_size": 2}),
    "pp=2 1f1b": (2, {"parallel.pp": 2, "parallel.dp_shard": 1, "train.micro_batch_size": 2}),
    "pp=2 zbv": (
        2,
        {
            "parallel.pp": 2,
            "parallel.dp_shard": 1,
            "parallel.pp_schedule": "zbv",
            "train.micro_batch_size": 2,
        },
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument(
        "--layouts", nargs="*", default=list(LAYOUTS), help="a subset of the layouts (names as below)"
    )
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from train_throughput import prepare_data

    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok, data = prepare_data(work)
        cfg = bench_config(
            {**BENCH_30M, "max_seq_len": 256},
            tok,
            data,
            seq_len=256,
            steps=args.steps,
            micro_batch=1,
            precision="fp32",
            grad_accum_steps=2,
            threads=1,
        )
        (work / "c.yaml").write_text(yaml.safe_dump(cfg))
        names = ["1 process", *(n for n in args.layouts if n != "1 process")]  # the baseline always
        runs = [(name, False) for name in names] + ([(name, True) for name in names] if args.compile else [])
        for name, compiled in runs:
            nproc, over = LAYOUTS[name]
            out = work / f"run{len(res)}"
            cmd = [sys.executable, "-m", "ladle", "run", "pretrain", "--config", str(work / "c.yaml")]
            cmd += ["--nproc", str(nproc), f"output_dir={out}", f"train.compile={str(compiled).lower()}"]
            cmd += [f"{k}={v}" for k, v in over.items()]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            steps = [r["step_s"] for r in recs if "step_s" in r][2:]
            step = statistics.median(steps)
            key = name + (" compiled" if compiled else "")
            res[key] = {"step_s": round(step, 3), "tokens_per_s": round(4 * 256 / step, 1)}
            print(key, res[key], file=sys.stderr)
    one = res["1 process"]["step_s"]
    for r in res.values():
        r["vs_1_process"] = round(one / r["step_s"], 3)
    print(
        json.dumps(
            {
                "bench": "parallel_layouts",
                "model": "bench-30m",
                "machine": platform.machine(),
                "global_batch": "4 x 256",
                "steps": args.steps,
                **res,
            }
        )
    )


if __name__ == "__main__":
    main()
