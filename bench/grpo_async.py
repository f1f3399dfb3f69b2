"""Asynchronous GRPO against synchronous on 2 processes, in one invocation with alternating repeats.

The work is bench/grpo_throughput.py's (bench-30m with random weights, stdlib prompts, `--prompts`
x `--samples` responses of up to `--new-tokens` tokens, fp32, one thread a process), generated
`--rollout-batch` rows at a time (4 by default, so that generating takes about as long as
training: on this kind of CPU a whole batch's pass is cheaper per token than its training, and
overlap gains most where the two phases are alike), run three ways under `ladle run grpo --nproc 2`:

    separated, sync    grpo.placement: separated, max_staleness 0: rank 0 trains, rank 1
                       generates; each waits for the other (generation, then training)
    separated, async   the same with max_staleness 1: rank 1 generates the next batch while
                       rank 0 trains on this one
    shared, dp 2       both ranks generate and train, each half the batch (the synchronous loop
                       data parallel, for reference)

Seconds per step are medians of `--steps` steps after `--warmup`, then the median over repeats;
also each run's share of a step spent generating or waiting for the engine. Prints one JSON line:

    python bench/grpo_async.py [--repeats 3] [--steps 4] [--warmup 1] [--prompts 4] [--samples 4] [--new-tokens 96] [--rollout-batch 4]
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

WAYS = {
    "separated_sync": ["grpo.placement=separated", "grpo.max_staleness=0"],
    "separated_async": ["grpo.placement=separated", "grpo.max_staleness=1"],
    "shared_dp2": ["parallel.dp_shard=1", "parallel.dp_replicate=2"],
}


def run(config: Path, out: Path, over: list[str], a) -> dict:
    from ladle.train.metrics import read_metrics

    cmd = [sys.executable, "-m", "ladle", "run", "grpo", "--config", str(config), "--nproc", "2"]
    r = subprocess.run([*cmd, f"output_dir={out}", *over], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stdout[-3000:] + r.stderr[-3000:])
    recs = [x for x in read_metrics(out) if "step_s" in x][a.warmup :]
    return {
        "step_s": statistics.median(x["step_s"] for x in recs),
        "gen_share": statistics.median(x["gen_s"] / x["step_s"] for x in recs),
        "wait_share": statistics.median(x.get("engine_wait_s", 0.0) / x["step_s"] for x in recs),
        "staleness_max": max(x.get("staleness_max", 0.0) for x in recs),
        "weight_sync_s": statistics.median(x.get("weight_sync_s", 0.0) for x in recs),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--samples", type=int, default=4, help="responses per prompt (the group)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument(
        "--rollout-batch",
        type=int,
        default=4,
        help="grpo.rollout_batch: rows a generation pass (fewer: slower generation)",
    )
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from bench30m import BENCH_30M, bench_config
    from dpo_throughput import tokenizer
    from grpo_throughput import LR, prepare

    res: dict[str, list] = {w: [] for w in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok, data, rendered = prepare(work, 64)
        hf_tok = tokenizer(tok)
        prompt_len = max(len(hf_tok(p, add_special_tokens=False)["input_ids"]) for p in rendered) + 8
        cfg = bench_config(
            BENCH_30M, tok, data, seq_len=prompt_len + a.new_tokens, steps=a.warmup + a.steps,
            micro_batch=a.prompts, precision="fp32", lr=LR,
        )  # fmt: skip
        cfg["seed"] = 0
        cfg["train"].update(threads=1, grad_accum_steps=1)
        cfg["grpo"] = {
            "num_samples": a.samples,
            "max_response_len": a.new_tokens,
            "loss_agg": "token-mean",
            "rollout_batch": a.rollout_batch,
            "rollout_correction": "tis",
        }
        cfg["rewards"] = {"file": str(work / "rewards.py"), "terms": [{"name": "has_def"}]}
        config = work / "grpo.yaml"
        config.write_text(yaml.safe_dump(cfg))
        for r in range(a.repeats):
            for w, over in WAYS.items():
                # the shared run splits each step's prompts over its 2 ranks: the same global batch
                extra = [f"train.micro_batch_size={a.prompts // 2}"] if w == "shared_dp2" else []
                res[w].append(run(config, work / f"{w}{r}", over + extra, a))
            print(
                f"repeat {r}: " + ", ".join(f"{w} {res[w][-1]['step_s']:.3f}" for w in WAYS) + " s/step",
                file=sys.stderr,
            )

    def med(w: str, key: str) -> float:
        return statistics.median(x[key] for x in res[w])

    sync, asyn = med("separated_sync", "step_s"), med("separated_async", "step_s")
    print(
        json.dumps(
            {
                "bench": "grpo_async",
                "model": "bench-30m",
                "machine": f"{platform.machine()} CPU, 2 processes of 1 thread",
                "step": f"{a.prompts} prompts x {a.samples} samples, up to {a.new_tokens} new tokens, fp32",
                "repeats": a.repeats,
                "seconds_per_step_median": {w: round(med(w, "step_s"), 3) for w in WAYS},
                "async_over_sync": round(sync / asyn, 3),
                "async_over_shared_dp2": round(med("shared_dp2", "step_s") / asyn, 3),
                "generation_share": {w: round(med(w, "gen_share"), 3) for w in WAYS},
                "engine_wait_share": {w: round(med(w, "wait_share"), 3) for w in WAYS},
                "weight_sync_s": {w: round(med(w, "weight_sync_s"), 4) for w in WAYS},
                "staleness_max": {w: med(w, "staleness_max") for w in WAYS},
                "runs": {w: [round(x["step_s"], 3) for x in res[w]] for w in WAYS},
            }
        )
    )


if __name__ == "__main__":
    main()
