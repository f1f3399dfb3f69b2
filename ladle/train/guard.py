"""The step guard: which steps are bad, and whether their update is skipped.

A step is judged after its backward and before its update, from two numbers every rank holds
alike (the global loss and gradient norm), so the ranks agree without a collective:

- non-finite (a NaN or inf loss or gradient norm): the update is skipped, always;
- a spike: the loss or the gradient norm more than `guard.z_threshold` standard deviations above
  its mean over the last `guard.window` accepted steps (once `guard.min_history` are in): an
  event, and a skipped update with `guard.skip_spikes`.

What follows a bad step is the loop's (ladle/train/loop.py): the event with the batch's samples,
and after `guard.max_skips` skips in a row a rollback or a stop. The window is checkpointed, so a
resumed run judges as the uninterrupted one would have.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

OK, NONFINITE, SPIKE = "ok", "non-finite", "spike"
WATCHED = ("loss", "grad_norm")


@dataclass
class Verdict:
    kind: str = OK  # OK | NONFINITE | SPIKE
    why: str = ""  # what was seen, for the event
    skip: bool = False  # the update is not applied

    @staticmethod
    def combine(a: Verdict | None, b: Verdict | None) -> Verdict:
        """The worse of two (a separated placement's halves): non-finite, then spike, then ok."""
        order = {NONFINITE: 0, SPIKE: 1, OK: 2}
        got = [v for v in (a, b) if v is not None] or [Verdict()]
        return min(got, key=lambda v: order[v.kind])


class Guard:
    def __init__(self, cfg):  # cfg: ladle.config.schema.GuardConfig
        self.cfg = cfg
        self.history = {k: deque(maxlen=cfg.window) for k in WATCHED}
        self.skips = 0  # skipped updates in a row
        self.rollbacks = 0

    def judge(self, loss: float, grad_norm: float, *, scaled: bool = False) -> Verdict:
        """The verdict on a step's loss and gradient norm. `scaled`: fp16's loss scaler owns an
        inf gradient norm (it skips the update and backs off): not a bad step."""
        if not math.isfinite(loss) or not (math.isfinite(grad_norm) or scaled):
            return Verdict(NONFINITE, f"non-finite loss ({loss}) or gradient norm ({grad_norm})", skip=True)
        seen = {"loss": loss, "grad_norm": grad_norm}
        found = []
        for k in WATCHED:
            got = self.zscore(k, seen[k]) if math.isfinite(seen[k]) else None
            if got is not None and got[0] > self.cfg.z_threshold > 0:
                z, mean, dev = got
                found.append(
                    f"{k} {seen[k]:.4g} is {z:.1f} standard deviations above its mean {mean:.4g} "
                    f"(std {dev:.3g}) over the last {len(self.history[k])} steps"
                )
        verdict = Verdict()
        if found:
            verdict = Verdict(SPIKE, "spike: " + "; ".join(found), skip=self.cfg.skip_spikes)
        if not verdict.skip:  # what the weights took is the new normal (a logged spike too)
            for k in WATCHED:
                if math.isfinite(seen[k]):
                    self.history[k].append(seen[k])
        return verdict

    def zscore(self, key: str, x: float) -> tuple[float, float, float] | None:
        """(z, mean, deviation) of `x` against the window; None before min_history steps."""
        h = self.history[key]
        if len(h) < self.cfg.min_history:
            return None
        mean, std = _moments(h)
        # a floor on the deviation: a flat window (a constant loss) would make any wobble a spike
        dev = max(std, 1e-3 * abs(mean), 1e-12)
        return (x - mean) / dev, mean, dev

    def state_dict(self) -> dict:
        return {"history": {k: list(v) for k, v in self.history.items()}, "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict) -> None:
        for k in WATCHED:
            self.history[k].clear()
            self.history[k].extend(float(x) for x in state.get("history", {}).get(k, []))
        self.rollbacks = int(state.get("rollbacks", 0))
        self.skips = 0


def _moments(h) -> tuple[float, float]:
    n = len(h)
    mean = sum(h) / n
    return mean, math.sqrt(sum((x - mean) ** 2 for x in h) / max(n - 1, 1))
