"""The run directory: what may be written where, resume decisions, and the run card.

    OUTPUT_DIR/config.yaml  run_card.json  metrics.jsonl  events.log  checkpoints/

The resume decision (ladle/checkpoint/resume.py) runs before anything is written, so a refused start
leaves the folder as it was. A restarted attempt of the same job (`restart_reason`) resumes
whatever `train.resume` says.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import ladle
from ladle import device as dev
from ladle import distributed as dist
from ladle import doctor
from ladle.checkpoint.catalogue import describe
from ladle.checkpoint.resume import job_id
from ladle.config import LadleConfig
from ladle.config.load import config_hash, to_yaml
from ladle.train.loggers import Loggers
from ladle.train.metrics import ConsoleProgress, EventLog, MetricsWriter, make_console

if TYPE_CHECKING:
    from ladle.checkpoint.resume import Resume


# -- is this a restarted attempt of the job that wrote the run directory? -----------------------
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

    def __init__(self, cfg: LadleConfig, device: torch.device, *, recipe: str, resume: Resume):
        self.cfg, self.device, self.recipe = cfg, device, recipe
        self.dir = Path(cfg.output_dir)
        self.console = make_console()
        if dist.is_main():
            (self.dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            (self.dir / "config.yaml").write_text(to_yaml(cfg))
            self.trim_metrics(resume.step)
        dist.barrier()
        self.events = EventLog(self.dir, self.console)
        self.metrics = MetricsWriter(self.dir, Loggers(cfg, self.dir) if dist.is_main() else None)
        self.started = time.time()
        self.card: dict = {}
        if dist.is_main():
            self._report(resume)

    def _report(self, resume: Resume) -> None:
        """Says what the resume decision saw, and removes the saves that were cut short."""
        where = f"resuming from {resume.path.name}" if resume.path else "starting from step 0 (no checkpoint)"
        if resume.restart:
            self.events(f"restarted attempt: {resume.restart}; {where}, whatever train.resume says")
        if resume.changed:
            self.events(
                f"resumed although {'; '.join(resume.changed)} (train.allow_data_change)", level="warning"
            )
        found = resume.found
        if found is None:
            return
        for name, problems in found.skipped:
            self.events(
                f"checkpoint {name} skipped, it is not whole: {describe(problems)}; {where}", level="warning"
            )
        if found.latest_problem:
            self.events(f"{found.latest_problem}; {where}", level="warning")
        for tmp in found.partial:
            shutil.rmtree(tmp, ignore_errors=True)
            self.events(f"removed {tmp.name}, a save that was cut short (no manifest); {where}")

    def trim_metrics(self, step: int) -> None:
        """Drop records after the resumed (or rolled back to) step: they will be recomputed, and
        kept would repeat. Rank 0's file; events.log keeps what happened."""
        path = self.dir / "metrics.jsonl"
        if not dist.is_main() or not path.is_file():
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
                "versions": doctor.versions(),  # as `ladle doctor` reports them
                "host": platform.node(),
                "device": {
                    "type": self.device.type,
                    "name": dev.device_name(self.device),
                    "backend": dev.backend_for(self.device),
                    "torch_threads": torch.get_num_threads(),
                },
                "world_size": dist.world_size(),
                "job": {"id": job_id(), "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)},
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


def sample_text(cfg: LadleConfig, model, tok, device) -> str | None:
    """A generated continuation of `sample.prompt`: the demo's proof that the model learned."""
    from ladle.models.generation import generate

    s = cfg.sample
    if not s.prompt or s.max_new_tokens == 0:
        return None
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    ids = tok.encode(s.prompt)
    out = generate(
        model,
        [ids],
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_k=s.top_k,
        eos_id=tok.eos_id,
        generator=g,
    )[0]
    return s.prompt + tok.decode(out)
