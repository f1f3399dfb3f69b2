"""Soak: a few hundred steps of a tiny model, SIGKILLed at random moments and restarted, against
the same run uninterrupted. Reports the kills survived, the steps each kill cost (at most the
checkpoint interval: the work since the last whole checkpoint) and whether the final weights equal
the uninterrupted run's.

    python bench/soak.py [--steps 300] [--every 25] [--kills 6] [--nproc 1] [--seed 0]

Each attempt is `ladle run pretrain ... train.resume=auto` in its own process group; a kill lands
wherever the attempt is (a step, a checkpoint save, start-up) once it has logged a random step.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import yaml

TINY = {
    "vocab_size": 512,
    "dim": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_dim": 128,
    "max_seq_len": 64,
}


def prepare(work: Path) -> tuple[Path, Path]:
    from ladle.data.prepare import prepare as prepare_data
    from ladle.data.tokenizer import train_tokenizer

    src = work / "src"
    src.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse.py", "textwrap.py", "shlex.py", "fractions.py", "glob.py", "heapq.py"):
        (src / name).write_bytes((stdlib / name).read_bytes())
    tok = Path(train_tokenizer([str(src)], vocab_size=512, output=str(work / "tok")))
    data = work / "data"
    prepare_data([str(src)], tokenizer=str(tok), output=str(data), workers=1, progress=False)
    return tok, data


def config(tok: Path, data: Path, out: Path, steps: int, every: int) -> dict:
    return {
        "output_dir": str(out),
        "seed": 0,
        "model": TINY,
        "tokenizer": {"path": str(tok)},
        "data": {"path": str(data), "seq_len": 32},
        "optim": {"lr": 3e-3},
        "scheduler": {"name": "cosine", "warmup_steps": 10},
        "train": {"max_steps": steps, "micro_batch_size": 4, "log_every": 1, "eval_steps": 0, "threads": 1},
        "precision": {"mode": "fp32"},
        "checkpoint": {"every": every, "keep_last": 2},
        "sample": {"prompt": ""},
    }


def last_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(ln).get("step", 0) for ln in path.read_text().splitlines() if ln.strip()]
    return max(steps, default=0)


def attempt(cfg_file: Path, nproc: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ladle", "run", "pretrain", "--config", str(cfg_file), "train.resume=auto"]
    if nproc > 1:
        cmd[5:5] = ["--nproc", str(nproc)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def starts(out: Path) -> list[int]:
    """The step each attempt started training from (events.log), in order."""
    text = (out / "events.log").read_text()
    return [int(x) for x in re.findall(r"\[rank 0\] INFO: training from step (\d+) to", text)]


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun starts its workers in sessions of
    their own, out of reach of a process-group kill): a node lost at once."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def final_weights(out: Path, steps: int) -> dict:
    from ladle.checkpoint.catalogue import step_dir_name
    from ladle.checkpoint.dcp import load_model_weights
    from ladle.config import ModelConfig
    from ladle.models.llama import build_model

    model = build_model(ModelConfig.model_validate(TINY))
    load_model_weights(out / "checkpoints" / step_dir_name(steps), model)
    return model.state_dict()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=25, help="checkpoint interval, in steps")
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok, data = prepare(work)
        runs = {}
        for name in ("whole", "soak"):
            runs[name] = work / name
            (work / f"{name}.yaml").write_text(
                yaml.safe_dump(config(tok, data, runs[name], args.steps, args.every))
            )
        log = open(work / "attempts.log", "wb")
        p = attempt(work / "whole.yaml", args.nproc, log)
        assert p.wait() == 0, (work / "attempts.log").read_text()[-3000:]

        # the soak: kill targets spread over the run, each a random step
        targets = sorted(rng.sample(range(2, args.steps), args.kills))
        kills = []
        for target in targets:
            before = last_step(runs["soak"])
            if target <= before:
                continue
            p = attempt(work / "soak.yaml", args.nproc, log)
            while p.poll() is None and last_step(runs["soak"]) < target:
                time.sleep(0.01)
            if p.poll() is not None:  # it ended by itself: that is a failure of the soak
                log.flush()
                raise SystemExit(
                    f"attempt exited {p.returncode}:\n" + (work / "attempts.log").read_text()[-4000:]
                )
            reached = last_step(runs["soak"])
            kill_tree(p.pid)
            p.wait()
            kills.append(reached)
        p = attempt(work / "soak.yaml", args.nproc, log)
        assert p.wait() == 0, (work / "attempts.log").read_text()[-3000:]
        began = starts(runs["soak"])  # attempt i + 1 resumed what kill i left
        lost = [reached - began[i + 1] for i, reached in enumerate(kills)]
        whole, soak = final_weights(runs["whole"], args.steps), final_weights(runs["soak"], args.steps)
        diff = max(float((whole[k] - soak[k]).abs().max()) for k in whole)
    print(
        json.dumps(
            {
                "bench": "soak",
                "steps": args.steps,
                "checkpoint_every": args.every,
                "nproc": args.nproc,
                "kills_survived": len(kills),
                "killed_at_steps": kills,
                "steps_lost": lost,
                "max_steps_lost": max(lost, default=0),
                "within_interval": all(x <= args.every for x in lost),
                "final_weights_equal": diff == 0.0,
                "max_weight_diff": diff,
                "seconds": round(time.perf_counter() - t0, 1),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
            }
        )
    )


if __name__ == "__main__":
    main()
