"""A GRPO step, generation included, of ladle against trl's `GRPOTrainer`, on the same prompts,
group size, lengths, loss and precision, in one invocation with alternating repeats.

The model is bench-30m (bench/bench30m.py) with random weights, seed 0 on both sides. The prompts
are 100-300 characters of the standard library's source, as chats: ladle renders them with its
default template (`ladle data prepare --task prompts`) and trl gets the very same rendered text.
Both sides: `--prompts` prompts a step x `--samples` samples, temperature 1, no top-k or top-p,
`--new-tokens` response tokens (random weights almost never end a response early: both generate
to the cap), the same reward function (a response that contains "def"), advantages scaled by
the group's std, no KL (no reference model), token-mean aggregation (trl's `bnpo`), one update
per rollout batch, fused AdamW, constant lr, no dropout, fp32 (or `--precision bf16-mixed`).
trl trains on the step's 16 rows in one pass; ladle with `grpo.micro_tokens` (`--micro-tokens`,
2048: rows of like length in passes of at most that many padded tokens; 0: one pass).
trl generates with transformers' `generate` (no vLLM: its colocate mode does not get past the
first weight sync on vLLM's CPU build), ladle with each engine of `--engines`: `ladle` (its own
rollouts: keyed per-row random streams, the KV cache) and `vllm` (vLLM in the process, fed the
policy's weights after every step; `make setup-vllm`; its start is not in the step times, its
weight syncs are, and `weight_sync_s` is reported). Seconds per optimizer step are medians
of `--steps` steps after `--warmup`. Also reported: ladle's share of a step spent generating
(`gen_s / step_s`, generation and scoring) and its rollout tokens/s (`bench/generate_throughput.py`
measures plain generation for comparison). Prints one JSON line:

    python bench/grpo_throughput.py [--repeats 3] [--steps 3] [--warmup 1] [--prompts 4] [--samples 4] [--new-tokens 128] [--engines ladle,vllm]

Needs the bench extras (`pip install -e '.[bench]'`) and trl (a dev extra).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from bench30m import BENCH_30M, bench_config

LR = 1e-6
REWARD_FILE = """def has_def(response, record, **context):
    return float("def" in response)
"""


def has_def(completions, **kwargs) -> list[float]:  # trl's reward function: the same rule
    return [float("def" in c) for c in completions]


def prepare(work: Path, n: int) -> tuple[Path, Path, list[str]]:
    """(tokenizer, prepared prompts, the rendered prompt texts in order)."""
    import sysconfig

    from dpo_throughput import stdlib_texts
    from train_throughput import EXCLUDE as TOK_EXCLUDE

    from ladle.data.prompts import PromptSplit, prepare_prompts
    from ladle.data.tokenizer import load_tokenizer, train_tokenizer

    tok = train_tokenizer(
        [sysconfig.get_paths()["stdlib"]],
        vocab_size=8192,
        output=str(work / "tok"),
        glob="*.py",
        exclude=TOK_EXCLUDE,
    )
    rng, texts = random.Random(0), stdlib_texts()
    with (work / "prompts.jsonl").open("w") as f:
        for _ in range(n):
            t = rng.choice(texts)
            k = rng.randint(100, 300)
            s = rng.randint(0, len(t) - k)
            f.write(json.dumps({"prompt": t[s : s + k]}) + "\n")
    data = work / "prompts"
    prepare_prompts([work / "prompts.jsonl"], tokenizer=tok, output=data, progress=False)
    split, t = PromptSplit(data, "train"), load_tokenizer(tok)
    rendered = [t.decode(split.get(i)[0].tolist(), skip_special_tokens=False) for i in range(len(split))]
    (work / "rewards.py").write_text(REWARD_FILE)
    return Path(tok), data, rendered


def ladle_run(
    tok, data, work: Path, out: Path, a, prompt_len: int, engine: str = "ladle", model: dict = BENCH_30M
) -> dict:
    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    cfg = bench_config(
        model,
        tok,
        data,
        seq_len=prompt_len + a.new_tokens,
        steps=a.warmup + a.steps,
        micro_batch=a.prompts,
        precision=a.precision,
        lr=LR,
    )
    cfg.update(output_dir=str(out), seed=0)
    cfg["grpo"] = {
        "num_samples": a.samples,
        "max_response_len": a.new_tokens,
        "temperature": 1.0,
        "kl_coef": 0.0,
        "loss_agg": "token-mean",
        "scale": "group",
        "rollout_batch": a.prompts * a.samples,
        "micro_tokens": a.micro_tokens,
        "engine": engine,
    }
    cfg["rewards"] = {"file": str(work / "rewards.py"), "terms": [{"name": "has_def"}]}
    load("grpo").run(build_config(cfg))
    recs = [r for r in read_metrics(out) if "step_s" in r][a.warmup :]
    return {
        "step_s": statistics.median(r["step_s"] for r in recs),
        "gen_share": statistics.median(r["gen_s"] / r["step_s"] for r in recs),
        "rollout_tokens_per_s": statistics.median(r["rollout_tokens_per_s"] for r in recs),
        "response_len": statistics.median(r["response_len_mean"] for r in recs),
        "weight_sync_s": statistics.median(r.get("weight_sync_s", 0.0) for r in recs),
        "rollout_logprob_diff": max(r.get("rollout_logprob_diff", 0.0) for r in recs),
    }


def trl_run(tok, rendered: list[str], out: Path, a, model=None, **config) -> float:
    """trl's step on the same work: bench-30m unless `model` (a transformers model) is given;
    `config`: more GRPOConfig keys (vLLM colocate on a GPU)."""
    import datasets
    import trl
    from dpo_throughput import tokenizer
    from train_throughput import hf_args, hf_bench30m, step_timer

    times: list[float] = []
    batch = a.prompts * a.samples
    args = trl.GRPOConfig(
        **hf_args(out, steps=a.warmup + a.steps, batch=batch, lr=LR, bf16=a.precision == "bf16-mixed"),
        num_generations=a.samples,
        max_completion_length=a.new_tokens,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=0.0,
        loss_type="bnpo",
        scale_rewards="group",
        num_iterations=1,
        gradient_checkpointing=False,
        disable_dropout=True,
        **config,
    )
    trl.GRPOTrainer(
        model=model if model is not None else hf_bench30m(),
        reward_funcs=has_def,
        args=args,
        train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in rendered]),
        processing_class=tokenizer(tok),
        callbacks=[step_timer(times)],
    ).train()
    return statistics.median(times[a.warmup :])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--samples", type=int, default=4, help="responses per prompt (the group)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    ap.add_argument(
        "--micro-tokens",
        type=int,
        default=2048,
        help="ladle's grpo.micro_tokens (0: one training pass a step)",
    )
    ap.add_argument(
        "--engines", default="ladle", help="ladle's rollout engines to time, comma-separated: ladle, vllm"
    )
    a = ap.parse_args()
    engines = a.engines.split(",")
    sys.path.insert(0, str(Path(__file__).parent))
    from dpo_throughput import tokenizer

    res: dict[str, list] = {**{e: [] for e in engines}, "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok, data, rendered = prepare(work, 64)
        hf_tok = tokenizer(tok)
        lengths = [len(hf_tok(p, add_special_tokens=False)["input_ids"]) for p in rendered]
        for r in range(a.repeats):
            for e in engines:
                res[e].append(ladle_run(tok, data, work, work / f"{e}{r}", a, max(lengths) + 8, e))
            res["trl"].append(trl_run(tok, rendered, work / f"t{r}", a))
            line = ", ".join(f"ladle[{e}] {res[e][-1]['step_s']:.3f}" for e in engines)
            print(f"repeat {r}: {line}, trl {res['trl'][-1]:.3f} s/step", file=sys.stderr)
    from ladle import device as dev

    trl_s = statistics.median(res["trl"])

    def med(e: str, key: str) -> float:
        return statistics.median(x[key] for x in res[e])

    step = {e: round(med(e, "step_s"), 3) for e in engines}
    print(
        json.dumps(
            {
                "bench": "grpo_throughput",
                "model": "bench-30m",
                "precision": a.precision,
                "machine": f"{platform.machine()} {dev.device_name(dev.pick_device('auto'))}, "
                f"{torch.get_num_threads()} threads",
                "torch": torch.__version__,
                "step": f"{a.prompts} prompts x {a.samples} samples, up to {a.new_tokens} new tokens; prompts "
                f"median {statistics.median(lengths)} tokens; ladle grpo.micro_tokens {a.micro_tokens}",
                "repeats": a.repeats,
                "seconds_per_step_median": {
                    **{f"ladle[{e}]": s for e, s in step.items()},
                    "trl": round(trl_s, 3),
                },
                "speedup_over_trl": {e: round(trl_s / med(e, "step_s"), 3) for e in engines},
                "generation_share": {e: round(med(e, "gen_share"), 3) for e in engines},
                "rollout_tokens_per_s": {e: round(med(e, "rollout_tokens_per_s"), 1) for e in engines},
                "weight_sync_s": {e: round(med(e, "weight_sync_s"), 4) for e in engines if e != "ladle"},
                "response_len": {e: med(e, "response_len") for e in engines},
                "runs": {
                    **{e: [round(x["step_s"], 3) for x in res[e]] for e in engines},
                    "trl": [round(x, 3) for x in res["trl"]],
                },
            }
        )
    )


if __name__ == "__main__":
    main()
