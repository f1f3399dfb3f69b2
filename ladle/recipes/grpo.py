"""Group relative policy optimisation on the policy's own rollouts (`ladle run grpo`; the variants
of `grpo.*`: Dr. GRPO, DAPO's clip-higher, token-mean, dynamic sampling and overlong filtering,
GSPO, RLOO, REINFORCE++), from prompts prepared with `ladle data prepare --task prompts`.

Each step's prompts become a rollout batch (ladle/rl/loader.py): `grpo.num_samples` responses per
prompt sampled from the policy as it is laid out, scored by the rewards (`rewards.*`) and a
reward model, the reference's log-probs when `grpo.kl_coef` > 0, and group advantages
(ladle/rl/advantages.py). The same rollouts serve `grpo.num_iterations` optimizer steps of the
clipped policy loss (ladle/rl/losses.py `PolicyLoss`). What differs from PPO is here: no critic,
the advantage of a response against its group.
"""

from __future__ import annotations

import functools

from ladle.config import LadleConfig
from ladle.recipes.base import Setup, Training
from ladle.recipes.rl import RLRecipe, correction, every_batch, rollout_loader
from ladle.rl import roles
from ladle.rl.advantages import group_advantages
from ladle.rl.losses import PolicyLoss


class GRPO(RLRecipe):
    name = "grpo"
    section = "grpo"

    def check_layout(self, cfg: LadleConfig, layout) -> None:
        super().check_layout(cfg, layout)
        every_batch(cfg, cfg.grpo.num_iterations, "grpo.num_iterations")

    def setup(self, s: Setup) -> Training:
        cfg, g = s.cfg, s.cfg.grpo
        rewards = roles.load_rewards(cfg)
        reward_model = roles.reward_model(cfg, s.par, s.device, s.run.events)
        reference = (
            roles.frozen_reference(cfg, s.par, s.device, s.run.events, "grpo") if g.kl_coef > 0 else None
        )
        loss = PolicyLoss(
            clip_low=g.clip_low,
            clip_high=g.clip_high,
            importance=g.importance,
            loss_agg=g.loss_agg,
            max_len=g.max_response_len,
            kl_coef=g.kl_coef,
            kl_estimator=g.kl_estimator,
            temperature=g.temperature,
            entropy_coef=g.entropy_coef,
            **correction(g),
        )
        loss.all_positions = s.par.sequence_sharded

        def wrap(loader, evaluate):  # validation: the rewards on held-out prompts (RolloutLoader.validate)
            advantages = functools.partial(group_advantages, section=g, group=s.par.data_group)
            rollouts = rollout_loader(
                s, loader, g, rewards, name=self.section, reference=reference, reward_model=reward_model,
                advantages=advantages, reuse=g.num_iterations,
            )  # fmt: skip
            return rollouts, evaluate

        return Training(self.samples, loss, wrap)


RECIPE = GRPO()
run = RECIPE.run
