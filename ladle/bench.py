"""`ladle bench comm` and `ladle bench data`: what the links and the loader deliver, measured.

comm: all-reduce, all-gather, reduce-scatter and all-to-all over the launched ranks for message
sizes from `--min-bytes` to `--max-bytes`, with nccl-tests' definitions: the size is the whole
buffer (all-gather's output, reduce-scatter's input, all-to-all's per-rank buffer), algorithm
bandwidth = size / time, bus bandwidth = algbw x 2(n-1)/n for all-reduce and x (n-1)/n for the
others (what each rank's link carries, comparable with the hardware's figure). The time is the
slowest rank's mean over `--iters` after `--warmup`. Results are checked (an all-reduce of ones
sums to n...) so a broken link cannot report a speed.

data: the training loader of a config's recipe, as a run builds it (this rank's micro-batches of
each step, packing and document masks, the prefetch thread), timed alone over `--steps` steps:
tokens/s and the shortest step it keeps fed, against the step time of a run (`--run DIR`, its
metrics.jsonl) or a given one (`--step-s`).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as tdist

from ladle.errors import ConfigError

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    if lo > hi:
        raise ConfigError(f"--min-bytes {lo} is more than --max-bytes {hi}")
    if factor < 2:
        raise ConfigError(f"--factor {factor}: at least 2")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def _op(name: str, n: int, numel: int, device):
    """(run, check, bus factor) of one collective whose nccl-tests size is `numel` fp32 values."""
    rank = tdist.get_rank()
    if name == "all_reduce":
        x = torch.ones(numel, device=device)

        def run():
            x.fill_(1.0)
            tdist.all_reduce(x)

        return run, lambda: bool((x == n).all()), 2 * (n - 1) / n
    if name == "all_gather":
        x = torch.full((numel // n,), float(rank), device=device)
        out = torch.empty(numel, device=device)
        gather = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
        want = torch.arange(n, device=device).repeat_interleave(numel // n).float()
        return lambda: gather(out, x), lambda: bool((out == want).all()), (n - 1) / n
    if name == "reduce_scatter":
        x = torch.ones(numel, device=device)
        out = torch.empty(numel // n, device=device)
        scatter = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor
        return lambda: scatter(out, x), lambda: bool((out == n).all()), (n - 1) / n
    x = torch.full((numel,), float(rank), device=device)  # all_to_all: chunk j goes to rank j
    out = torch.empty(numel, device=device)
    want = torch.arange(n, device=device).repeat_interleave(numel // n).float()
    return lambda: tdist.all_to_all_single(out, x), lambda: bool((out == want).all()), (n - 1) / n


def comm(ops: list[str], byte_sizes: list[int], iters: int, warmup: int, device) -> list[dict]:
    from ladle import device as dev

    n = tdist.get_world_size()
    rows = []
    for name in ops:
        for size in byte_sizes:
            numel = max(n, size // 4 // n * n)  # fp32 values, a multiple of the ranks
            run, check, bus = _op(name, n, numel, device)
            for _ in range(warmup):
                run()
            dev.synchronize(device)
            tdist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                run()
            dev.synchronize(device)
            elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
            tdist.all_reduce(elapsed, op=tdist.ReduceOp.MAX)  # the slowest rank's
            ok = torch.tensor([int(check())])
            tdist.all_reduce(ok, op=tdist.ReduceOp.MIN)
            if not ok.item():
                raise RuntimeError(f"{name} of {numel * 4} bytes gave a wrong result on some rank")
            t = float(elapsed.item())
            algbw = numel * 4 / t / 1e9
            rows.append(
                {
                    "op": name,
                    "bytes": numel * 4,
                    "time_us": t * 1e6,
                    "algbw_gbps": algbw,
                    "busbw_gbps": algbw * bus,
                }
            )
    return rows


def comm_text(rows: list[dict], ranks: int, backend: str) -> str:
    lines = [f"{ranks} ranks, {backend}; time: the slowest rank's mean; GB/s = 1e9 bytes/s (nccl-tests)"]
    lines.append(f"{'op':<15}{'size':>10}{'time (us)':>13}{'algbw GB/s':>13}{'busbw GB/s':>13}")
    for r in rows:
        lines.append(
            f"{r['op']:<15}{human(r['bytes']):>10}{r['time_us']:>13.1f}{r['algbw_gbps']:>13.3f}{r['busbw_gbps']:>13.3f}"
        )
    return "\n".join(lines)


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g}{unit}" if unit == "B" else f"{n:.0f}{unit}" if n == int(n) else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def run_comm(args) -> int:
    """`ladle bench comm` in one process of the launched job (torchrun's, or one alone)."""
    from ladle import device as dev
    from ladle import distributed as dist
    from ladle.units import parse_size

    ops = args.ops or list(OPS)
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise ConfigError(f"--ops {','.join(bad)}: the collectives are {', '.join(OPS)}")
    byte_sizes = sizes(
        parse_size(args.min_bytes, "--min-bytes"), parse_size(args.max_bytes, "--max-bytes"), args.factor
    )
    device = dev.pick_device(args.device, dist.local_rank())
    dev.set_device(device)
    dist.init(device)
    try:
        rows = comm(ops, byte_sizes, args.iters, args.warmup, device)
        if dist.is_main():
            report = {
                "ranks": dist.world_size(),
                "backend": dev.backend_for(device),
                "device": str(device),
                "rows": rows,
            }
            if args.output:
                Path(args.output).write_text(json.dumps(report, indent=1))
            print(json.dumps(report) if args.json else comm_text(rows, report["ranks"], report["backend"]))
        tdist.barrier()
    finally:
        dist.shutdown()
    return 0


# -- data ---------------------------------------------------------------------------------------
def samples_of(recipe: str):
    """The recipe's rows: a recipe whose batches are generated (rollouts) has no loader to time."""
    from ladle.recipes import load

    r = load(recipe)
    if r.rollouts:
        raise ConfigError(
            f"ladle bench data: recipe {recipe} makes its batches by generation (rollouts), not from a "
            "loader; benchmark pretrain, sft, reward or dpo data"
        )
    return r


def data(cfg, recipe: str, steps: int, warmup: int = 2) -> dict:
    """The recipe's train loader for rank 0 of one data-parallel rank, timed alone."""
    from ladle.data.loader import BatchLayout
    from ladle.launch.checks import check
    from ladle.train.loaders import train_loader

    r = samples_of(recipe)  # before the checks: a recipe without a loader is said as such
    found = check(cfg, r)
    cfg = found.cfg
    t = cfg.train
    rows = r.samples(cfg, "train", found)
    layout = BatchLayout(t.micro_batch_size, t.grad_accum_steps, 0, 1)
    loader = train_loader(cfg, rows, layout, torch.device("cpu"))
    times, tokens = [], 0
    try:
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            micro = loader.next()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                tokens += sum(int(b["tokens"].numel()) for b in micro)
    finally:
        loader.close()
    total = sum(times)
    return {
        "recipe": recipe,
        "steps": steps,
        "tokens_per_step": tokens // steps,
        "tokens_per_s": tokens / total,
        "step_data_s_median": statistics.median(times),
        "step_data_s_max": max(times),
        "prefetch": cfg.data.prefetch,
    }


def run_step_s(run_dir: str) -> tuple[float, float]:
    """(median step_s, median data_s) of a run's metrics.jsonl."""
    from ladle.train.metrics import read_metrics

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"--run {run_dir}: no metrics.jsonl there; give a run directory of `ladle run`")
    recs = [r for r in read_metrics(run_dir) if "step_s" in r]
    if not recs:
        raise ConfigError(f"--run {run_dir}: metrics.jsonl has no training steps yet")
    return statistics.median(r["step_s"] for r in recs), statistics.median(r.get("data_s", 0.0) for r in recs)


def run_data(args) -> int:
    from ladle.config.load import load_config

    cfg = load_config(args.config, args.overrides)
    recipe = args.recipe or "pretrain"
    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: at least 1")
    out = data(cfg, recipe, args.steps)
    step_s = args.step_s
    if args.run:
        step_s, out["run_data_s_median"] = run_step_s(args.run)
    lines = [
        f"{recipe} loader, {out['tokens_per_step']:,} tokens a step (this rank), prefetch {out['prefetch']}: "
        f"{out['tokens_per_s']:,.0f} tokens/s; a step's batches take {out['step_data_s_median'] * 1e3:.1f} ms "
        f"(median; max {out['step_data_s_max'] * 1e3:.1f} ms), so it keeps steps of that length or longer fed"
    ]
    if step_s:
        out["step_s"] = step_s
        out["need_tokens_per_s"] = out["tokens_per_step"] / step_s
        out["headroom"] = out["tokens_per_s"] / out["need_tokens_per_s"]
        verdict = (
            "keeps up"
            if out["headroom"] >= 1.5
            else "barely keeps up"
            if out["headroom"] >= 1
            else "STARVES the step"
        )
        lines.append(
            f"a step of {step_s * 1e3:.1f} ms consumes {out['need_tokens_per_s']:,.0f} tokens/s: the loader "
            f"delivers {out['headroom']:.1f}x that ({verdict})"
        )
        if "run_data_s_median" in out:
            lines.append(
                f"the run waited {out['run_data_s_median'] * 1e3:.1f} ms a step for data (median, metrics.jsonl data_s)"
            )
    print(json.dumps(out) if args.json else "\n".join(lines))
    return 0


def main_comm_launch(args, argv_tail: list[str]) -> int:
    """`--nproc N` > 1: the same command under torchrun on this machine."""
    import os
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    cmd += ["-m", "ladle", "bench", "comm", *argv_tail]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(cmd, env=env)
