"""Muon against AdamW on the CPU demo (configs/tiny/pretrain.yaml: a ~7M-parameter Llama on the
Python standard library's source) at equal tokens and the same lr schedule: the validation loss at
each evaluation, the median step time and optimizer time, and the optimizer state's bytes.

    make runs/demo/data/meta.json        # the demo's tokenizer and data, once
    python bench/muon_vs_adamw.py [--demo runs/demo] [--steps 240] [--lr 2e-3 --muon-lr 2e-3 4e-3]

AdamW runs at `--lr` (the demo's); Muon at `--lr` too (Moonlight's matching makes AdamW's lr its
lr), then at each `--muon-lr` given. Prints one JSON line per run and a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from pathlib import Path

import torch

CONFIG = Path(__file__).resolve().parent.parent / "ladle" / "configs" / "tiny" / "pretrain.yaml"


def optimizer_bytes(cfg) -> int:
    """Bytes of the optimizer's state after one step of the demo's model (one process)."""
    from ladle.models.llama import build_model
    from ladle.plan.measure import state_bytes
    from ladle.train.optim import build_optimizer

    torch.manual_seed(0)
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 16))
    model(tokens).float().mean().backward()
    opt.step()
    return state_bytes(model, opt)["optimizer"]


def run(demo: Path, out: Path, optim: str, lr: float, steps: int) -> dict:
    from ladle.config.load import build_config, read_yaml
    from ladle.recipes import pretrain
    from ladle.train.metrics import read_metrics

    over = [
        f"output_dir={out}",
        f"tokenizer.path={demo / 'tokenizer'}",
        f"data.path={demo / 'data'}",
        f"optim.name={optim}",
        f"optim.lr={lr}",
        f"train.max_steps={steps}",
        f"scheduler.warmup_steps={min(30, steps // 8)}",
        f"train.eval_every={max(1, steps // 6)}",
        "train.eval_at_start=false",
        f"checkpoint.every={steps}",
        "sample.max_new_tokens=1",
    ]
    cfg = build_config(read_yaml(CONFIG), over)
    assert pretrain.run(cfg) == "completed"
    recs = read_metrics(out)
    timed = [r for r in recs if "step_s" in r][1:]  # the first step warms up
    return {
        "optim": optim,
        "lr": lr,
        "val_loss": {r["step"]: round(r["val_loss"], 4) for r in recs if "val_loss" in r},
        "step_s_median": round(statistics.median(r["step_s"] for r in timed), 4),
        "optim_s_median": round(statistics.median(r["optim_s"] for r in timed), 4),
        "optimizer_state_bytes": optimizer_bytes(cfg),
        "precision": next(
            (
                x.split("INFO: ")[-1]
                for x in (out / "events.log").read_text().splitlines()
                if "precision" in x
            ),
            "",
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--demo", type=Path, default=Path("runs/demo"), help="holds tokenizer/ and data/")
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--lr", type=float, default=2e-3, help="AdamW's lr, and Muon's first")
    ap.add_argument("--muon-lr", type=float, nargs="*", default=[], help="Muon at these lrs too")
    args = ap.parse_args()
    if not (args.demo / "data" / "meta.json").exists():
        raise SystemExit(f"no demo data in {args.demo}: make runs/demo/data/meta.json")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        plan = [("adamw", args.lr), ("muon", args.lr)] + [
            ("muon", lr) for lr in args.muon_lr if lr != args.lr
        ]
        for i, (optim, lr) in enumerate(plan):
            row = run(args.demo, Path(tmp) / str(i), optim, lr, args.steps)
            row["machine"] = (
                f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
            )
            print(json.dumps(row), flush=True)
            rows.append(row)
    evals = sorted(rows[0]["val_loss"])
    print(
        "\n| optimizer | lr | "
        + " | ".join(f"val loss @{s}" for s in evals)
        + " | step s | optim s | state |"
    )
    print("| --- " * (len(evals) + 5) + "|")
    for r in rows:
        losses = " | ".join(f"{r['val_loss'][s]:.4f}" for s in evals)
        mib = r["optimizer_state_bytes"] / 2**20
        print(
            f"| {r['optim']} | {r['lr']:g} | {losses} | {r['step_s_median']:.3f} | {r['optim_s_median']:.4f} | {mib:.2f} MiB |"
        )


if __name__ == "__main__":
    main()
