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
"""

from __future__ import annotations

import functools

import torch

from ladle import distributed as dist
from ladle.config import LadleConfig
from ladle.errors import ConfigError
from ladle.recipes import base
from ladle.recipes import grpo as grpo_recipe
from ladle.train.builder import build_model
from ladle.train.grpo import PolicyLoss, kl_penalty
from ladle.train.loop import Trainer
from ladle.train.loss import IGNORE_INDEX
from ladle.train.ppo import ValueLoss, gae, token_rewards
from ladle.train.unit import TrainUnit

DATA_TASK = "prompts"


def check_layout(cfg: LadleConfig, layout) -> None:
    grpo_recipe.check_layout(cfg, layout)  # rollouts: data parallel and FSDP; rewards.model
    p = cfg.ppo
    if cfg.train.grad_accum_steps % p.minibatches:
        raise ConfigError(
            f"ppo.minibatches ({p.minibatches}) must divide train.grad_accum_steps "
            f"({cfg.train.grad_accum_steps}): a minibatch is a share of each step's microbatches"
        )
    grpo_recipe.every_batch(cfg, p.ppo_epochs * p.minibatches, "ppo.ppo_epochs x ppo.minibatches")
    if p.critic_init:  # its shape and vocabulary, before launch
        grpo_recipe.scorer_config(cfg, p.critic_init, where="ppo.critic_init")


def samples(cfg: LadleConfig, split: str, found):
    return grpo_recipe.prompt_samples(cfg, split, found, section="ppo")


class PPORollouts(grpo_recipe.Rollouts):
    """GRPO's rollouts with the critic's values and PPO's per-token advantages (GAE)."""

    def __init__(self, *args, critic: TrainUnit, **kw):
        super().__init__(*args, **kw)
        self.critic = critic.model
        self.parking.add("critic", critic.model, critic.optimizer)  # idle while the policy generates
        self.trained = ("critic",)
        self.old_logps = True  # the KL in the reward needs them before training

    def score(self, batch: dict) -> None:
        mask = batch["targets"] != IGNORE_INDEX
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
        n, mean, var = grpo_recipe.global_moments(torch.cat(adv))
        kl_total = float(
            dist.all_reduce_sum(torch.tensor([kl_sum], dtype=torch.float64, device=dist.collective_device()))
        )
        if p.whiten_advantages and n > 1:
            inv = 1.0 / (var + 1e-8) ** 0.5
            for b in batches:
                mask = b["targets"] != IGNORE_INDEX
                b["advantages"] = (b["advantages"] - mean) * inv * mask
        return {"kl": kl_total / max(n, 1.0)} if self.reference is not None else {}


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
            "value_loss": result.loss,
            **result.metrics,
            "critic_grad_norm": update["grad_norm"],
        }
        out["finite"] = out["finite"] and update["finite"]
        return out


def setup(s: base.Setup):
    cfg, p = s.cfg, s.cfg.ppo
    rewards, records, reward_model = grpo_recipe.load_rewards(s)
    reference = grpo_recipe.frozen_reference(s, "ppo") if p.kl_coef > 0 else None
    critic_path = p.critic_init or cfg.rewards.model
    optim = cfg.optim.model_copy(update={"lr": p.critic_lr or cfg.optim.lr}).model_dump()
    critic_cfg = grpo_recipe.scorer_config(cfg, critic_path, optim=optim)
    built = build_model(critic_cfg, s.par, s.device, load=s.resume.path is None)
    critic = TrainUnit(critic_cfg, built.model, s.device, s.par)
    s.run.events(
        f"critic: a value head on {critic_path or cfg.model.init_from or 'the policy initialisation'}"
        f"{' (new head)' if any('score head: new' in n for n in built.notes) else ''}, lr {critic_cfg.optim.lr}"
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
            reuse=p.ppo_epochs * p.minibatches,
            minibatches=p.minibatches,
        )
        return rollouts, evaluate  # validation: the rewards on held-out prompts

    trainer = functools.partial(PPOTrainer, critic=critic, critic_loss=ValueLoss(p.value_clip))
    return base.Plan(samples, loss, wrap, trainer)


def run(cfg: LadleConfig) -> str:
    return base.run(cfg, "ppo", samples, setup=setup)
