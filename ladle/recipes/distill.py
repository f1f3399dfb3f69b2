"""On-policy distillation (`ladle run distill`, section `distill`): the student (the run's model)
samples responses to the prompts with either engine, a frozen teacher (`distill.teacher`: any
model ladle loads, also a larger one, laid out by `parallel.*` like the student) runs its forward
on the same tokens in the training step, and the student minimises the divergence of its
next-token distribution from the teacher's at every response token (ladle/rl/losses.py
`DistillLoss`: reverse KL, as on-policy distillation; GKD's forward KL or generalised JSD). The
rewards are scored and logged (and validated on held-out prompts) as in GRPO; with
`distill.reward_weight` > 0 they also train, as REINFORCE against each prompt's group mean.

The teacher must read the student's tokens as the student does: the same tokenizer, or one that
gives every student token the same id (its extra tokens are dropped from its distribution).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

from ladle.checkpoint.catalogue import read_config
from ladle.checkpoint.dcp import resolve_checkpoint
from ladle.checkpoint.init_from import resolve_init_from
from ladle.config import LadleConfig
from ladle.config.schema import ModelConfig
from ladle.data.tokenizer import load_tokenizer
from ladle.errors import ConfigError, LadleError
from ladle.models.hf.config import is_hf_folder
from ladle.recipes.base import Setup, Training
from ladle.recipes.rl import RLRecipe, rollout_loader
from ladle.rl import roles
from ladle.rl.advantages import group_advantages
from ladle.rl.losses import DistillLoss
from ladle.train.builder import build_laid_out


def teacher_config(cfg: LadleConfig) -> LadleConfig:
    """The teacher's run config: its own shape (from its config.json or run config), frozen."""
    path = cfg.distill.teacher
    if not path:
        raise ConfigError(
            "distill.teacher: name the teacher (a ladle run dir or checkpoint, or a Hugging Face folder)"
        )
    try:
        model = resolve_init_from(ModelConfig(init_from=path, max_seq_len=cfg.model.max_seq_len))
    except LadleError as e:
        raise ConfigError(f"distill.teacher={path}: {e}") from None
    if model.vocab_size < cfg.model.vocab_size:
        raise ConfigError(
            f"distill.teacher={path}: a vocabulary of {model.vocab_size} tokens, fewer than the student's "
            f"{cfg.model.vocab_size}; the teacher must score every token the student can sample"
        )
    return LadleConfig.model_validate({**cfg.model_dump(), "model": model.model_dump(), "lora": None})


def teacher_tokenizer(path: str) -> Path:
    """The folder of the teacher's tokenizer: a Hugging Face folder's own, or its run's."""
    if is_hf_folder(path):
        return Path(path)
    return Path(read_config(resolve_checkpoint(path, check=lambda *a, **k: None))["tokenizer"]["path"])


def check_tokenizers(cfg: LadleConfig) -> str:
    """The teacher reads the student's tokens as the student does: the same tokenizer file, or
    every student token at the same id in the teacher's; the way it matched, else a ConfigError."""
    student = load_tokenizer(cfg.tokenizer.path)
    where = teacher_tokenizer(cfg.distill.teacher)
    try:
        teacher = load_tokenizer(where)
    except LadleError as e:
        raise ConfigError(
            f"distill.teacher={cfg.distill.teacher}: its tokenizer ({where}) cannot be read: {e}"
        ) from None
    if teacher.hash == student.hash:
        return "the same tokenizer"
    mine, theirs = (
        student._tok.get_vocab(with_added_tokens=True),
        teacher._tok.get_vocab(with_added_tokens=True),
    )
    for token, i in sorted(mine.items(), key=lambda kv: kv[1]):
        if theirs.get(token) != i:
            raise ConfigError(
                f"distill.teacher={cfg.distill.teacher}: its tokenizer ({where}) differs from the student's "
                f"({cfg.tokenizer.path}): token {token!r} is id {i} for the student and "
                f"{theirs.get(token, 'absent')} for the teacher; distillation compares their distributions "
                "token by token, so the teacher needs the student's vocabulary"
            )
    return (
        f"the student's {len(mine)} tokens at the same ids ({len(theirs) - len(mine)} teacher tokens dropped)"
    )


class Distill(RLRecipe):
    name = "distill"
    section = "distill"

    def check_layout(self, cfg: LadleConfig, layout) -> None:
        if cfg.distill.routing_replay:
            raise ConfigError(
                "distill.routing_replay: the distillation loss does not replay the sampler's routing yet; "
                "remove it (routing_agreement is a GRPO and PPO figure)"
            )
        super().check_layout(cfg, layout)
        if layout.tp > 1:
            raise ConfigError(
                f"parallel.tp={layout.tp}: distillation scores the whole vocabulary at every response token, "
                "which under TP would be vocabulary shards: not yet; shard with FSDP (parallel.dp_shard)"
            )

    def check_paths(self, cfg: LadleConfig) -> None:
        super().check_paths(cfg)
        teacher_config(cfg)
        check_tokenizers(cfg)

    def setup(self, s: Setup) -> Training:
        cfg, d = s.cfg, s.cfg.distill
        tcfg = teacher_config(cfg)
        matched = check_tokenizers(cfg)
        teacher = build_laid_out(tcfg, s.par, s.device, trainable=False).model
        s.run.events(
            f"teacher: {d.teacher} ({tcfg.model.dim} wide, {tcfg.model.n_layers} layers; {matched}), frozen, "
            f"laid out like the student; loss {d.loss}"
        )
        rewards = roles.load_rewards(cfg, "distill")
        reward_model = roles.reward_model(cfg, s.par, s.device, s.run.events)
        loss = DistillLoss(
            teacher, kind=d.loss, beta=d.beta, temperature=d.temperature, reward_weight=d.reward_weight
        )
        # the group advantages of the rewards (GRPO's, mean-centred) for the REINFORCE term
        section = SimpleNamespace(num_samples=d.num_samples, advantage="grpo", scale="none")

        def wrap(loader, evaluate):
            advantages = functools.partial(group_advantages, section=section, group=s.par.data_group)
            rollouts = rollout_loader(
                s, loader, d, rewards, name=self.section, reward_model=reward_model, advantages=advantages
            )
            rollouts.parking.add("teacher", teacher)
            rollouts.trained = ("teacher",)  # parked while the student generates, back for the loss
            return rollouts, evaluate

        return Training(self.samples, loss, wrap)


RECIPE = Distill()
run = RECIPE.run
