"""What a trustworthy checkpoint costs: ladle's save (DCP + the manifest's sha256 of every file)
and load (the safe reader) against DCP's own save and load, and `verify` (sizes, sha256, the
pickles read safely), on bench-30m with its AdamW state (fp32, one process).

    python bench/checkpoint_io.py [--repeats 3]

Prints one JSON line: medians of the repeats, in seconds, and the checksum throughput.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from bench30m import BENCH_30M
from torch.distributed.checkpoint.state_dict import get_state_dict

from ladle import distributed as dist
from ladle.checkpoint import safe_dcp
from ladle.checkpoint.catalogue import step_dir_name, verify
from ladle.checkpoint.dcp import Checkpointer
from ladle.config import CheckpointConfig, ModelConfig
from ladle.models.llama import build_model


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    device = torch.device("cpu")
    dist.init(device)
    model = build_model(ModelConfig.model_validate(BENCH_30M))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, BENCH_30M["vocab_size"], (2, 64))
    model(tokens).float().mean().backward()
    opt.step()  # the optimizer state exists, as in any checkpoint after step 1

    rows = {k: [] for k in ("ladle_save_s", "dcp_save_s", "verify_s", "ladle_load_s", "dcp_load_s")}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ckpt = Checkpointer(root / "run", CheckpointConfig(every=1, keep_last=1), device, log=lambda m: None)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}

        class Policy:  # a stateful part, as a trainable unit is
            def state_dict(self):
                return state

        for i in range(args.repeats):
            step = i + 1
            rows["ladle_save_s"].append(
                timed(lambda s=step: ckpt.save(s, {"policy": Policy()}, {"step": s}, "x: 1\n"))
            )
            path = root / "run" / "checkpoints" / step_dir_name(step)
            plain = root / f"plain{i}"
            rows["dcp_save_s"].append(timed(lambda p=plain: dcp.save(state, checkpoint_id=str(p))))
            rows["verify_s"].append(timed(lambda p=path: verify(p)))
            rows["ladle_load_s"].append(timed(lambda p=path: safe_dcp.load(state, p)))
            rows["dcp_load_s"].append(timed(lambda p=plain: dcp.load(state, checkpoint_id=str(p))))
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(
        json.dumps(
            {
                "bench": "checkpoint_io",
                "model": "bench-30m + AdamW state, fp32",
                "checkpoint_mib": round(size / 2**20, 1),
                **{k: round(v, 3) for k, v in med.items()},
                "save_ratio_ladle_over_dcp": round(med["ladle_save_s"] / med["dcp_save_s"], 2),
                "load_ratio_ladle_over_dcp": round(med["ladle_load_s"] / med["dcp_load_s"], 2),
                "verify_gib_per_s": round(size / 2**30 / med["verify_s"], 2),
                "repeats": args.repeats,
                "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                "threads": torch.get_num_threads(),
                "python": sys.version.split()[0],
                "torch": torch.__version__,
            }
        )
    )
    dist.shutdown()


if __name__ == "__main__":
    main()
