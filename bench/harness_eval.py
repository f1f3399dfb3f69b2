"""lm-evaluation-harness through ladle's model (`ladle eval --harness`) against lm-eval's own `hf`
model, on the same model: a ladle checkpoint and its exported Hugging Face folder (default: the
`make demo` model, runs/demo/run and runs/demo/hf).

Three local tasks are written from the Python standard library's source (what the demo model
learned): `multiple_choice` (a line's end among four, after the lines before it),
`loglikelihood_rolling` (whole stretches of files, several windows each) and `generate_until`
(the next line, greedy, until a newline). Each task runs through both models in one process,
alternating, `--repeats` times; reported per task: the median seconds of each (simple_evaluate
whole: requests built, model, metrics), hf's time over ladle's, whether the scores are equal and
the largest per-document log-likelihood difference (generation: the documents whose text
differs). fp32, batch `--batch-size` for both. Prints one JSON line:

    python bench/harness_eval.py [--run runs/demo/run] [--hf runs/demo/hf] [--docs 64] [--repeats 3] [--threads N]

Needs lm-eval (`pip install -e '.[eval]'`, in the dev extra).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import yaml

FILES = [
    "argparse.py",
    "textwrap.py",
    "shlex.py",
    "fractions.py",
    "glob.py",
    "heapq.py",
    "bisect.py",
    "difflib.py",
]


def metric(name: str, aggregation: str = "mean", higher_is_better: bool = True) -> dict:
    return {"metric": name, "aggregation": aggregation, "higher_is_better": higher_is_better}


def write_tasks(folder: Path, docs: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = {f: (stdlib / f).read_text() for f in FILES}
    lines = [(f, i, ln) for f in FILES for i, ln in enumerate(text[f].splitlines()) if len(ln.strip()) > 24]
    picked = rng.sample(lines, docs)
    mc, gen = [], []
    for f, i, ln in picked:
        before = "\n".join(text[f].splitlines()[max(0, i - 3) : i]) + "\n"
        cut = len(ln) // 2
        others = [o[2] for o in rng.sample(lines, 3)]
        choices = [ln[cut:], *(o[len(o) // 2 :] for o in others)]
        order = list(range(4))
        rng.shuffle(order)
        mc.append(
            {"question": before + ln[:cut], "choices": [choices[k] for k in order], "label": order.index(0)}
        )
        gen.append({"prompt": before, "answer": ln})
    ppl = []
    for f in FILES:
        for _ in range(max(1, docs // (4 * len(FILES)))):
            start = rng.randrange(0, max(1, len(text[f]) - 2000))
            ppl.append({"text": text[f][start : start + 2000]})
    common = {"dataset_path": "json", "test_split": "test"}
    specs = {
        "bench_mc": (
            mc,
            {
                "output_type": "multiple_choice",
                "doc_to_text": "{{question}}",
                "doc_to_choice": "{{choices}}",
                "doc_to_target": "{{label}}",
                "metric_list": [metric("acc"), metric("acc_norm")],
            },
        ),
        "bench_ppl": (
            ppl,
            {
                "output_type": "loglikelihood_rolling",
                "doc_to_text": "",
                "doc_to_target": "{{text}}",
                "metric_list": [
                    metric("word_perplexity", "weighted_perplexity", False),
                    metric("bits_per_byte", "bits_per_byte", False),
                ],
            },
        ),
        "bench_gen": (
            gen[: max(1, docs // 4)],
            {
                "output_type": "generate_until",
                "doc_to_text": "{{prompt}}",
                "doc_to_target": "{{answer}}",
                "generation_kwargs": {"until": ["\n"], "max_gen_toks": 32, "do_sample": False},
                "metric_list": [metric("exact_match")],
            },
        ),
    }
    for task, (rows, spec) in specs.items():
        data = folder / f"{task}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        files = {"dataset_kwargs": {"data_files": {"test": str(data)}}}
        (folder / f"{task}.yaml").write_text(yaml.safe_dump({"task": task, **common, **files, **spec}))
    return list(specs)


def per_doc(out: dict, task: str) -> list:
    """Each document's answers: its log-likelihoods (floats), or its generated text."""
    flat = []
    for s in out["samples"][task]:
        for r in s["resps"]:
            x = r[0]
            flat.append(x[0] if isinstance(x, (list, tuple)) else x)
    return flat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default="runs/demo/run", help="a ladle checkpoint or run directory")
    p.add_argument("--hf", default="runs/demo/hf", help="the same model exported (`ladle export hf`)")
    p.add_argument("--docs", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for path in (args.run, args.hf):
        if not Path(path).exists():
            sys.exit(f"{path} does not exist: run `make demo` first (or pass --run and --hf)")
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    from lm_eval.models.huggingface import HFLM

    from ladle.ops.export import load_any_model
    from ladle.ops.harness import ladle_lm, run_harness, task_manager

    with tempfile.TemporaryDirectory() as tmp:
        tasks = write_tasks(Path(tmp), args.docs)
        manager = task_manager(tmp)
        model, tok = load_any_model(args.run, tokenizer=args.hf)  # the run's tokenizer path may be relative
        models = {
            "ladle": ladle_lm(model, tok, batch_size=args.batch_size),
            "hf": HFLM(pretrained=args.hf, batch_size=args.batch_size, dtype="float32", device="cpu"),
        }
        report = {}
        for task in tasks:
            times = {name: [] for name in models}
            outs = {}
            for _ in range(args.repeats):
                for name, lm in models.items():
                    t0 = time.perf_counter()
                    outs[name] = run_harness(lm, [task], manager, log_samples=True)
                    times[name].append(time.perf_counter() - t0)
            a, b = per_doc(outs["ladle"], task), per_doc(outs["hf"], task)
            scores = {k: v for k, v in outs["ladle"]["results"][task].items() if isinstance(v, float)}
            row = {name: round(statistics.median(ts), 3) for name, ts in times.items()}
            row["hf_over_ladle"] = round(row["hf"] / row["ladle"], 2)
            row["same_scores"] = scores == {
                k: v for k, v in outs["hf"]["results"][task].items() if isinstance(v, float)
            }
            if isinstance(a[0], str):
                row["texts_differ"] = sum(x != y for x, y in zip(a, b, strict=True))
            else:
                row["max_loglik_diff"] = max(abs(x - y) for x, y in zip(a, b, strict=True))
            row["docs"] = len(outs["ladle"]["samples"][task])
            row["scores"] = {k: round(v, 4) for k, v in scores.items() if "stderr" not in k}
            report[task] = row
    print(
        json.dumps(
            {
                "bench": "harness_eval",
                "model": args.run,
                "batch_size": args.batch_size,
                "repeats": args.repeats,
                "threads": torch.get_num_threads(),
                "machine": platform.processor() or platform.machine(),
                "tasks": report,
            }
        )
    )


if __name__ == "__main__":
    main()
