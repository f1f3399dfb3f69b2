"""Samples/s of a data mixture's loader (`data.mix`) against the loader of one folder holding the
same text, on the Python standard library. Target: the mixture no more than 5% slower.

Both read the same tokens: the stdlib's *.py files (--limit-mb of them) prepared once as one
folder and once split three ways into sources. Each measures `step_batches` (what the prefetch
thread runs: the sample order, the reads, the collation) over --steps steps of one rank's slice,
in rank 0 of --dp data-parallel ranks: a mixture's rank draws the whole global batch's order and
reads its slice, so more ranks is its worst case. Alternating runs, medians over --repeats; then the
order's draw alone, per step of the global batch (`draw_us_per_step`). Prints one JSON line.

    python bench/mix_loader.py --limit-mb 8 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from ladle.data.loader import BatchLayout, PackedSamples, PretrainLoader
from ladle.data.mix import MixedSamples, MixLoader
from ladle.data.prepare import open_split, prepare
from ladle.data.sources import iter_files
from ladle.data.tokenizer import train_tokenizer


def files(limit_mb: float) -> list[Path]:
    out, total = [], 0
    for path in iter_files([sysconfig.get_paths()["stdlib"]], "*.py", ["site-packages/*"]):
        if out and total + path.stat().st_size > limit_mb * 2**20:
            break
        out.append(path)
        total += path.stat().st_size
    return out


def rate(loader, steps: int) -> float:
    """Samples/s of this rank's slice over `steps` steps (after one step of warmup)."""
    g = loader.layout.global_batch
    loader.step_batches(0)
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        loader.step_batches(s * g)
    per_rank = loader.layout.micro_batch_size * loader.layout.grad_accum_steps
    return steps * per_rank / (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit-mb", type=float, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="ladle-mixbench-"))
    paths = files(args.limit_mb)
    tok = train_tokenizer([str(f) for f in paths[:40]], vocab_size=8192, output=str(work / "tok"))
    parts = [paths[i::3] for i in range(3)]
    for name, group in [("all", paths), *((f"s{i}", part) for i, part in enumerate(parts))]:
        (work / f"list_{name}").mkdir()
        for f in group:  # each source a folder of links, as `prepare` reads folders
            os.symlink(f, work / f"list_{name}" / f"{len(os.listdir(work / f'list_{name}'))}_{f.name}")
        prepare(
            [str(work / f"list_{name}")],
            tokenizer=str(tok),
            output=str(work / name),
            workers=2,
            progress=False,
        )

    def one():
        samples = PackedSamples(open_split(work / "all"), args.seq_len)
        return PretrainLoader(samples, layout, seed=0, device=torch.device("cpu"))

    def mix():
        names = [f"s{i}" for i in range(3)]
        samples = MixedSamples(
            [PackedSamples(open_split(work / n), args.seq_len) for n in names], names, names
        )
        plan = [(0, {"s0": 0.5, "s1": 0.3, "s2": 0.2})]
        return MixLoader(samples, layout, plan, seed=0, device=torch.device("cpu"))

    layout = BatchLayout(args.micro, args.accum, 0, args.dp)
    runs = {"one_folder": [], "mixture": []}
    for _ in range(args.repeats):
        runs["one_folder"].append(rate(one(), args.steps))
        runs["mixture"].append(rate(mix(), args.steps))
    med = {k: statistics.median(v) for k, v in runs.items()}
    order = mix().mix  # the order alone: a whole global batch's draw, 16 steps at a time as the loader
    t0 = time.perf_counter()
    for _ in range(20):
        order.steps(16)
    draw_us = (time.perf_counter() - t0) / (20 * 16) * 1e6
    print(
        json.dumps(
            {
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                "python": sys.version.split()[0],
                "tokens_mb": args.limit_mb,
                "seq_len": args.seq_len,
                "global_batch": layout.global_batch,
                "rank_samples_per_step": args.micro * args.accum,
                "samples_per_s_median": {k: round(v, 1) for k, v in med.items()},
                "runs": {k: [round(x, 1) for x in v] for k, v in runs.items()},
                "mixture_vs_one_folder": round(med["mixture"] / med["one_folder"], 3),
                "draw_us_per_step": round(draw_us, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
