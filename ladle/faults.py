"""Fire drills: a fault injected on purpose, to check that a job comes back by itself, or that it
stops naming the cause. Two ways in: the config's `faults.*` switches (`Drill`, refused unless
`faults.enabled`), and for kills from outside a config the environment:

    LADLE_FAULT=kill:STEP[:RANK]       SIGKILL once step STEP is done
    LADLE_FAULT=kill-node:STEP[:RANK]  the same, with this node's launcher (the `ladle run` that runs
                                       torchrun's agent, or a torchrun and a `ladle run` above it):
                                       the node is lost
    LADLE_FAULT=kill-save:STEP[:RANK]  SIGKILL between the files of step STEP's checkpoint

RANK: only that global rank (default: every process that has the variable, e.g. one node's).
Only a job's first attempt is hit (torchrun's TORCHELASTIC_RESTART_COUNT unset or 0), so the
restarted attempt trains past the step. The tests use it; so can anyone checking that a cluster's
restarts, requeues and checkpoints work before a long run depends on them.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

import torch

from ladle import distributed as dist
from ladle import watchdog
from ladle.errors import ConfigError

_POINTS = {"kill": "step", "kill-node": "step", "kill-save": "save"}


def _spec() -> tuple[str, int, int | None] | None:
    raw = os.environ.get("LADLE_FAULT", "")
    if not raw or not first_attempt():
        return None
    kind, _, rest = raw.partition(":")
    step, _, rank = rest.partition(":")
    if kind not in _POINTS or not step.isdigit() or not (rank.isdigit() or rank == ""):
        raise ConfigError(f"LADLE_FAULT={raw!r}: expected kill|kill-node|kill-save:STEP[:RANK]")
    return kind, int(step), int(rank) if rank else None


def at(point: str, step: int) -> None:
    """Called by the loop after each step (point 'step') and by the checkpointer between the
    files of a save (point 'save'): kills this process when LADLE_FAULT names this place."""
    spec = _spec()
    if spec is None:
        return
    kind, at_step, rank = spec
    if _POINTS[kind] != point or at_step != step or rank not in (None, dist.rank()):
        return
    print(f"LADLE_FAULT: {kind} at step {step} on rank {dist.rank()}", flush=True)
    if kind == "kill-node":  # only processes that are what a node runs: ladle run, torchrun
        agent = os.getppid()  # `ladle run` runs torchrun's agent itself; a plain torchrun may too
        for pid in (_parent_of(agent), agent):
            if pid and re.search(r"(-m ladle|/ladle) run |torch\.distributed\.run|torchrun", _cmdline(pid)):
                os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def first_attempt() -> bool:
    """Not a restarted attempt of a torchrun job (whose restart must train past the fault)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


@dataclass
class Injection:
    """What a step suffers on this rank: its loss (and gradients) times `factor` (NaN: a NaN
    loss), and a stop of `sleep_s` before its first collective."""

    factor: float = 1.0
    sleep_s: float = 0.0
    oom: bool = False

    def stop(self) -> None:
        if self.sleep_s:
            with watchdog.within(f"faults: sleep {self.sleep_s:g} s"):
                time.sleep(self.sleep_s)
        if self.oom:
            raise torch.OutOfMemoryError("faults.oom_at_step: an out-of-memory error injected on purpose")


class Drill:
    """The config's fault switches (`faults.*`) for this rank: `at(step)` is what the step about
    to run suffers (None: nothing), `after(step)` kills the rank once that step is done."""

    def __init__(self, cfg, rank: int):  # cfg: ladle.config.schema.FaultsConfig
        self.cfg, self.rank = cfg, rank
        self.active = cfg.enabled and first_attempt()
        self.hit = cfg.rank is None or cfg.rank == rank
        self.fired: set[int] = set()  # once each: a rollback runs a step number again

    def at(self, step: int) -> Injection | None:
        if not self.active or step in self.fired:
            return None
        self.fired.add(step)
        f = self.cfg
        out = Injection()
        if self.hit and f.nan_at_step == step:
            out.factor = float("nan")
        elif self.hit and f.spike_at_step == step:
            out.factor = f.spike_factor
        if f.sleep_at_step == step and f.sleep_rank == self.rank:
            out.sleep_s = f.sleep_s
        if self.hit and f.oom_at_step == step:
            out.oom = True
            print(f"faults: out of memory at step {step} on rank {self.rank}", flush=True)
        if out == Injection():
            return None
        if out.factor != 1.0:
            what = "NaN loss" if out.factor != out.factor else f"loss x {out.factor:g}"
            print(f"faults: {what} at step {step} on rank {self.rank}", flush=True)
        if out.sleep_s:
            print(f"faults: rank {self.rank} sleeps {out.sleep_s:g} s in step {step}", flush=True)
        return out

    def after(self, step: int) -> None:
        if self.active and self.hit and self.cfg.kill_at_step == step:
            print(f"faults: kill at step {step} on rank {self.rank}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
