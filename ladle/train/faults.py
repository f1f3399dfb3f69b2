"""Fire drills: a fault injected on purpose, to check that a job comes back by itself.

    LADLE_FAULT=kill:STEP[:RANK]       SIGKILL once step STEP is done
    LADLE_FAULT=kill-node:STEP[:RANK]  the same, with this node's launcher (torchrun's agent and the
                                       `ladle run` that started it): the node is lost
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

from ladle import distributed as dist
from ladle.errors import ConfigError

_POINTS = {"kill": "step", "kill-node": "step", "kill-save": "save"}


def _spec() -> tuple[str, int, int | None] | None:
    raw = os.environ.get("LADLE_FAULT", "")
    if not raw or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
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
        agent = os.getppid()
        launcher = _parent_of(agent)
        for pid, what in (
            (launcher, r"(-m ladle|/ladle) run "),
            (agent, r"torch\.distributed\.run|torchrun"),
        ):
            if pid and re.search(what, _cmdline(pid)):
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
