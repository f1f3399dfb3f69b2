"""Proximal policy optimisation with a value model (`ladle run ppo`), from prompts prepared with
`ladle data prepare --task prompts`: the actor (the policy), a critic (a value head on a decoder,
from `ppo.critic_init`, the reward model or the policy's start), a frozen reference (`ppo.kl_coef`
> 0) and the rewards (`rewards.*`: rule terms, a reward model `rewards.model`, or both).

Each rollout batch (GRPO's `Rollouts`, ladle/recipes/grpo.py) adds the critic's values; a
response's reward is its score on its last token minus `kl_coef` x KL to the reference on every
token; GAE gives per-token advantages and returns, the advantages are whitened over the whole
batch (every rank's responses). The batch then serves `ppo_epochs` x `minibatches` optimizer
steps; each step updates the actor (the clipped surrogate, optional dual clip and entropy bonus:
`PolicyLoss`) and then the critic (the clipped value loss: `ValueLoss`), two trainable units on
the shared loop, checkpointed together. The mathematics is ladle/train/ppo.py.

`ppo.placement: separated` runs the actor and reference on half the ranks and the critic and
reward model on the other half, each half laid out by `parallel.*` (ladle/train/placement.py):
the actor's ranks generate and ask their partners for values and reward-model scores, then hand
them the training rows; both halves then update at the same time, the critic on `CriticSide`'s
batches, and swap their metrics. Both placements give the same updates.
"""

from __future__ import annotations

import functools
import time

import torch

from ladle import distributed as dist
from ladle.config import LadleConfig
from ladle.errors import ConfigError
from ladle.recipes import base
from ladle.recipes import grpo as grpo_recipe
from ladle.train.builder import build_model
from ladle.train.checkpoint import POLICY
from ladle.train.grpo import PolicyLoss, kl_penalty
from ladle.train.guard import Verdict
from ladle.train.loop import Trainer
from ladle.train.loss import IGNORE_INDEX
from ladle.train.placement import Pair, Remote, serve
from ladle.train.ppo import ValueLoss, gae, token_rewards
from ladle.train.unit import TrainUnit

DATA_TASK = "prompts"


def check_layout(cfg: LadleConfig, layout) -> None:
    grpo_recipe.check_layout(cfg, layout)  # rollouts: data parallel, FSDP and TP
    p = cfg.ppo
    if cfg.train.grad_accum_steps % p.minibatches:
        raise ConfigError(
            f"ppo.minibatches ({p.minibatches}) must divide train.grad_accum_steps "
            f"({cfg.train.grad_accum_steps}): a minibatch is a share of each step's microbatches"
        )
    grpo_recipe.every_batch(cfg, p.ppo_epochs * p.minibatches, "ppo.ppo_epochs x ppo.minibatches")


def check_paths(cfg: LadleConfig) -> None:
    """The reward model's and the critic's start: their shape and vocabulary, before launch."""
    grpo_recipe.check_paths(cfg)
    if cfg.ppo.critic_init:
        grpo_recipe.scorer_config(cfg, cfg.ppo.critic_init, where="ppo.critic_init")


CRITIC = 1  # the role of the critic's group in a separated placement (the actor's: 0)


def placement(cfg: LadleConfig):
    """(groups of ranks, what they hold) of a separated placement, for the layout checks; None:
    every model on every rank."""
    if cfg.ppo.placement == "separated":
        return 2, (
            "ppo.placement=separated puts the actor and reference on one group of ranks and the critic "
            "and reward model on another"
        )
    return None


def critic_config(cfg: LadleConfig) -> LadleConfig:
    """The critic's run config: a value head on `ppo.critic_init`, else `rewards.model`, else the
    policy's start, trained with `ppo.critic_lr`."""
    p = cfg.ppo
    optim = cfg.optim.model_copy(update={"lr": p.critic_lr or cfg.optim.lr}).model_dump()
    return grpo_recipe.scorer_config(cfg, p.critic_init or cfg.rewards.model, optim=optim)


def unit_config(cfg: LadleConfig, par) -> LadleConfig:
    """What this rank trains: the critic on the critic's group of a separated placement, else the policy."""
    return critic_config(cfg) if par.role == CRITIC else cfg


def samples(cfg: LadleConfig, split: str, found):
    return grpo_recipe.prompt_samples(cfg, split, found, section="ppo")


class PPORollouts(grpo_recipe.Rollouts):
    """GRPO's rollouts with the critic's values and PPO's per-token advantages (GAE). `critic`:
    its unit, or in a separated placement a `Remote` on the partner rank, which `pair` then
    hands each batch's training rows (`CriticSide`)."""

    def __init__(self, *args, critic: TrainUnit | Remote, pair: Pair | None = None, **kw):
        super().__init__(*args, **kw)
        self.pair = pair
        if isinstance(critic, TrainUnit):
            self.critic = critic.model
            self.parking.add("critic", critic.model, critic.optimizer)  # idle while the policy generates
            self.trained = ("critic",)
        else:
            self.critic = critic
        self.old_logps = True  # the KL in the reward needs them before training

    def make(self, micro: list[dict], step: int) -> list[dict]:
        out = super().make(micro, step)
        if self.pair is not None:  # the critic's rows, in the same microbatches and minibatches
            rows = [{k: b[k] for k in CriticSide.KEYS} for b in out]
            self.pair.tell("train", {"batches": rows, "bounds": self.bounds})
        return out

    def validate(self, batches) -> dict:
        out = super().validate(batches)
        if self.pair is not None:
            self.pair.tell("validated")
        return out

    def score(self, batch: dict) -> None:
        mask = batch["targets"] != IGNORE_INDEX
        if self.all_positions:  # tensor parallel: every position's value, then the response's
            batch["old_values"] = self.critic(batch["tokens"])[..., 0].float() * mask
            return
        values = self.critic(batch["tokens"], keep=mask)[:, 0].float()
        batch["old_values"] = torch.zeros(mask.shape, device=values.device).masked_scatter(mask, values)

    def advantages(self, batches: list[dict]) -> dict:
        p = self.section
        kl_sum, adv = 0.0, []
        for b in batches:
            mask = b["targets"] != IGNORE_INDEX
            kl = torch.zeros_like(b["old_logps"])
            if "ref_logps" in b:
                kl = kl_penalty(b["old_logps"], b["ref_logps"], p.kl_estimator) * mask
                kl_sum += float(kl.sum())
            rewards = token_rewards(b["scores"], kl, mask, p.kl_coef)
            b["advantages"], b["returns"] = gae(rewards, b["old_values"], mask, p.gamma, p.lam)
            adv.append(b["advantages"][mask])
        # whitened over every rank's response tokens: the same batch on any layout whitens alike
        n, mean, var = grpo_recipe.global_moments(torch.cat(adv), self.group)
        kl_total = float(
            dist.all_reduce_sum(
                torch.tensor([kl_sum], dtype=torch.float64, device=dist.collective_device()), self.group
            )
        )
        if p.whiten_advantages and n > 1:
            inv = 1.0 / (var + 1e-8) ** 0.5
            for b in batches:
                mask = b["targets"] != IGNORE_INDEX
                b["advantages"] = (b["advantages"] - mean) * inv * mask
        return {"kl": kl_total / max(n, 1.0)} if self.reference is not None else {}


def critic_metrics(out: dict) -> dict:
    """The critic's step (a loop record) as the actor's log names it."""
    return {"value_loss": out["loss"], **out["metrics"], "critic_grad_norm": out["grad_norm"]}


class PPOTrainer(Trainer):
    """The shared loop with a step of two units: the actor's update, then the critic's."""

    def __init__(self, *args, critic: TrainUnit, critic_loss: ValueLoss, **kw):
        super().__init__(*args, parts={"critic": critic}, **kw)
        self.critic, self.critic_loss = critic, critic_loss

    def train_step(self, micro: list[dict[str, torch.Tensor]]) -> dict:
        out = super().train_step(micro)
        result = self.critic.forward_backward(micro, self.critic_loss)
        update = self.critic.step(result.loss)
        out["metrics"] = {
            **out["metrics"],
            **critic_metrics({"loss": result.loss, "metrics": result.metrics, **update}),
        }
        out["finite"] = out["finite"] and update["finite"]
        return out


class PairedTrainer(Trainer):
    """The shared loop on one group of a separated placement: its unit's update (the actor's on
    one group, the critic's on the other, at the same time), then the partners swap their
    records, so the actor's log has the critic's metrics and both groups skip a step, stop and
    checkpoint alike. The checkpoint's trainer state is written by rank 0, an actor rank: it
    takes the critic's schedule from its partner."""

    def __init__(self, *args, pair: Pair, role: int, **kw):
        super().__init__(*args, name="critic" if role == CRITIC else POLICY, **kw)
        self.pair, self.role = pair, role

    def train_step(self, micro: list[dict[str, torch.Tensor]]) -> dict:
        out = super().train_step(micro)
        mine = {k: out[k] for k in ("loss", "metrics", "grad_norm", "finite", "verdict", "skipped")}
        theirs = self.pair.swap(mine)
        if self.role != CRITIC:
            out["metrics"] = {**out["metrics"], **critic_metrics(theirs)}
        # both halves count the same bad steps (the actor's guard's verdict, either's non-finite),
        # so that they roll back or stop alike
        out["finite"] = mine["finite"] and theirs["finite"]
        out["verdict"] = Verdict.combine(mine["verdict"], theirs["verdict"])
        out["skipped"] = mine["skipped"] or theirs["skipped"]
        return out

    def state(self) -> dict:
        state = super().state()
        theirs = self.pair.swap(state.get("units", {}))
        if self.role != CRITIC:
            state["units"] = {**state.get("units", {}), **theirs}
        return state


class CriticSide:
    """The loader of the critic's group in a separated placement: while the partner (an actor
    rank) makes a rollout batch it answers its calls of the critic and the reward model
    (`serve`); then it serves that batch's training rows, `reuse` steps over `minibatches`
    slices, as the actor's `PPORollouts` does. Validation answers the reward model's calls."""

    KEYS = ("tokens", "targets", "lengths", "old_values", "returns")
    console = ()

    def __init__(self, pair: Pair, models: dict, context, reuse: int, minibatches: int):
        self.pair, self.models, self.context = pair, models, context
        self.reuse, self.minibatches = reuse, minibatches
        self.cached: list[dict] | None = None
        self.bounds: list[int] = []
        self.uses = 0
        self.data_s = 0.0

    def _until(self, want: str):
        kind, payload = serve(self.pair, self.models, self.context)
        if kind != want:
            raise RuntimeError(f"separated placement: the actor's rank said {kind!r} where {want!r} was due")
        return payload

    def next(self) -> list[dict]:
        t0 = time.perf_counter()
        if self.cached is None or self.uses >= self.reuse:
            got = self._until("train")
            self.cached, self.bounds, self.uses = got["batches"], got["bounds"], 0
        self.data_s = time.perf_counter() - t0  # waiting for the rollouts
        k = self.uses % self.minibatches
        self.uses += 1
        return self.cached[self.bounds[k] : self.bounds[k + 1]]

    def validate(self, batches) -> dict:
        self._until("validated")
        return {}  # the actor's ranks log validation

    def state_dict(self) -> dict:
        return {}  # the prompts' position is the actor's (rank 0 writes the trainer state)

    def load_state_dict(self, state: dict) -> None:
        self.cached, self.uses = None, 0

    def step_metrics(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def setup(s: base.Setup):
    cfg, p = s.cfg, s.cfg.ppo
    if p.placement == "separated":
        pair = Pair(s.par.pair_group, s.device)
        if s.par.role == CRITIC:
            return critic_setup(s, pair)
    else:
        pair = None
    rewards, records, reward_model = grpo_recipe.load_rewards(s, model=pair is None)
    reference = grpo_recipe.frozen_reference(s, "ppo") if p.kl_coef > 0 else None
    if pair is None:
        critic_cfg = critic_config(cfg)
        built = build_model(critic_cfg, s.par, s.device, load=s.resume.path is None)
        critic = TrainUnit(critic_cfg, built.model, s.device, s.par)
        describe_critic(s, built.notes)
        trainer = functools.partial(PPOTrainer, critic=critic, critic_loss=value_loss(s))
    else:  # on the partner ranks
        critic = Remote(pair, "critic")
        reward_model = Remote(pair, "reward") if cfg.rewards.model else None
        trainer = functools.partial(PairedTrainer, pair=pair, role=s.par.role)
        s.run.events(
            f"separated placement: the actor and reference on ranks 0-{s.par.layout.world - 1}, the critic"
            f"{' and reward model' if cfg.rewards.model else ''} on ranks {s.par.layout.world}-"
            f"{2 * s.par.layout.world - 1} ({s.par.layout.describe()})"
        )
    loss = PolicyLoss(
        clip_low=p.clip_low,
        clip_high=p.clip_high,
        loss_agg="token-mean",
        kl_coef=0.0,  # PPO's KL is in the reward
        temperature=p.temperature,
        dual_clip=p.dual_clip,
        entropy_coef=p.entropy_coef,
    )
    loss.console = (*PolicyLoss.console, "value_loss")
    loss.all_positions = s.par.sequence_sharded

    def wrap(loader, evaluate):
        rollouts = PPORollouts(
            loader,
            s,
            p,
            rewards,
            records,
            reference=reference,
            reward_model=reward_model,
            critic=critic,
            pair=pair,
            reuse=p.ppo_epochs * p.minibatches,
            minibatches=p.minibatches,
        )
        return rollouts, evaluate  # validation: the rewards on held-out prompts

    return base.Plan(samples, loss, wrap, trainer)


def critic_setup(s: base.Setup, pair: Pair):
    """The critic's group of a separated placement: its unit (built by `base` from `unit_config`),
    the reward model beside it, and the partner's rollouts as its batches."""
    p = s.cfg.ppo
    describe_critic(s, [])
    models = {"critic": s.unit.model, "reward": grpo_recipe.reward_model(s)}

    def wrap(loader, evaluate):
        loader.close()  # the prompts are the actor's to read
        side = CriticSide(
            pair, models, s.unit.precision.autocast, p.ppo_epochs * p.minibatches, p.minibatches
        )
        return side, evaluate

    trainer = functools.partial(PairedTrainer, pair=pair, role=CRITIC)
    return base.Plan(samples, value_loss(s), wrap, trainer)


def value_loss(s: base.Setup) -> ValueLoss:
    loss = ValueLoss(s.cfg.ppo.value_clip)
    loss.all_positions = s.par.sequence_sharded
    return loss


def describe_critic(s: base.Setup, notes: list[str]) -> None:
    cfg = s.cfg
    start = cfg.ppo.critic_init or cfg.rewards.model or cfg.model.init_from or "the policy initialisation"
    new = " (new head)" if any("score head: new" in n for n in notes) else ""
    s.run.events(f"critic: a value head on {start}{new}, lr {cfg.ppo.critic_lr or cfg.optim.lr}")


def run(cfg: LadleConfig) -> str:
    return base.run(cfg, "ppo", samples, setup=setup, unit_config=unit_config)
