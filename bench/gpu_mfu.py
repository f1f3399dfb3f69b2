"""MFU of a Llama-3.2-1B-shaped model (random weights) pretrained by ladle on one accelerator.

The model is the bundled `llama-3.2-1b` preset (1.24B parameters, tied embeddings), trained in
bf16-mixed on the Python standard library's source tokenized by a BPE trained on it (vocab 8192,
so only the first 8192 embedding rows ever see a token; the FLOPs are the full model's). Each
variant runs `--steps` steps after `--warmup`; reported: the median MFU, tokens/s and step time of
the measured steps, as ladle logs them in metrics.jsonl, with peak memory. Prints one JSON line:

    python bench/gpu_mfu.py [--steps 20] [--warmup 8] [--variants compiled eager] [--micro-batch 4]

Device time is short when a GPU is lent: this is the one prepared script to run there, e.g.

    pip install --no-deps dist/ladle-*.whl && python bench/gpu_mfu.py

`--smoke` runs a tiny model for 3 steps on whatever device there is (a check of the script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from bench30m import bench_config
from train_throughput import prepare_data

VARIANTS = {
    "compiled": {"train.compile": "true"},
    "eager": {"train.compile": "false"},
    "compiled + selective AC": {"train.compile": "true", "activation_checkpoint.mode": "selective"},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20, help="measured steps per variant")
    ap.add_argument("--warmup", type=int, default=8, help="steps left out (compile, allocator warm-up)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--variants", nargs="*", default=["compiled", "eager"], choices=list(VARIANTS))
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    model = {"preset": "llama-3.2-1b"}
    if args.smoke:
        model = {"vocab_size": 8192, "dim": 64, "n_layers": 2, "n_heads": 4, "ffn_dim": 128}
        args.steps, args.warmup, args.seq_len, args.micro_batch = 2, 1, 128, 2
    res = {"bench": "gpu_mfu", "torch": torch.__version__}
    if torch.cuda.is_available():
        res["device"] = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        tok, data = prepare_data(work)
        res["prepare_s"] = round(time.perf_counter() - t0, 1)
        cfg = bench_config(
            {**model, "max_seq_len": args.seq_len} if args.smoke else model,
            tok,
            data,
            seq_len=args.seq_len,
            steps=args.warmup + args.steps,
            micro_batch=args.micro_batch,
            precision="bf16-mixed",
        )
        (work / "c.yaml").write_text(yaml.safe_dump(cfg))
        for name in args.variants:
            out = work / name.replace(" ", "_")
            cmd = [sys.executable, "-m", "ladle", "run", "pretrain", "--config", str(work / "c.yaml")]
            cmd += [f"output_dir={out}", *(f"{k}={v}" for k, v in VARIANTS[name].items())]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                res[name] = {"error": (r.stderr or r.stdout)[-2000:]}
                print(name, "failed:", r.stderr[-2000:], file=sys.stderr)
                continue
            recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            steps = [x for x in recs if "step_s" in x][args.warmup :]
            res[name] = {k: round(statistics.median(x[k] for x in steps), 4) for k in ("mfu", "step_s")}
            res[name]["tokens_per_s"] = round(statistics.median(x["tokens_per_s"] for x in steps))
            mem = [x[k] for x in steps for k in x if k.startswith("mem_peak")]
            if mem:
                res[name]["mem_peak"] = max(mem)
            print(name, res[name], file=sys.stderr)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
