"""What the RL recipes (GRPO, PPO) share: prompt rows (`ladle data prepare --task prompts`), the
layouts rollouts run on, and the rollout loader assembled from the run's models: the policy
generating through the in-process engine, the rewards, the reference and reward model parked in
host memory while idle. The machinery is ladle/rl/; a recipe says what differs (its loss, its
models, its advantage)."""

from __future__ import annotations

from ladle import distributed as dist
from ladle.config import LadleConfig
from ladle.data.prompts import PromptSamples, PromptSplit
from ladle.data.tokenizer import load_tokenizer
from ladle.errors import ConfigError
from ladle.recipes.base import Recipe, Setup
from ladle.rl import env, roles, vllm
from ladle.rl.engine import LocalEngine
from ladle.rl.loader import RolloutLoader, end_ids
from ladle.rl.roles import Parking


class RLRecipe(Recipe):
    """A recipe trained on its own rollouts of prompts; `section`: its config section's name."""

    data_task = "prompts"  # `ladle data prepare --task prompts`
    rollouts = True
    section = ""

    def check_layout(self, cfg: LadleConfig, layout) -> None:
        for name, degree in (("pp", layout.pp), ("cp", layout.cp)):
            if degree > 1:
                raise ConfigError(
                    f"parallel.{name}={degree}: the RL recipes' rollouts run with data parallelism, FSDP and TP, "
                    f"not yet with {name.upper()}; set parallel.{name}: 1"
                )
        section, key = getattr(cfg, self.section), f"{self.section}.routing_replay"
        if section.routing_replay:
            if cfg.model.moe is None:
                raise ConfigError(
                    f"{key}: replays the experts an MoE policy's tokens went to; this model has no MoE layers"
                )
            if layout.tp > 1:
                raise ConfigError(
                    f"{key} with parallel.tp={layout.tp}: the routing is recorded without TP for now"
                )

    def check_paths(self, cfg: LadleConfig) -> None:
        roles.check_paths(cfg)
        self.check_engine(cfg)
        self.check_env(cfg)

    def check_env(self, cfg: LadleConfig) -> None:
        """An environment's class and tools load, and the chat template can call them and append
        turns (`env`), before launch."""
        if getattr(cfg, self.section).env is None:
            return
        tok = load_tokenizer(cfg.tokenizer.path)
        episodes = env.episodes_for(cfg, self.section, tok, end_ids(tok))
        episodes.close()

    def check_engine(self, cfg: LadleConfig) -> None:
        """The rollout engine is installed and takes its arguments (`engine: vllm`)."""
        section = getattr(cfg, self.section)
        if section.engine == "vllm":
            vllm.check(section, cfg.model, self.section)
        elif section.engine_args:
            raise ConfigError(
                f"{self.section}.engine_args: arguments for the vLLM engine, but {self.section}.engine is "
                f"{section.engine}; set {self.section}.engine: vllm or remove them"
            )

    def samples(self, cfg: LadleConfig, split: str, found) -> PromptSamples:
        tok = found["tokenizer"]
        cap = getattr(cfg, self.section).max_response_len
        room = cfg.data.seq_len - cap  # a row: prompt + response
        if room < 1:
            raise ConfigError(
                f"{self.section}.max_response_len ({cap}) leaves no room for a prompt in "
                f"data.seq_len ({cfg.data.seq_len}), the length of prompt + response"
            )
        pad = tok.pad_id if tok.pad_id is not None else 0
        return PromptSamples(PromptSplit(cfg.data.path, split), room, pad_id=pad, name=split)


def correction(section) -> dict:
    """PolicyLoss's rollout-correction arguments from an RL config section."""
    return {
        "correction": section.rollout_correction,
        "correction_level": section.rollout_correction_level,
        "correction_cap": section.rollout_correction_cap,
    }


def every_batch(cfg: LadleConfig, steps: int, name: str) -> None:
    """Checkpoints fall between rollout batches, never among the updates of one."""
    if cfg.checkpoint.every and cfg.checkpoint.every % steps:
        raise ConfigError(
            f"checkpoint.every ({cfg.checkpoint.every}) must be a multiple of {name} ({steps}): a "
            "checkpoint inside a rollout batch's updates would resume without its old log-probs"
        )


def compute_dtype(s: Setup):
    """The dtype the policy computes in (a vLLM engine's)."""
    return s.unit.precision.autocast_dtype or s.unit.precision.param_dtype


def local_engine(s: Setup, section) -> LocalEngine:
    """ladle's engine: the model `s.unit` trains samples as it is laid out."""
    tok = s.found["tokenizer"]
    return LocalEngine(
        s.unit.model,
        seed=s.cfg.seed,
        end_ids=end_ids(tok),
        decode=tok.decode,
        pad_id=tok.pad_id if tok.pad_id is not None else 0,
        batch_size=section.rollout_batch,
        group=s.par.group,  # the ranks of the model's layout (this group of a separated placement)
        seq_multiple=s.par.layout.tp,
        context=s.unit.numerics,
        routing=records_routing(s),
    )


def vllm_engine(s: Setup, section, name: str, separated: bool = False) -> vllm.VLLMEngine:
    """vLLM's engine for the section `name` (`grpo`, `ppo`): in this process, fed the policy `s.unit`
    trains, or (`separated`) on an engine rank of its own, fed by the paired trainer rank. A vLLM
    that cannot record an MoE policy's routing is said in events.log."""
    tok = s.found["tokenizer"]
    engine = vllm.VLLMEngine(
        None if separated else s.unit.model,
        s.cfg.model,
        optimizer=None if separated else s.unit.optimizer,
        seed=s.cfg.seed,
        end_ids=end_ids(tok),
        decode=tok.decode,
        dtype=compute_dtype(s),
        max_len=s.cfg.data.seq_len,
        engine_args=section.engine_args,
        device=s.device,
        where=f"{name}.engine_args",
        separated=separated,
        routing=records_routing(s),
        replay=section.routing_replay,
    )
    if engine.unrecorded:
        s.run.events(f"routing_agreement is not logged: {engine.unrecorded}", level="warning")
    return engine


def records_routing(s: Setup) -> bool:
    """An MoE policy's routing is recorded as it samples, for routing_agreement and replay (not
    under TP's sequence shards)."""
    return s.cfg.model.moe is not None and s.par.layout.tp == 1


def rollout_loader(
    s: Setup,
    inner,
    section,
    rewards: tuple,
    *,
    name: str,
    reference=None,
    reward_model=None,
    engine=None,
    **kw,
) -> RolloutLoader:
    """The loop's loader of rollout batches made from `inner`'s prompts: the policy generates in
    this process (`LocalEngine`, or vLLM's engine fed its weights: `VLLMEngine`) unless another
    `engine` is given (a separated placement's), the rule `rewards` (`roles.load_rewards`: the
    terms and the prompts' records) and `reward_model` score, `reference` gives the KL's
    log-probs; `name`: the section's (`grpo`, `ppo`); `kw`: RolloutLoader's (advantages, reuse, ...)."""
    tok = s.found["tokenizer"]
    rewards, records = rewards
    # another engine (a separated placement's) generates elsewhere: nothing here to make room for
    parking = Parking(s.device, enabled=section.offload_idle and engine is None)
    parking.add("reference", reference)
    parking.add("reward", reward_model)
    if engine is None and section.engine == "vllm":
        engine = vllm_engine(s, section, name)
    elif engine is None:
        engine = local_engine(s, section)
    return RolloutLoader(
        inner,
        episodes=env.episodes_for(s.cfg, name, tok, end_ids(tok), s.par, group=s.par.group),
        section=section,
        engine=engine,
        tokenizer=tok,
        rewards=rewards,
        records=records,
        unit=s.unit,
        seed=s.cfg.seed,
        parking=parking,
        reference=reference,
        reward_model=reward_model,
        reward_weight=s.cfg.rewards.model_weight,
        log=lambda msg, level="info": s.run.events(msg, level=level),
        rollouts_log=s.run.dir / "rollouts.jsonl" if section.log_rollouts and dist.is_main() else None,
        **kw,
    )
