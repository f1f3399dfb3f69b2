"""The models of an RL run besides the policy, and where they live: the frozen reference (the KL's),
the reward model (`rewards.model`), the critic (PPO's value model), each built from its own
start and laid out like the policy (ladle/train/builder.py); the rule rewards with the prompts'
records they read; and `Parking`, which keeps the models a phase does not use in host memory.
A separated placement's exchange between the groups of ranks is ladle/rl/placement.py.

Idle models in host memory: the shared placement keeps every model on every rank, and on an
accelerator moves those a phase does not use (the reference, the reward model, the critic and its
optimizer state while the policy generates) to host memory and back. `module.to(device)` is the
move for a plain model and for an FSDP2 one alike (FSDP2 re-registers its sharded parameters
after `_apply`, so each rank moves only its shards); an optimizer's state tensors move one by
one. On a CPU run the device is the host: nothing moves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ladle.checkpoint.init_from import resolve_init_from
from ladle.config import LadleConfig
from ladle.config.schema import ModelConfig
from ladle.data.prompts import PromptSplit
from ladle.errors import ConfigError, DataError, LadleError
from ladle.parallel.mesh import Parallel
from ladle.rl.rewards import Rewards
from ladle.train.builder import build_laid_out


def scorer_config(cfg: LadleConfig, path: str | None, where: str = "rewards.model", **changes) -> LadleConfig:
    """The run config for a model with a score head from `path` (its own shape; a causal LM gets
    a new head), or from the policy's start when `path` is None."""
    if path is None:
        model = cfg.model.model_copy(update={"head": "score"})
    else:
        try:
            model = resolve_init_from(
                ModelConfig(init_from=path, head="score", max_seq_len=cfg.model.max_seq_len)
            )
        except LadleError as e:
            raise ConfigError(f"{where}={path}: {e}") from None
    if model.vocab_size != cfg.model.vocab_size:
        raise ConfigError(
            f"{where}={path}: a vocabulary of {model.vocab_size} tokens, the policy's has "
            f"{cfg.model.vocab_size}; a reward or value model must share the policy's tokenizer"
        )
    return LadleConfig.model_validate(
        {**cfg.model_dump(), "model": model.model_dump(), "lora": None, **changes}
    )


def critic_config(cfg: LadleConfig) -> LadleConfig:
    """The critic's run config: a value head on `ppo.critic_init`, else `rewards.model`, else the
    policy's start, trained with `ppo.critic_lr`."""
    p = cfg.ppo
    optim = cfg.optim.model_copy(update={"lr": p.critic_lr or cfg.optim.lr}).model_dump()
    return scorer_config(cfg, p.critic_init or cfg.rewards.model, optim=optim)


@torch.no_grad()
def zero_value_head(model: torch.nn.Module) -> None:
    """A critic's value head set to zeros (`ppo.value_head: zero`): every value starts at 0. The
    shards of a laid-out head are zeroed in place."""
    model.score.weight.zero_()


def check_paths(cfg: LadleConfig, critic: bool = False) -> None:
    """The reward model's shape and vocabulary (and with `critic` the critic's start's), before
    launch."""
    if cfg.rewards.model:
        scorer_config(cfg, cfg.rewards.model)
    if critic and cfg.ppo.critic_init:
        scorer_config(cfg, cfg.ppo.critic_init, where="ppo.critic_init")


def reward_model(
    cfg: LadleConfig, par: Parallel, device, log: Callable[[str], None]
) -> torch.nn.Module | None:
    """The frozen reward model of `rewards.model` (None without one), laid out as `par`."""
    if not cfg.rewards.model:
        return None
    log(f"reward model: {cfg.rewards.model} (frozen), weight {cfg.rewards.model_weight}")
    return build_laid_out(scorer_config(cfg, cfg.rewards.model), par, device, trainable=False).model


def frozen_reference(cfg: LadleConfig, par: Parallel, device, log: Callable[[str], None], section: str):
    """The KL's reference: a frozen copy of the starting weights, laid out like the policy."""
    log(f"reference: a frozen copy of the starting weights, laid out like the policy ({section}.kl_coef > 0)")
    return build_laid_out(cfg, par, device, trainable=False).model


def load_rewards(cfg: LadleConfig, section: str | None = None) -> tuple[Rewards, dict[str, list[dict]]]:
    """The rule rewards and the prompts' records by split, checked for the fields the rewards read.
    `section` (`grpo`, `ppo`, `distill`): an environment of its `env` rewards too, and distillation
    needs none, so `rewards.terms` may be [] there."""
    env = getattr(cfg, section).env if section else None
    rewards = Rewards(
        cfg.rewards.terms,
        cfg.rewards.file,
        # others score too: a reward model, an environment; distillation trains without a reward
        model=cfg.rewards.model is not None
        or (env is not None and env.name is not None)
        or section == "distill",
        on_error=cfg.rewards.on_error,
    )
    splits = {split: PromptSplit(cfg.data.path, split) for split in ("train", "val")}
    records = {split: data.records for split, data in splits.items()}
    need = rewards.fields
    checks = [fn.check for _, _, fn in rewards.terms if hasattr(fn, "check")]  # a record's fields' shape
    for split, recs in records.items():
        for i, rec in enumerate(recs):
            missing = sorted(need - set(rec))
            if missing:
                raise DataError(
                    f"{cfg.data.path}: {split} prompt {i} has no field {missing[0]!r}, which rewards.terms "
                    f"read; prepare prompts whose records hold {', '.join(sorted(need))}"
                )
            for check in checks:
                try:
                    check(rec)
                except DataError as e:
                    raise DataError(
                        f"{splits[split].records_path}:{i + 1} ({split} prompt {i}): {e}"
                    ) from None
    return rewards, records


# -- parking: idle models in host memory ---------------------------------------------------------
HOST = torch.device("cpu")


def _park_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> list:
    """The state tensors on `device` to the host; returns where they were, for `_unpark_optimizer`
    (a non-fused AdamW's CPU step counters stay where they are)."""
    moved = []
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.device == device:
                state[k] = v.to(HOST)
                moved.append((state, k))
    return moved


def _unpark_optimizer(moved: list, device: torch.device) -> None:
    for state, k in moved:
        state[k] = state[k].to(device)


class Parking:
    """Named models (and optimizers) moved between `device` and the host. `where[name]` says
    where each is ("device" or "host"), for logs and tests."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.device = device
        self.enabled = enabled and device.type != "cpu"
        self.items: dict[str, tuple] = {}
        self.where: dict[str, str] = {}
        self._moved: dict[str, list] = {}

    def add(self, name: str, model, optimizer=None) -> None:
        """`model` (and its optimizer) under `name`; None, or a model on other ranks (a separated
        placement's `Remote`), is not parked."""
        if isinstance(model, torch.nn.Module):
            self.items[name] = (model, optimizer)
            self.where[name] = "device"

    def park(self, *names: str) -> None:
        """To host memory (a name not added is skipped)."""
        self._move([n for n in names if n in self.items], "host")

    def unpark(self, *names: str) -> None:
        """Back to the device, before use."""
        self._move([n for n in names if n in self.items], "device")

    def _move(self, names: list[str], to: str) -> None:
        for name in names:
            if self.where[name] == to:
                continue
            if self.enabled:
                model, optimizer = self.items[name]
                model.to(HOST if to == "host" else self.device)
                if optimizer is not None and to == "host":
                    self._moved[name] = _park_optimizer(optimizer, self.device)
                elif optimizer is not None:
                    _unpark_optimizer(self._moved.pop(name, []), self.device)
            self.where[name] = to
        if self.enabled and to == "host" and names and self.device.type == "cuda":
            torch.cuda.empty_cache()
