"""A prepared check for a lent accelerator: PPO's shared placement with idle models in host memory
(`ppo.offload_idle`) gives the same steps as with every model on the device, and holds less.

Two 3-step PPO runs of a small random model (the policy, a critic, a frozen reference and a
reward model, all of bench-30m's shape) on the device, one with `offload_idle: true`, one with
`false`; prints one JSON line with both runs' losses, value losses and rewards (equal to rounding)
and each run's peak allocated memory (the offloaded run's is lower by about the reference's and
reward model's weights and the critic's optimizer state while generating):

    python bench/gpu_rl_offload.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench30m import BENCH_30M, bench_config
    from grpo_throughput import prepare

    from ladle.config.load import build_config
    from ladle.config.schema import ModelConfig
    from ladle.models.hf import save_hf
    from ladle.models.llama import Llama
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    if not torch.cuda.is_available():
        raise SystemExit("gpu_rl_offload: no CUDA device")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok, data, _ = prepare(work, 64)
        rm = work / "rm"
        torch.manual_seed(1)
        save_hf(
            Llama(ModelConfig(**BENCH_30M, head="score")).state_dict(),
            ModelConfig(**BENCH_30M, head="score"),
            rm,
            pad_id=0,
        )
        for offload in (False, True):
            cfg = bench_config(
                BENCH_30M, tok, data, seq_len=512, steps=3, micro_batch=4, precision="bf16-mixed", lr=1e-6
            )
            cfg.update(output_dir=str(work / f"run{offload}"), seed=0)
            cfg["ppo"] = {"num_samples": 4, "max_response_len": 128, "kl_coef": 0.05, "offload_idle": offload}
            cfg["rewards"] = {"terms": [], "model": str(rm)}
            torch.cuda.reset_peak_memory_stats()
            load("ppo").run(build_config(cfg))
            recs = [r for r in read_metrics(work / f"run{offload}") if "loss" in r]
            out[f"offload_{str(offload).lower()}"] = {
                "loss": [r["loss"] for r in recs],
                "value_loss": [r["value_loss"] for r in recs],
                "reward_mean": [r["reward_mean"] for r in recs],
                "peak_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1),
            }
    print(json.dumps({"bench": "gpu_rl_offload", "device": torch.cuda.get_device_name(), **out}))


if __name__ == "__main__":
    main()
