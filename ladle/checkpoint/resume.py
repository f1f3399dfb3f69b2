"""The resume decision: a fresh start, or which checkpoint a run continues from, taken before
anything is written (by `ladle validate`, the parent of torchrun and every training process), and
whether this process is a restarted attempt of the job that wrote the run directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ladle import distributed as dist
from ladle.checkpoint.catalogue import (
    Found,
    checkpoint_dirs,
    describe,
    find_newest,
    read_config,
    read_trainer_state,
    verify,
)
from ladle.checkpoint.dcp import verify_on_all_ranks
from ladle.config.load import config_hash
from ladle.config.schema import LadleConfig
from ladle.data.folder import data_changes
from ladle.errors import CheckpointError, ConfigError, DataError


def job_id() -> str | None:
    """This job's id, the same in each of its attempts: `ladle run --rdzv-id` (LADLE_JOB_ID; `ladle
    launch slurm` sets the SLURM job id), else the SLURM job id. Recorded in run_card.json."""
    return os.environ.get("LADLE_JOB_ID") or os.environ.get("SLURM_JOB_ID") or None


def restart_reason(out: str | Path) -> str | None:
    """Why this process is a restarted attempt of the job that wrote `out`, or None: torchrun
    restarted the workers (--max-restarts), or the job recorded in the run card is this one: the
    same --rdzv-id (a requeue, a replaced node) or a SLURM job that SLURM requeued. Runs within one
    SLURM allocation share its id, so a plain SLURM id counts only once SLURM has restarted it."""
    n = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if n:
        return f"torchrun restarted the workers of this job ({n} restart{'s' * (n > 1)} so far)"
    mine = job_id()
    try:
        theirs = (json.loads((Path(out) / "run_card.json").read_text()).get("job") or {}).get("id")
    except (OSError, ValueError, AttributeError):
        return None
    if mine is None or mine != theirs:
        return None
    if os.environ.get("LADLE_JOB_ID"):
        return f"job {mine} (--rdzv-id) started again"
    if int(os.environ.get("SLURM_RESTART_COUNT") or 0):
        return f"SLURM requeued job {mine} (restart {os.environ['SLURM_RESTART_COUNT']})"
    return None


@dataclass
class Resume:
    """The decision `resolve_resume` takes: where from, why, and what it saw on the way."""

    path: Path | None  # the checkpoint to resume from; None: a fresh start
    restart: str | None = None  # why this is a restarted attempt, when it is one
    found: Found | None = None  # the checkpoints folder as `find_newest` saw it
    changed: tuple[str, ...] = ()  # what differs from the checkpoint's data (train.allow_data_change)

    @property
    def step(self) -> int:
        return int(read_trainer_state(self.path)["step"]) if self.path else 0


def resolve_resume(cfg: LadleConfig, restart: str | None = None, check=verify) -> Resume:
    """Where a run starts: a fresh start, or the checkpoint to resume. Refuses to start over a
    run's checkpoints unless asked to resume (or a restarted attempt), to resume a checkpoint of
    another model shape, and to resume when no checkpoint of the run is whole; never starts over
    there. `check(path)` -> problems by file ({} when whole); `verify` by default."""
    out = Path(cfg.output_dir)
    mode = "auto" if restart else cfg.train.resume
    if mode == "never":
        dirs = checkpoint_dirs(out)
        if dirs or (out / "checkpoints" / "latest").exists():
            newest = dirs[0].name if dirs else "none whole"
            try:
                theirs = read_trainer_state(dirs[0]).get("config_hash", "?")
            except (CheckpointError, IndexError):
                theirs = "?"
            same = (
                "this same config" if theirs == config_hash(cfg) else f"another config (hash {theirs[:12]})"
            )
            raise ConfigError(
                f"output_dir {out} already holds checkpoints of a run with {same} (newest: {newest}); "
                "set train.resume=auto to continue it, or choose another output_dir"
            )
        if (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size:
            raise ConfigError(
                f"output_dir {out} already holds a run's metrics.jsonl; set train.resume=auto to continue "
                "it (from its last checkpoint, or afresh if it has none), or choose another output_dir"
            )
        return Resume(None)
    found = None
    if mode == "auto":
        found = find_newest(out, check)
        if found.path is None and found.any:
            why = "; ".join(f"{name}: {describe(p)}" for name, p in found.skipped) or found.latest_problem
            raise CheckpointError(
                f"output_dir {out} holds checkpoints, but none is whole ({why}). ladle does not start "
                "over a run's checkpoints: repair or move them away, or choose another output_dir"
            )
        path = found.path
    else:
        path = Path(mode)
        problems = check(path) if path.is_dir() else {str(path): "no such checkpoint folder"}
        if problems:
            raise CheckpointError(
                f"cannot resume from {path}: {describe(problems)}; resume from another checkpoint "
                f"(`ladle checkpoint verify {out}` lists the whole ones) or use train.resume=auto"
            )
    if path is None:
        return Resume(None, restart, found)
    read_trainer_state(path)  # raises when not a complete checkpoint
    theirs = read_config(path)
    mine = cfg.model.model_dump(mode="json")
    old = theirs.get("model", {})
    diff = [f"model.{k} ({old.get(k)!r} there, {v!r} here)" for k, v in mine.items() if old.get(k) != v]
    if diff:
        raise CheckpointError(
            f"cannot resume from {path}: its model differs in {'; '.join(diff)}; "
            "resume with the model it was trained with, or start a new output_dir"
        )
    theirs_optim = theirs.get("optim", {}).get("name", "adamw")
    if theirs_optim != cfg.optim.name:  # the optimizer state would not fit the other optimizer
        raise CheckpointError(
            f"cannot resume from {path}: it was trained with optim.name={theirs_optim}, not {cfg.optim.name}; "
            f"resume with optim.name={theirs_optim}, or start a new output_dir from its weights "
            f"(model.init_from: {path})"
        )
    changed = data_changes(cfg, read_trainer_state(path).get("data_identity"))
    if changed and not cfg.train.allow_data_change:
        raise DataError(
            f"cannot resume from {path}: {'; '.join(changed)} since it was saved. The data order continues "
            "by sample count, so other data means other samples: restore them, or set "
            "train.allow_data_change=true to resume anyway, or start a new output_dir"
        )
    return Resume(path, restart, found, tuple(changed))


def parent_resume_check(cfg: LadleConfig) -> Resume:
    """The resume decision as the parent of a multi-process run takes it, before the workers
    start: the checkpoints' sizes only (the workers share out the checksums)."""
    return resolve_resume(cfg, restart_reason(cfg.output_dir), check=partial(verify, share=None))


def worker_resume(cfg: LadleConfig, device) -> Resume:
    """The resume decision in the training processes, which all take the same one: a restart on
    one rank is one on all (a replaced node's own attempt count starts at 0), and the ranks share
    out the checksums of the checkpoints they consider."""
    restart = restart_reason(cfg.output_dir)
    if dist.any_rank(restart is not None, device):
        restart = restart or "another rank's attempt is a restart of this job"
    return resolve_resume(cfg, restart, check=verify_on_all_ranks)
