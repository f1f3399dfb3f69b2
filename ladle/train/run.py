"""The run directory: what may be written where, resume decisions, and the run card.

    OUTPUT_DIR/config.yaml  run_card.json  metrics.jsonl  events.log  checkpoints/

`resolve_resume` runs before anything is written, so a refused start leaves the folder as it was.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

import ladle
from ladle import device as dev
from ladle import distributed as dist
from ladle.config import LadleConfig
from ladle.config.load import config_hash, to_yaml
from ladle.errors import CheckpointError, ConfigError
from ladle.train.checkpoint import latest_checkpoint, read_trainer_state
from ladle.train.metrics import ConsoleProgress, EventLog, MetricsWriter, make_console


def resolve_resume(cfg: LadleConfig) -> Path | None:
    """The checkpoint to resume from, or None for a fresh start; refuses to start over a run's
    checkpoints unless asked to resume, and to resume a checkpoint of another model shape."""
    out = Path(cfg.output_dir)
    latest = latest_checkpoint(out)
    mode = cfg.train.resume
    if mode == "never":
        if latest is not None:
            theirs = read_trainer_state(latest).get("config_hash", "?")
            same = (
                "this same config" if theirs == config_hash(cfg) else f"another config (hash {theirs[:12]})"
            )
            raise ConfigError(
                f"output_dir {out} already holds checkpoints of a run with {same} (latest: {latest.name}); "
                "set train.resume=auto to continue it, or choose another output_dir"
            )
        if (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size:
            raise ConfigError(
                f"output_dir {out} already holds a run's metrics.jsonl; set train.resume=auto to continue "
                "it (from its last checkpoint, or afresh if it has none), or choose another output_dir"
            )
        return None
    path = latest if mode == "auto" else Path(mode)
    if path is None:
        return None
    read_trainer_state(path)  # raises when not a complete checkpoint
    theirs = yaml.safe_load((path / "config.yaml").read_text()) if (path / "config.yaml").is_file() else {}
    mine = cfg.model.model_dump(mode="json")
    old = theirs.get("model", {})
    diff = [f"model.{k} ({old.get(k)!r} there, {v!r} here)" for k, v in mine.items() if old.get(k) != v]
    if diff:
        raise CheckpointError(
            f"cannot resume from {path}: its model differs in {'; '.join(diff)}; "
            "resume with the model it was trained with, or start a new output_dir"
        )
    return path


def _git_commit() -> str | None:
    src = Path(ladle.__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if rev.returncode:
        return None
    return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


class RunDir:
    """Owns OUTPUT_DIR for one run: rank 0 writes the shared files, every rank logs events."""

    def __init__(self, cfg: LadleConfig, device: torch.device, *, recipe: str, resume: Path | None):
        self.cfg, self.device, self.recipe = cfg, device, recipe
        self.dir = Path(cfg.output_dir)
        self.console = make_console()
        if dist.is_main():
            (self.dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            (self.dir / "config.yaml").write_text(to_yaml(cfg))
            self._trim_metrics(read_trainer_state(resume)["step"] if resume else 0)
        dist.barrier()
        self.events = EventLog(self.dir, self.console)
        self.metrics = MetricsWriter(self.dir)
        self.started = time.time()
        self.card: dict = {}

    def _trim_metrics(self, step: int) -> None:
        """Drop records after the resumed step: they will be recomputed, and kept would repeat."""
        path = self.dir / "metrics.jsonl"
        if not path.is_file():
            return
        keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(ln + "\n" for ln in keep))
        os.replace(tmp, path)

    def progress(self, total: int, start: int) -> ConsoleProgress:
        return ConsoleProgress(total, start, self.console)

    def write_card(self, **fields) -> None:
        """run_card.json: who ran what where, and how it went. Rewritten as the run goes on."""
        if not dist.is_main():
            return
        if not self.card:
            self.card = {
                "recipe": self.recipe,
                "config_hash": config_hash(self.cfg),
                "git_commit": _git_commit(),
                "command": sys.argv,
                "versions": {
                    "ladle": ladle.__version__,
                    "torch": torch.__version__,
                    "python": platform.python_version(),
                },
                "host": platform.node(),
                "device": {
                    "type": self.device.type,
                    "name": dev.device_name(self.device),
                    "backend": dev.backend_for(self.device),
                    "torch_threads": torch.get_num_threads(),
                },
                "world_size": dist.world_size(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
            }
        self.card.update(fields)
        tmp = self.dir / "run_card.json.tmp"
        tmp.write_text(json.dumps(self.card, indent=2, default=str))
        os.replace(tmp, self.dir / "run_card.json")


def throughput_summary(run_dir: Path, skip_first: int = 1) -> dict:
    """Median tokens/s and MFU over the logged steps (the first log window, with warm-up, left out)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return {}
    recs = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    steps = [r for r in recs if "tokens_per_s" in r]
    steps = steps[skip_first:] or steps
    if not steps:
        return {}
    return {
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in steps),
        "mfu_median": statistics.median(r["mfu"] for r in steps),
        "step_s_median": statistics.median(r["step_s"] for r in steps),
        "mem_peak_bytes": max(r["mem_peak_bytes"] for r in steps),
    }
