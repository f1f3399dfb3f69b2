"""Group relative policy optimisation on the policy's own rollouts (`ladle run grpo`; the variants
of `grpo.*`: Dr. GRPO, DAPO's clip-higher, token-mean, dynamic sampling and overlong filtering,
GSPO, RLOO, REINFORCE++), from prompts prepared with `ladle data prepare --task prompts`.

Each step's prompts become a rollout batch (ladle/rl/loader.py): `grpo.num_samples` responses per
prompt sampled from the policy as it is laid out, scored by the rewards (`rewards.*`) and a
reward model, the reference's log-probs when `grpo.kl_coef` > 0, and group advantages
(ladle/rl/advantages.py). The same rollouts serve `grpo.num_iterations` optimizer steps of the
clipped policy loss (ladle/rl/losses.py `PolicyLoss`). What differs from PPO is here: no critic,
the advantage of a response against its group.

`grpo.placement: separated` puts a copy of the policy that only generates on half the ranks
(ladle/rl/separated.py): the trainer's half sends it the weights after each update and the
prompts due, and with `grpo.max_staleness` > 0 trains on one batch while the engine generates the
next ones.
"""

from __future__ import annotations

import functools

from ladle.config import LadleConfig
from ladle.data.prompts import PromptSplit
from ladle.recipes.base import Setup, Training
from ladle.recipes.rl import (
    RLRecipe,
    compute_dtype,
    correction,
    every_batch,
    local_engine,
    rollout_loader,
    vllm_engine,
)
from ladle.rl import env, roles
from ladle.rl.advantages import group_advantages
from ladle.rl.loader import end_ids, sampling_of
from ladle.rl.losses import PolicyLoss
from ladle.rl.placement import Pair
from ladle.rl.separated import ENGINE, Ahead, EngineClient, EngineSide, EngineTrainer, LinkedTrainer


class GRPO(RLRecipe):
    name = "grpo"
    section = "grpo"

    def check_layout(self, cfg: LadleConfig, layout) -> None:
        super().check_layout(cfg, layout)
        every_batch(cfg, cfg.grpo.num_iterations, "grpo.num_iterations")

    def placement(self, cfg: LadleConfig):
        if cfg.grpo.placement == "separated":
            return 2, (
                "grpo.placement=separated puts the trainer on one group of ranks and the engine (a copy of "
                "the policy that generates) on another"
            )
        return None

    def builds_model(self, cfg: LadleConfig, par) -> bool:
        # a separated vLLM engine rank: the copy that generates is vLLM's, fed by the trainer rank
        return not (cfg.grpo.placement == "separated" and par.role == ENGINE and cfg.grpo.engine == "vllm")

    def setup(self, s: Setup) -> Training:
        cfg, g = s.cfg, s.cfg.grpo
        pair = Pair(s.par.pair_group, s.device) if g.placement == "separated" else None
        loss = self.loss(s)
        if pair is not None and s.par.role == ENGINE:
            return self.engine_setup(s, pair, loss)
        rewards = roles.load_rewards(cfg, "grpo")
        reward_model = roles.reward_model(cfg, s.par, s.device, s.run.events)
        reference = (
            roles.frozen_reference(cfg, s.par, s.device, s.run.events, "grpo") if g.kl_coef > 0 else None
        )
        client = trainer = None
        if pair is not None:
            hf = (cfg.model, compute_dtype(s)) if g.engine == "vllm" else None
            t = cfg.train
            client = EngineClient(
                pair, s.unit.model, None, reuse=g.num_iterations, staleness=g.max_staleness, hf=hf,
                max_steps=t.max_steps, exit_at_step=t.exit_at_step,
            )  # fmt: skip
            trainer = functools.partial(LinkedTrainer, pair=pair, client=client)
            w = s.par.layout.world
            s.run.events(
                f"separated placement: the trainer on ranks 0-{w - 1}, the engine on ranks {w}-{2 * w - 1} "
                f"({s.par.layout.describe()}), batches up to {g.max_staleness} updates stale"
            )

        def wrap(loader, evaluate):  # validation: the rewards on held-out prompts (RolloutLoader.validate)
            advantages = functools.partial(group_advantages, section=g, group=s.par.data_group)
            rollouts = rollout_loader(
                s, loader, g, rewards, name=self.section, reference=reference, reward_model=reward_model,
                advantages=advantages, reuse=g.num_iterations, engine=client,
                on_validate=client.validated if client is not None else None,
            )  # fmt: skip
            if client is not None:  # the prompts read ahead by the batches the engine generates early
                rollouts.inner = client.prompts = Ahead(rollouts.inner)
            return rollouts, evaluate

        return Training(self.samples, loss, wrap, trainer)

    def engine_setup(self, s: Setup, pair: Pair, loss: PolicyLoss) -> Training:
        """The engine's group of a separated placement: its copy of the policy generates what
        the partner asks for; the prompts are the partner's to read."""

        g = s.cfg.grpo

        def wrap(loader, evaluate):
            loader.close()
            tok = s.found["tokenizer"]
            if g.engine == "vllm":  # in an engine process of its own, fed by the trainer rank
                engine = vllm_engine(s, g, "grpo", separated=True)
            else:
                engine = local_engine(s, g)
            # multi-turn episodes run on the engine's ranks, which turn together (their group)
            episodes = env.episodes_for(s.cfg, "grpo", tok, end_ids(tok), s.par, group=s.par.group)
            records = {split: PromptSplit(s.cfg.data.path, split).records for split in ("train", "val")}
            side = EngineSide(
                pair, engine, s.unit.model, sampling_of(g), episodes, records if episodes else None
            )
            return side, evaluate

        return Training(self.samples, loss, wrap, functools.partial(EngineTrainer, pair=pair))

    @staticmethod
    def loss(s: Setup) -> PolicyLoss:
        g = s.cfg.grpo
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
            routing_replay=g.routing_replay,
            **correction(g),
        )
        loss.all_positions = s.par.sequence_sharded
        return loss


RECIPE = GRPO()
run = RECIPE.run
