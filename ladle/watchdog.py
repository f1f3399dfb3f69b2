"""The hang watchdog: every rank's phase and step, and what happens when one stops moving.

The training code marks where it is (`phase("forward")`, `with within("collective: ...")`): a
few attribute writes, no I/O. A thread per rank publishes that heartbeat to the job's store
every few seconds and checks it: when the phase of its rank has not changed for
`watchdog.timeout_s` (before the first step is done, `dist.timeout_s`: start-up may be slow),
the rank is hung. Then:

- the first rank to see it writes the report: every rank's phase, step and how long it has
  been there, the ranks that are not in a collective while others wait in one (the suspects),
  and the ranks whose heartbeat stopped (dead, or their host lost), to `events.log` and
  `OUTPUT_DIR/hang/report.txt`;
- every rank, told through the store, dumps its Python stacks (faulthandler) to
  `OUTPUT_DIR/hang/stacks_rank{N}.txt` and exits with status 3 (EXIT_HANG), so that the
  launcher restarts the job (torchrun --max-restarts) and `train.resume=auto` continues.

Under NCCL the flight recorder (`flight_recorder_env`) keeps the last collectives of each rank;
its dump (on a collective timeout, or here on a hang) lands beside the stacks.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import threading
import time
from pathlib import Path

EXIT_HANG = 3
# a restarted attempt of a torchrun job may share the store: its keys are its own
_KEY = f"ladle/watchdog/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


class Heartbeat:
    """This rank's phase, step and since when (monotonic), written by the training thread."""

    def __init__(self):
        self.phase, self.step, self.since, self.steps_done = "start", 0, time.monotonic(), 0


_beat = Heartbeat()


def phase(name: str, step: int | None = None) -> None:
    """This rank is now in `name` (and at `step`): progress, as far as the watchdog knows."""
    _beat.phase, _beat.since = name, time.monotonic()
    if step is not None:
        _beat.step = step


def step_done(step: int) -> None:
    _beat.steps_done, _beat.step = _beat.steps_done + 1, step
    _beat.since = time.monotonic()


@contextlib.contextmanager
def within(name: str):
    """A phase inside another (a collective inside the forward): back to the outer one after."""
    outer = _beat.phase
    phase(name)
    try:
        yield
    finally:
        phase(outer)


def flight_recorder_env(device_type: str, folder: str | os.PathLike) -> dict[str, str]:
    """The environment that turns on NCCL's flight recorder (the last collectives of each rank,
    dumped when one times out) with its dump under `folder`; read when the process group starts.
    Settings the user made win."""
    if device_type != "cuda":
        return {}
    want = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(folder) / "nccl_trace_rank_"),
    }
    return {k: v for k, v in want.items() if k not in os.environ}


class Watchdog:
    """The thread of one rank (a context manager around the training loop)."""

    def __init__(
        self,
        folder: str | os.PathLike,
        timeout_s: float,
        start_timeout_s: float,
        *,
        rank: int,
        world: int,
        store=None,
        log=print,
    ):
        self.folder, self.timeout_s, self.start_timeout_s = Path(folder), timeout_s, start_timeout_s
        self.rank, self.world, self.store, self.log = rank, world, store, log
        self.interval = max(0.2, min(5.0, timeout_s / 5))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watchdog:
        if self.timeout_s > 0:
            phase("start")
            _beat.steps_done = 0  # a new run (in this process): start-up's timeout again
            self._thread = threading.Thread(target=self._run, daemon=True, name="ladle-watchdog")
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._publish()
                if self._told():
                    self._dump_and_exit(report=None)
                limit = self.timeout_s if _beat.steps_done else self.start_timeout_s
                if time.monotonic() - _beat.since > limit:
                    self._fire(limit)
            except Exception as e:  # a store that went away (the job is ending): stop watching
                self.log(f"watchdog stopped: {e}")
                return

    def _publish(self) -> None:
        if self.store is None:
            return
        now = time.time()
        beat = {
            "phase": _beat.phase,
            "step": _beat.step,
            "for_s": time.monotonic() - _beat.since,
            "at": now,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        self.store.set(f"{_KEY}/beat/{self.rank}", json.dumps(beat))

    def _told(self) -> bool:
        return self.store is not None and self.store.check([f"{_KEY}/hang"])

    def _fire(self, limit: float) -> None:
        first = True
        if self.store is not None:
            self.store.set(f"{_KEY}/hang", str(self.rank))
            first = self.store.add(f"{_KEY}/reporters", 1) == 1
        report = self.report(limit) if first else None
        self._dump_and_exit(report)

    def beats(self) -> dict[int, dict | None]:
        """Every rank's last heartbeat (None: it never published one)."""
        out = {}
        for r in range(self.world):
            key = f"{_KEY}/beat/{r}"
            out[r] = (
                json.loads(self.store.get(key))
                if self.store is not None and self.store.check([key])
                else None
            )
        if self.store is None:
            out[self.rank] = {
                "phase": _beat.phase,
                "step": _beat.step,
                "for_s": time.monotonic() - _beat.since,
                "at": time.time(),
            }
        return out

    def report(self, limit: float) -> str:
        return describe_hang(self.rank, limit, self.beats(), time.time(), self.timeout_s, self.folder)

    def _dump_and_exit(self, report: str | None) -> None:
        """This rank's stacks, then (the reporter) the report, then exit. No rank exits before
        the report is written, nor the reporter before the others' stacks (or a few intervals):
        a peer's exit breaks the collective a main thread waits in, which ends that process
        before its watchdog has written what it must."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"stacks_rank{self.rank}.txt", "w") as f:
            f.write(f"rank {self.rank}, phase {_beat.phase!r}, step {_beat.step}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        _dump_nccl_trace(self.folder, self.rank)
        if report is not None:
            (self.folder / "report.txt").write_text(report + "\n")
            self.log(report)
            if self.store is not None:
                self.store.set(f"{_KEY}/reported", "1")
            # and the others' stacks, when they can (a rank notices within an interval)
            deadline = time.monotonic() + 3 * self.interval + 2
            while (
                time.monotonic() < deadline and len(list(self.folder.glob("stacks_rank*.txt"))) < self.world
            ):
                time.sleep(0.1)
        elif self.store is not None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not self.store.check([f"{_KEY}/reported"]):
                time.sleep(0.05)
        os._exit(EXIT_HANG)


def describe_hang(me: int, limit: float, beats: dict, now: float, timeout_s: float, folder: Path) -> str:
    """The report: which rank is where, and whom the others wait for."""
    stale_after = max(3 * timeout_s / 5, 15.0)  # a heartbeat is published every timeout/5 s at most
    lines, suspects, dead = [], [], []
    for r, b in sorted(beats.items()):
        if b is None:
            lines.append(f"  rank {r}: no heartbeat ever (it never reached the training loop)")
            dead.append(r)
        elif now - b["at"] > stale_after:
            lines.append(
                f"  rank {r}: no heartbeat for {now - b['at']:.0f} s (dead, or its host {b.get('host')} is "
                f"lost); last in {b['phase']!r} at step {b['step']}"
            )
            dead.append(r)
        else:
            lines.append(
                f"  rank {r}: {b['phase']!r} at step {b['step']} for {b['for_s'] + now - b['at']:.0f} s"
            )
            if not b["phase"].startswith("collective"):
                suspects.append(r)
    waiting = any(b and b["phase"].startswith("collective") for b in beats.values())
    blame = ""
    if dead:
        blame = f" Dead or lost: rank{'s' * (len(dead) > 1)} {', '.join(map(str, dead))}."
    if waiting and suspects:
        blame += (
            f" Not in a collective while others wait in one: rank{'s' * (len(suspects) > 1)} "
            f"{', '.join(map(str, suspects))}."
        )
    return (
        f"hang: rank {me} made no progress for {limit:g} s (watchdog.timeout_s).{blame}\n"
        + "\n".join(lines)
        + f"\nevery rank's Python stacks: {folder}/stacks_rank*.txt; exiting with status {EXIT_HANG} so the "
        "launcher can restart the job (train.resume=auto continues from the last checkpoint)"
    )


def _dump_nccl_trace(folder: Path, rank: int) -> None:
    """NCCL's flight recorder, when this process runs NCCL with it on (private torch API)."""
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        return
    try:
        import torch

        dump = torch._C._distributed_c10d._dump_nccl_trace()
        (folder / f"nccl_trace_rank_{rank}.pkl").write_bytes(dump)
    except Exception:
        pass
