"""The shared loop (ladle/train/loop.py) with a step of more than one trained model: PPO's actor
and critic in one process group (`TwoUnitTrainer`), or each on its own group of a separated
placement, the partners swapping their records after each step (`PairedTrainer`)."""

from __future__ import annotations

import dataclasses
import math

import torch

from ladle.checkpoint.catalogue import POLICY
from ladle.rl.losses import ValueLoss
from ladle.rl.placement import Pair
from ladle.train.guard import Verdict
from ladle.train.loop import StepResult, Trainer
from ladle.train.unit import TrainUnit

CRITIC = 1  # the role of the critic's group in a separated placement (the actor's: 0)


def critic_metrics(out: StepResult) -> dict:
    """The critic's step as the actor's log names it."""
    return {"value_loss": out.loss, **out.metrics, "critic_grad_norm": out.grad_norm}


def held(trainer: Trainer, micro: list[dict[str, torch.Tensor]]) -> StepResult:
    """A critic warm-up step on the actor's side: its forward and backward for the step's
    figures (loss, KL, entropy), and no update (lr 0 in the log); the schedule waits too."""
    result = trainer.unit.forward_backward(micro, trainer.loss)
    trainer.unit.optimizer.zero_grad(set_to_none=True)
    finite = math.isfinite(result.loss)
    return StepResult(
        result.loss, result.tokens, result.t_bwd, 0.0, 0.0, finite, False, result.metrics, result.local
    )


class TwoUnitTrainer(Trainer):
    """The shared loop with a step of two units: the actor's update, then the critic's. During
    the first `warmup` steps the critic alone is updated."""

    def __init__(self, *args, critic: TrainUnit, critic_loss: ValueLoss, warmup: int = 0, **kw):
        super().__init__(*args, parts={"critic": critic}, **kw)
        self.critic, self.critic_loss, self.warmup = critic, critic_loss, warmup

    def train_step(self, micro: list[dict[str, torch.Tensor]]) -> StepResult:
        out = held(self, micro) if self.step < self.warmup else super().train_step(micro)
        result = self.critic.forward_backward(micro, self.critic_loss)
        update = self.critic.step(result.loss)
        critic = {"value_loss": result.loss, **result.metrics, "critic_grad_norm": update.grad_norm}
        return dataclasses.replace(
            out, metrics={**out.metrics, **critic}, finite=out.finite and update.finite
        )


class PairedTrainer(Trainer):
    """The shared loop on one group of a separated placement: its unit's update (the actor's on
    one group, the critic's on the other, at the same time), then the partners swap their
    records, so the actor's log has the critic's metrics and both groups skip a step, stop and
    checkpoint alike. The checkpoint's trainer state is written by rank 0, an actor rank: it
    takes the critic's schedule from its partner."""

    def __init__(self, *args, pair: Pair, role: int, warmup: int = 0, **kw):
        super().__init__(*args, name="critic" if role == CRITIC else POLICY, **kw)
        self.pair, self.role, self.warmup = pair, role, warmup

    def train_step(self, micro: list[dict[str, torch.Tensor]]) -> StepResult:
        hold = self.role != CRITIC and self.step < self.warmup  # the critic's warm-up
        mine = held(self, micro) if hold else super().train_step(micro)
        theirs = self.pair.swap(dataclasses.replace(mine, local=None))
        metrics = mine.metrics if self.role == CRITIC else {**mine.metrics, **critic_metrics(theirs)}
        # both halves count the same bad steps (the actor's guard's verdict, either's non-finite),
        # so that they roll back or stop alike
        return dataclasses.replace(
            mine,
            metrics=metrics,
            finite=mine.finite and theirs.finite,
            verdict=Verdict.combine(mine.verdict, theirs.verdict),
            skipped=mine.skipped or theirs.skipped,
        )

    def state(self) -> dict:
        state = super().state()
        theirs = self.pair.swap(state.get("units", {}))
        if self.role != CRITIC:
            state["units"] = {**state.get("units", {}), **theirs}
        return state
