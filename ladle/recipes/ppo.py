"""Proximal policy optimisation with a value model (`ladle run ppo`), from prompts prepared with
`ladle data prepare --task prompts`: the actor (the policy), a critic (a value head on a decoder,
from `ppo.critic_init`, the reward model or the policy's start), a frozen reference (`ppo.kl_coef`
> 0) and the rewards (`rewards.*`: rule terms, a reward model `rewards.model`, or both).

Each rollout batch (ladle/rl/loader.py) adds the critic's values; a response's reward is its
score on its last token minus `kl_coef` x KL to the reference on every token; GAE gives per-token
advantages and returns, whitened over the whole batch (ladle/rl/advantages.py). The batch then
serves `ppo_epochs` x `minibatches` optimizer steps; each step updates the actor (the clipped
surrogate, optional dual clip and entropy bonus: `PolicyLoss`) and then the critic (the clipped
value loss: `ValueLoss`), two trainable units on the shared loop, checkpointed together
(ladle/rl/trainers.py).

`ppo.placement: separated` runs the actor and reference on half the ranks and the critic and
reward model on the other half, each half laid out by `parallel.*` (ladle/rl/placement.py): the
actor's ranks generate and ask their partners for values and reward-model scores, then hand them
the training rows; both halves then update at the same time, the critic on `CriticSide`'s
batches, and swap their metrics. Both placements give the same updates.
"""

from __future__ import annotations

import functools

import torch

from ladle.config import LadleConfig
from ladle.errors import ConfigError
from ladle.recipes.base import Setup, Training
from ladle.recipes.rl import RLRecipe, correction, every_batch, rollout_loader
from ladle.rl import roles
from ladle.rl.advantages import gae_advantages
from ladle.rl.losses import PolicyLoss, ValueLoss
from ladle.rl.placement import CriticSide, Pair, Remote
from ladle.rl.stats import RunningMoments
from ladle.rl.trainers import CRITIC, PairedTrainer, TwoUnitTrainer
from ladle.train.builder import build_laid_out
from ladle.train.loss import IGNORE_INDEX
from ladle.train.unit import TrainUnit


class PPO(RLRecipe):
    name = "ppo"
    section = "ppo"

    def check_layout(self, cfg: LadleConfig, layout) -> None:
        super().check_layout(cfg, layout)  # rollouts: data parallel, FSDP and TP
        p = cfg.ppo
        if cfg.train.grad_accum_steps % p.minibatches:
            raise ConfigError(
                f"ppo.minibatches ({p.minibatches}) must divide train.grad_accum_steps "
                f"({cfg.train.grad_accum_steps}): a minibatch is a share of each step's microbatches"
            )
        every_batch(cfg, p.ppo_epochs * p.minibatches, "ppo.ppo_epochs x ppo.minibatches")

    def check_paths(self, cfg: LadleConfig) -> None:
        roles.check_paths(cfg, critic=True)
        if cfg.ppo.engine == "vllm" and cfg.ppo.placement == "separated":
            raise ConfigError(
                "ppo.engine=vllm with ppo.placement=separated: vLLM's in-process engine joins every rank "
                "of the job, and the critic's ranks hold none; use ppo.placement: shared with vllm, or "
                "ppo.engine: ladle"
            )
        self.check_engine(cfg)
        self.check_env(cfg)

    def placement(self, cfg: LadleConfig):
        if cfg.ppo.placement == "separated":
            return 2, (
                "ppo.placement=separated puts the actor and reference on one group of ranks and the critic "
                "and reward model on another"
            )
        return None

    def unit_config(self, cfg: LadleConfig, par) -> LadleConfig:
        """The critic on the critic's group of a separated placement, else the policy."""
        return roles.critic_config(cfg) if par.role == CRITIC else cfg

    def setup(self, s: Setup) -> Training:
        cfg, p = s.cfg, s.cfg.ppo
        pair = Pair(s.par.pair_group, s.device) if p.placement == "separated" else None
        if pair is not None and s.par.role == CRITIC:
            return self.critic_setup(s, pair)
        rewards = roles.load_rewards(cfg, "ppo")
        reward_model = roles.reward_model(cfg, s.par, s.device, s.run.events) if pair is None else None
        reference = (
            roles.frozen_reference(cfg, s.par, s.device, s.run.events, "ppo") if p.kl_coef > 0 else None
        )
        if pair is None:
            critic_cfg = roles.critic_config(cfg)
            built = build_laid_out(critic_cfg, s.par, s.device, load=s.resume.path is None)
            critic = TrainUnit(critic_cfg, built.model, s.device, s.par)
            start_critic(s, built.notes, critic.model)
            trainer = functools.partial(
                TwoUnitTrainer, critic=critic, critic_loss=critic_loss(s), warmup=p.critic_warmup
            )
            critic_model, trained = critic.model, ("critic",)
        else:  # on the partner ranks
            critic_model, trained = Remote(pair, "critic"), ()
            reward_model = Remote(pair, "reward") if cfg.rewards.model else None
            trainer = functools.partial(PairedTrainer, pair=pair, role=s.par.role, warmup=p.critic_warmup)
            w = s.par.layout.world
            s.run.events(
                f"separated placement: the actor and reference on ranks 0-{w - 1}, the critic"
                f"{' and reward model' if cfg.rewards.model else ''} on ranks {w}-{2 * w - 1} "
                f"({s.par.layout.describe()})"
            )
        loss = PolicyLoss(
            clip_low=p.clip_low,
            clip_high=p.clip_high,
            loss_agg="token-mean",
            kl_coef=0.0,  # PPO's KL is in the reward
            temperature=p.temperature,
            dual_clip=p.dual_clip,
            entropy_coef=p.entropy_coef,
            routing_replay=p.routing_replay,
            **correction(p),
        )
        loss.console = (*PolicyLoss.console, "value_loss")
        loss.all_positions = s.par.sequence_sharded

        moments = RunningMoments() if p.normalize_rewards else None

        def wrap(loader, evaluate):  # validation: the rewards on held-out prompts
            rollouts = rollout_loader(
                s,
                loader,
                p,
                rewards,
                name=self.section,
                reference=reference,
                reward_model=reward_model,
                advantages=functools.partial(
                    gae_advantages, section=p, group=s.par.data_group, moments=moments
                ),
                values=functools.partial(critic_values, critic_model, s.par.sequence_sharded),
                old_logps=True,  # the KL in the reward needs them before training
                on_batch=functools.partial(CriticSide.hand_over, pair) if pair else None,
                on_validate=functools.partial(pair.tell, "validated") if pair else None,
                reuse=p.ppo_epochs * p.minibatches,
                minibatches=p.minibatches,
                trained=trained,
                keeps={"reward_moments": moments} if moments is not None else None,
            )
            if trained:  # idle while the policy generates
                rollouts.parking.add("critic", critic.model, critic.optimizer)
            return rollouts, evaluate

        return Training(self.samples, loss, wrap, trainer)

    def critic_setup(self, s: Setup, pair: Pair) -> Training:
        """The critic's group of a separated placement: its unit (built from `unit_config`), the
        reward model beside it, and the partner's rollouts as its batches."""
        p = s.cfg.ppo
        start_critic(s, [], s.unit.model)
        models = {"critic": s.unit.model, "reward": roles.reward_model(s.cfg, s.par, s.device, s.run.events)}

        def wrap(loader, evaluate):
            loader.close()  # the prompts are the actor's to read
            side = CriticSide(
                pair, models, s.unit.precision.autocast, p.ppo_epochs * p.minibatches, p.minibatches
            )
            return side, evaluate

        trainer = functools.partial(PairedTrainer, pair=pair, role=CRITIC)
        return Training(self.samples, critic_loss(s), wrap, trainer)


def critic_values(critic, all_positions: bool, batch: dict) -> None:
    """The critic's value at each response position (`old_values`, 0 elsewhere), in place."""
    mask = batch["targets"] != IGNORE_INDEX
    if all_positions:  # tensor parallel: every position's value, then the response's
        batch["old_values"] = critic(batch["tokens"])[..., 0].float() * mask
        return
    values = critic(batch["tokens"], keep=mask)[:, 0].float()
    batch["old_values"] = torch.zeros(mask.shape, device=values.device).masked_scatter(mask, values)


def critic_loss(s: Setup) -> ValueLoss:
    loss = ValueLoss(s.cfg.ppo.value_clip)
    loss.all_positions = s.par.sequence_sharded
    return loss


def start_critic(s: Setup, notes: list[str], model) -> None:
    """The critic's start: its value head zeroed (`ppo.value_head: zero`), and the run's event
    that says where it starts from."""
    cfg, p = s.cfg, s.cfg.ppo
    start = p.critic_init or cfg.rewards.model or cfg.model.init_from or "the policy initialisation"
    if p.value_head == "zero":
        roles.zero_value_head(model)  # (a resume then loads the trained head)
        head = " (head zeroed)"
    else:
        head = " (new head)" if any("score head: new" in n for n in notes) else " (its head)"
    warm = f"; it trains alone for the first {p.critic_warmup} steps" if p.critic_warmup else ""
    s.run.events(f"critic: a value head on {start}{head}, lr {p.critic_lr or cfg.optim.lr}{warm}")


RECIPE = PPO()
run = RECIPE.run
