"""The memory planner against an accelerator's allocator: for a Llama-3.2-1B-shaped model (random
weights, one device) in several precision and checkpointing settings, one training step's
allocator peak (`max_memory_allocated`) and the bytes saved for backward, beside what
`ladle.plan` says for the same config. The planner passes when both are within 10%. Prints one
JSON line per setting and a summary; exit status 1 when one misses.

    python bench/gpu_plan_check.py [--seq 2048] [--micro-batch 2]

Compared: the planner's total without its runtime and fragmentation margin (what the allocator
itself counts) against the peak; its activations (+ autocast's weight copies) against
`SavedTensors`. Prepared for a lent GPU (CUDA or NPU); `--smoke` runs a tiny model on whatever
device there is, CPU included, as a check of the script.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ladle.config.load import apply_preset
from ladle.config.schema import LadleConfig
from ladle.models.llama import build_model
from ladle.parallel.ac import _SAVE, apply_ac
from ladle.parallel.mesh import Layout
from ladle.plan import Target, estimate
from ladle.plan.measure import SavedTensors
from ladle.train.loss import cross_entropy_sum
from ladle.train.optim import build_optimizer

SETTINGS = [
    ("bf16-mixed", "none"),
    ("bf16-mixed", "full"),
    ("bf16-mixed", "op"),
    ("bf16", "none"),
    ("fp32", "full"),
]


def config(preset: str | dict, seq: int, micro: int, mode: str, ac: str) -> LadleConfig:
    d = {
        "tokenizer": {"path": "unused"},
        "data": {"path": "unused", "seq_len": seq},
        "model": {"preset": preset} if isinstance(preset, str) else preset,
        "train": {"micro_batch_size": micro, "grad_accum_steps": 1},
        "precision": {"mode": mode},
        "activation_checkpoint": {
            "mode": {"none": "none", "full": "full"}.get(ac, "selective"),
            "selective": "op" if ac == "op" else 1,
        },
    }
    apply_preset(d)
    d["model"]["max_seq_len"] = max(seq, d["model"].get("max_seq_len", seq))
    return LadleConfig.model_validate(d)


def measure(cfg: LadleConfig, device: torch.device) -> dict:
    mod = getattr(torch, device.type, None)
    dtype = torch.bfloat16 if cfg.precision.mode == "bf16" else torch.float32
    model = build_model(cfg.model, device=device, dtype=dtype)
    if cfg.activation_checkpoint.mode != "none":
        apply_ac(model, cfg.activation_checkpoint, device)
    opt = build_optimizer(model, cfg.optim, device)
    tokens = torch.randint(
        0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.data.seq_len), device=device
    )
    mixed = cfg.precision.mode == "bf16-mixed"
    op = cfg.activation_checkpoint.mode == "selective"
    for _ in range(2):  # the second step has the optimizer state: that one is measured
        if mod is not None and device.type != "cpu":
            mod.synchronize()
            mod.reset_peak_memory_stats()
        with SavedTensors(model, keep_ops=_SAVE if op else ()) as saved:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed):
                loss = cross_entropy_sum(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = int(mod.max_memory_allocated()) if device.type != "cpu" else None
    return {"peak": peak, "saved": saved.bytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, on whatever device there is")
    args = ap.parse_args()
    from ladle.device import pick_device

    device = pick_device("auto")
    preset: str | dict = args.preset
    if args.smoke:
        preset = {"vocab_size": 512, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128}
        args.seq = 256
    target = Target(1, 2**62, cpu=device.type == "cpu", runtime=0, margin=0)
    misses = 0
    for mode, ac in SETTINGS:
        cfg = config(preset, args.seq, args.micro_batch, mode, ac)
        got = measure(cfg, device)
        est = estimate(cfg, "pretrain", Layout(), target)
        saved = est.parts.get("activations", 0) + est.parts.get("autocast weight copies", 0)
        row = {
            "device": str(device),
            "precision": mode,
            "ac": ac,
            "planned_total": est.total,
            "allocator_peak": got["peak"],
            "planned_saved": saved,
            "saved": got["saved"],
        }
        ok = abs(saved - got["saved"]) <= 0.1 * got["saved"]
        if got["peak"] is not None:
            ok = ok and abs(est.total - got["peak"]) <= 0.1 * got["peak"]
        row["within_10pct"] = ok
        misses += not ok
        print(json.dumps(row), flush=True)
        if device.type != "cpu":
            getattr(torch, device.type).empty_cache()
    print(json.dumps({"settings": len(SETTINGS), "missed": misses}))
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
