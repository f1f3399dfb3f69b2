"""The first hour on an Ascend NPU: does ladle work there, and how fast. Prepared for the day an
NPU is at hand (none has been yet), like bench/gpu_mfu.py for a GPU.

    python bench/npu_smoke.py [--steps 10] [--warmup 4] [--nproc 2]
    python bench/npu_smoke.py --smoke      # the script itself, on whatever device there is

In order, each recorded in one JSON line (a failure is recorded and the rest still run):
1. the device: torch_npu's version, the NPU's name and memory (`ladle doctor --json` in full);
2. the bf16 GEMM peak measured against the datasheet's;
3. bench-30m pretrained in bf16-mixed on one NPU: median MFU, tokens/s, step time, peak and
   reserved memory from metrics.jsonl;
4. the same under FSDP over `--nproc` NPUs through HCCL (skipped with fewer NPUs): the losses
   of the first steps against the one-NPU run's (the same global batch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml
from bench30m import BENCH_30M, bench_config
from train_throughput import prepare_data


def ladle(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ladle", *args], capture_output=True, text=True)


def steps_of(out: Path, warmup: int) -> list[dict]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "step_s" in r][warmup:]


def summary(recs: list[dict]) -> dict:
    out = {k: round(statistics.median(r[k] for r in recs), 4) for k in ("mfu", "step_s", "tokens_per_s")}
    for k in ("mem_peak_bytes", "mem_reserved_bytes"):
        if any(k in r for r in recs):
            out[k] = max(r.get(k, 0) for r in recs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--nproc", type=int, default=2, help="NPUs of the FSDP run")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on any device: checks the script")
    args = ap.parse_args()
    if 8 % args.nproc:
        ap.error("--nproc must divide the global batch of 8 sequences")
    res: dict = {"bench": "npu_smoke", "torch": torch.__version__}
    try:
        import torch_npu

        res["torch_npu"] = torch_npu.__version__
        npus = torch.npu.device_count()
    except ImportError:
        npus = 0
        if not args.smoke:
            res["error"] = "torch_npu is not installed: nothing to test here (--smoke checks the script)"
            print(json.dumps(res))
            return
    r = ladle("doctor", "--json")
    res["doctor"] = json.loads(r.stdout) if r.stdout.strip().startswith("[") else r.stderr[-2000:]
    from ladle import device as dev

    device = dev.pick_device("auto")
    res["device"] = dev.device_name(device)
    dtype = "fp32" if device.type == "cpu" else "bf16"
    measured = dev.measure_gemm_tflops(device, dtype)
    peak, source = dev.peak_tflops(device, dtype)
    res["gemm"] = {"measured_tflops": round(measured, 2), "peak_tflops": peak, "source": source}

    model = dict(BENCH_30M)
    precision = "bf16-mixed"
    if args.smoke:
        model = {
            "vocab_size": 8192,
            "dim": 64,
            "n_layers": 2,
            "n_heads": 4,
            "ffn_dim": 128,
            "max_seq_len": 128,
        }
        args.steps, args.warmup, precision = 2, 1, "fp32"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok, data = prepare_data(work)
        seq = 128 if args.smoke else 512
        cfg = bench_config(
            model, tok, data, seq_len=seq, steps=args.warmup + args.steps, micro_batch=8, precision=precision
        )
        (work / "c.yaml").write_text(yaml.safe_dump(cfg))
        one = work / "one"
        r = ladle("run", "pretrain", "--config", str(work / "c.yaml"), f"output_dir={one}")
        if r.returncode:
            res["one_device"] = {"error": (r.stderr or r.stdout)[-2000:]}
        else:
            res["one_device"] = summary(steps_of(one, args.warmup))
        if npus >= args.nproc > 1 or (args.smoke and args.nproc > 1):
            fsdp = work / "fsdp"
            # the same global batch of 8 sequences, split over the ranks
            over = [
                f"output_dir={fsdp}",
                f"parallel.dp_shard={args.nproc}",
                f"train.micro_batch_size={8 // args.nproc}",
            ]
            r = ladle("run", "pretrain", "--config", str(work / "c.yaml"), "--nproc", str(args.nproc), *over)
            if r.returncode:
                res["fsdp"] = {"error": (r.stderr or r.stdout)[-2000:]}
            else:
                got = summary(steps_of(fsdp, args.warmup))
                if "error" not in res["one_device"]:
                    a = [x["loss"] for x in steps_of(one, 0)[:3]]
                    b = [x["loss"] for x in steps_of(fsdp, 0)[:3]]
                    got["first_losses_one_vs_fsdp"] = [a, b]
                res["fsdp"] = got
        else:
            res["fsdp"] = f"skipped: {npus} NPUs, --nproc {args.nproc}"
    print(json.dumps(res))


if __name__ == "__main__":
    main()
