"""DPO and reward-model training steps of ladle against trl's `DPOTrainer` and `RewardTrainer`,
and the memory of DPO with a cached against an online reference.

The model is bench-30m (bench/bench30m.py). The pairs come from the standard library's source,
with lengths like UltraFeedback's: a prompt of 100-400 characters of a file, the chosen
completion the 150-600 characters that follow it, the rejected one as many characters from
another file; `ladle data prepare --task preference` (the default chat template, --max-len 512)
tokenizes them with a BPE of 8192 trained on the same source. trl trains on the very same token
ids: its tokenization step is bypassed and it gets prompt_ids / chosen_ids / rejected_ids cut from
ladle's prepared rows (chosen_ids / rejected_ids, the whole sequences, for the reward model).

Both sides: micro-batch 8 pairs (16 sequences), the same precision, fused AdamW, constant lr,
threads as the process has. DPO: sigmoid loss, beta 0.1; trl in its fastest setting (reference
log-probs precomputed before training, no gradient checkpointing; its fused LM head scores only
the completion tokens), ladle with `dpo.reference: cached` (computed before training and kept in
the run directory). Both pad a batch to its longest sequence. Reward: Bradley-Terry, no margin,
no centring; trl on `LlamaForSequenceClassification`. Seconds per optimizer step are the median
of `--steps` steps after `--warmup`; repeats alternate between the runs so that machine noise
hits all alike. Prints one JSON line:

    python bench/dpo_throughput.py [--repeats 3] [--steps 4] [--warmup 1] [--precision fp32]

Memory (`memory`): the peak resident set (VmHWM, Linux) of a fresh process running the same DPO
steps with `reference: cached` and with `reference: online` (a frozen copy of the model beside the
policy), beside the bytes of bench-30m's fp32 weights.

Needs the bench extras (`pip install -e '.[bench]'`) and trl (a dev extra).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
from bench30m import BENCH_30M, bench_config

SEQ, MB, PAIRS = 512, 8, 64  # PAIRS: enough for --warmup + --steps of 8 pairs; each run scores all first
BETA, LR = 0.1, 1e-6
EXCLUDE = ("site-packages", "test", "idle_test", "tests")


def stdlib_texts(min_chars: int = 4000) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(root.rglob("*.py")):
        if EXCLUDE and any(part in EXCLUDE for part in f.relative_to(root).parts):
            continue
        text = f.read_text(encoding="utf-8", errors="replace")
        if len(text) >= min_chars:
            out.append(text)
    return out


def write_pairs(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    texts = stdlib_texts()
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.sample(texts, 2)
            pl, cl = rng.randint(100, 400), rng.randint(150, 600)
            s = rng.randint(0, len(a) - pl - cl)
            t = rng.randint(0, len(b) - cl)
            pair = {"prompt": a[s : s + pl], "chosen": a[s + pl : s + pl + cl], "rejected": b[t : t + cl]}
            f.write(json.dumps(pair) + "\n")


def prepare(work: Path) -> tuple[Path, Path]:
    from train_throughput import EXCLUDE as TOK_EXCLUDE

    from ladle.data.preference import prepare_preference
    from ladle.data.tokenizer import train_tokenizer

    stdlib = sysconfig.get_paths()["stdlib"]
    tok = train_tokenizer(
        [stdlib], vocab_size=8192, output=str(work / "tok"), glob="*.py", exclude=TOK_EXCLUDE
    )
    write_pairs(work / "pairs.jsonl", PAIRS)
    data = work / "pairs"
    prepare_preference([work / "pairs.jsonl"], tokenizer=tok, output=data, max_len=SEQ, progress=False)
    return Path(tok), data


def trl_rows(data: Path) -> list[dict]:
    """ladle's prepared pairs as trl's tokenized columns: the shared prompt, then each completion,
    so both sides run the same sequences. The template's newline after the end-of-turn token is
    outside ladle's mask but in its rows: trl gets it as the completion's last token."""
    from ladle.data.preference import PreferenceSplit

    split, rows = PreferenceSplit(data, "train"), []
    for i in range(len(split)):
        c_ids, c_mask, r_ids, r_mask = (a.astype(int).tolist() for a in split.get(i))
        p = c_mask.index(1)  # where a side's token merges the prompt's end with its completion, the
        p = next((j for j in range(p) if c_ids[j] != r_ids[j]), p)  # prompt ends before (as trl cuts it)
        rows.append({"prompt_ids": c_ids[:p], "chosen_ids": c_ids[p:], "rejected_ids": r_ids[p:]})
    return rows


def ladle_run(recipe: str, tok, data, out: Path, steps: int, warmup: int, precision: str, **section) -> float:
    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    cfg = bench_config(
        BENCH_30M, tok, data, seq_len=SEQ, steps=warmup + steps, micro_batch=MB, precision=precision, lr=LR
    )
    cfg.update(output_dir=str(out), seed=0, **section)
    load(recipe).run(build_config(cfg))
    return statistics.median([r["step_s"] for r in read_metrics(out) if "step_s" in r][warmup:])


def dpo_section(reference: str = "cached") -> dict:
    return {"dpo": {"loss": "sigmoid", "beta": BETA, "reference": reference}}


def tokenizer(tok: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(tok))


def trl_dpo(tok, data, out: Path, steps: int, warmup: int, precision: str) -> float:
    import datasets
    import trl
    from train_throughput import hf_args, hf_bench30m, step_timer

    class Pretokenized(trl.DPOTrainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):
            return dataset  # the very token ids ladle trains on

    times: list[float] = []
    args = trl.DPOConfig(
        **hf_args(out, steps=warmup + steps, batch=MB, lr=LR, bf16=precision == "bf16-mixed"),
        gradient_checkpointing=False,
        precompute_ref_log_probs=True,
        beta=BETA,
        loss_type=["sigmoid"],
        max_length=None,
    )
    Pretokenized(
        model=hf_bench30m(),
        args=args,
        train_dataset=datasets.Dataset.from_list(trl_rows(data)),
        processing_class=tokenizer(tok),
        callbacks=[step_timer(times)],
    ).train()
    return statistics.median(times[warmup:])


def trl_reward(tok, data, out: Path, steps: int, warmup: int, precision: str) -> float:
    import datasets
    import trl
    from train_throughput import hf_args, hf_bench30m, step_timer

    hf_tok = tokenizer(tok)
    model = hf_bench30m("LlamaForSequenceClassification", num_labels=1, pad_token_id=hf_tok.pad_token_id)
    rows = [
        {"chosen_ids": r["prompt_ids"] + r["chosen_ids"], "rejected_ids": r["prompt_ids"] + r["rejected_ids"]}
        for r in trl_rows(data)
    ]
    times: list[float] = []
    args = trl.RewardConfig(
        **hf_args(out, steps=warmup + steps, batch=MB, lr=LR, bf16=precision == "bf16-mixed"),
        gradient_checkpointing=False,
        max_length=None,
        center_rewards_coefficient=None,
    )
    trl.RewardTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=hf_tok,
        callbacks=[step_timer(times)],
    ).train()
    return statistics.median(times[warmup:])


def memory_run(tok: str, data: str, out: str, reference: str, steps: int, precision: str) -> None:
    """In a fresh process: the DPO steps, then one JSON line with the peak resident set."""
    ladle_run("dpo", tok, data, Path(out), steps, 0, precision, **dpo_section(reference))
    # The process's own high-water mark: ru_maxrss would carry the parent's across fork and exec.
    status = Path("/proc/self/status").read_text()
    peak_kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
    print(json.dumps({"peak_rss_mib": round(peak_kib / 1024, 1)}))


def memory(tok: Path, data: Path, work: Path, steps: int, precision: str) -> dict:
    out = {}
    for reference in ("cached", "online"):
        cmd = [
            sys.executable,
            __file__,
            "--memory-run",
            reference,
            str(tok),
            str(data),
            str(work / f"mem-{reference}"),
        ]
        cmd += ["--steps", str(steps), "--precision", precision]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"memory run ({reference}) failed:\n{res.stderr[-3000:]}")
        out[reference] = json.loads(res.stdout.strip().splitlines()[-1])
    from ladle.config import ModelConfig
    from ladle.models.llama import count_params

    weights = count_params(ModelConfig(**BENCH_30M)) * 4 / 2**20
    out["online_minus_cached_mib"] = round(out["online"]["peak_rss_mib"] - out["cached"]["peak_rss_mib"], 1)
    out["model_weights_mib_fp32"] = round(weights, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    ap.add_argument(
        "--memory-run", nargs=4, metavar=("REFERENCE", "TOK", "DATA", "OUT"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    if args.memory_run:
        reference, tok, data, out = args.memory_run
        return memory_run(tok, data, out, reference, args.steps, args.precision)
    runs = ("ladle_dpo", "trl_dpo", "ladle_reward", "trl_reward")
    res: dict[str, list[float]] = {k: [] for k in runs}
    n, w, prec = args.steps, args.warmup, args.precision
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok, data = prepare(work)
        for r in range(args.repeats):
            res["ladle_dpo"].append(ladle_run("dpo", tok, data, work / f"ld{r}", n, w, prec, **dpo_section()))
            res["trl_dpo"].append(trl_dpo(tok, data, work / f"td{r}", n, w, prec))
            res["ladle_reward"].append(ladle_run("reward", tok, data, work / f"lr{r}", n, w, prec))
            res["trl_reward"].append(trl_reward(tok, data, work / f"tr{r}", n, w, prec))
            print(
                f"repeat {r}: " + ", ".join(f"{k} {v[-1]:.3f} s/step" for k, v in res.items()),
                file=sys.stderr,
            )
        mem = memory(tok, data, work, n, prec)
        lengths = [
            len(x["prompt_ids"]) + max(len(x["chosen_ids"]), len(x["rejected_ids"])) for x in trl_rows(data)
        ]
    from ladle import device as dev

    med = {k: round(statistics.median(v), 3) for k, v in res.items()}
    print(
        json.dumps(
            {
                "bench": "dpo_throughput",
                "model": "bench-30m",
                "precision": prec,
                "machine": f"{platform.machine()} {dev.device_name(dev.pick_device('auto'))}, "
                f"{torch.get_num_threads()} threads",
                "torch": torch.__version__,
                "pairs": f"{MB} pairs a step; longest side median {statistics.median(lengths)}, max {max(lengths)} tokens",
                "repeats": args.repeats,
                "seconds_per_step_median": med,
                "dpo_speedup": round(med["trl_dpo"] / med["ladle_dpo"], 3),
                "reward_speedup": round(med["trl_reward"] / med["ladle_reward"], 3),
                "runs": {k: [round(x, 3) for x in v] for k, v in res.items()},
                "memory": mem,
            }
        )
    )


if __name__ == "__main__":
    main()
