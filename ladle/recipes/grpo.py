"""Group relative policy optimisation on the policy's own rollouts (`ladle run grpo`; the variants
of `grpo.*`: Dr. GRPO, DAPO's clip-higher and token-mean, GSPO, RLOO, REINFORCE++), from prompts
prepared with `ladle data prepare --task prompts`.

Each step's prompts come from the shared loader as any recipe's rows; `Rollouts` turns them into
training rows before the loop sees them: `grpo.num_samples` responses per prompt sampled from the
policy as it is laid out (ladle/train/rollout.py), scored by the rewards (`rewards.*`,
ladle/rewards.py), group advantages, the sampling policy's log-probs from the training forward,
and the reference's when `grpo.kl_coef` > 0. The same rollouts serve `grpo.num_iterations`
optimizer steps. The loss is ladle/train/grpo.py's `PolicyLoss`; the loop, checkpoints and
layouts are every recipe's (ladle/recipes/base.py).
"""

from __future__ import annotations

import time

import torch

from ladle import distributed as dist
from ladle.config import LadleConfig
from ladle.data.chat import END_OF_TURN
from ladle.data.prompts import PromptSamples, PromptSplit
from ladle.errors import ConfigError, DataError
from ladle.recipes import base
from ladle.rewards import Rewards
from ladle.train.builder import build_model
from ladle.train.grpo import PolicyLoss, advantages
from ladle.train.rollout import Sampling, logprob_diff, response_logps, rollout, sequences

DATA_TASK = "prompts"  # `ladle data prepare --task prompts`


def check_layout(cfg: LadleConfig, layout) -> None:
    for name, degree in (("tp", layout.tp), ("pp", layout.pp), ("cp", layout.cp)):
        if degree > 1:
            raise ConfigError(
                f"parallel.{name}={degree}: GRPO's rollouts run with data parallelism and FSDP, not yet "
                f"with {name.upper()}; set parallel.{name}: 1"
            )
    if cfg.checkpoint.every and cfg.checkpoint.every % cfg.grpo.num_iterations:
        raise ConfigError(
            f"checkpoint.every ({cfg.checkpoint.every}) must be a multiple of grpo.num_iterations "
            f"({cfg.grpo.num_iterations}): a checkpoint inside a rollout batch's iterations would resume "
            "without its old log-probs"
        )


def prompt_samples(cfg: LadleConfig, split: str, found) -> PromptSamples:
    tok = found["tokenizer"]
    room = cfg.data.seq_len - cfg.grpo.max_response_len  # a row: prompt + response
    if room < 1:
        raise ConfigError(
            f"grpo.max_response_len ({cfg.grpo.max_response_len}) leaves no room for a prompt in "
            f"data.seq_len ({cfg.data.seq_len}), the length of prompt + response"
        )
    pad = tok.pad_id if tok.pad_id is not None else 0
    return PromptSamples(PromptSplit(cfg.data.path, split), room, pad_id=pad, name=split)


class Rollouts:
    """A loader of rollout batches: each step's prompt microbatches (from `inner`) become batches
    of sampled responses with their advantages and old (and reference) log-probs. `step_metrics`:
    the rewards and rollout figures of the last rollout, over every rank."""

    console = ("reward_mean",)

    def __init__(self, inner, policy, reference, rewards: Rewards, records, cfg: LadleConfig, tok, device):
        self.inner, self.policy, self.reference, self.rewards = inner, policy, reference, rewards
        self.records, self.cfg, self.tok, self.device = records, cfg, tok, device
        g = cfg.grpo
        self.sampling = Sampling(
            n=g.num_samples,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            max_new_tokens=g.max_response_len,
            stop=tuple(g.stop),
        )
        ends = {tok.eos_id, *(tok.token_to_id(t) for t in END_OF_TURN)}
        self.end_ids = {i for i in ends if i is not None}
        self.pad = tok.pad_id if tok.pad_id is not None else 0
        self.cached: list[dict] | None = None
        self.uses = 0
        self.data_s = 0.0
        self.metrics: dict[str, float] = {}

    # the loop's loader interface --------------------------------------------------------------
    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
        self.cached, self.uses = None, 0

    def close(self) -> None:
        self.inner.close()

    def step_metrics(self) -> dict:
        return dict(self.metrics)

    def next(self) -> list[dict]:
        if self.cached is not None and self.uses < self.cfg.grpo.num_iterations:
            self.uses += 1
            self.data_s = 0.0
            return self.cached
        step = self.inner.consumed_samples // max(self.inner.layout.global_batch, 1)  # before next()
        micro = self.inner.next()
        t0 = time.perf_counter()
        self.cached = self.make(micro, step)
        self.uses = 1
        self.data_s = self.inner.data_s + time.perf_counter() - t0
        return self.cached

    # rollouts ----------------------------------------------------------------------------------
    def make(self, micro: list[dict], step: int) -> list[dict]:
        t0 = time.perf_counter()
        out, parts, diffs, gen_tokens = [], {}, [], 0
        for b in micro:
            prompts = [row[-int(n) :].tolist() for row, n in zip(b["prompt"], b["prompt_len"], strict=True)]
            index = b["index"].tolist()
            prompt_text = {i: self.tok.decode(p) for i, p in zip(index, prompts, strict=True)}
            r = rollout(
                self.policy,
                prompts,
                index,
                self.sampling,
                seed=self.cfg.seed,
                step=step,
                end_ids=self.end_ids,
                decode=self.tok.decode,
                pad_id=self.pad,
                batch_size=self.cfg.grpo.rollout_batch,
            )
            gen_tokens += sum(len(x) for x in r.response_ids)
            rewards, terms = [], {}
            for i, resp, n in zip(r.prompt_index, r.response_ids, map(len, r.response_ids), strict=True):
                text = self.tok.decode([t for t in resp if t not in self.end_ids])
                total, each = self.rewards(text, self.records[i], prompt=prompt_text[i], response_tokens=n)
                rewards.append(total)
                for k, v in each.items():
                    terms.setdefault(k, []).append(v)
            batch = {k: v.to(self.device) for k, v in sequences(r, self.pad).items()}
            rew = torch.tensor(rewards)
            batch["advantages"] = advantages(
                rew, self.sampling.n, self.cfg.grpo.advantage, self.cfg.grpo.scale
            ).to(self.device)
            with torch.no_grad():
                batch["old_logps"] = response_logps(self.policy, batch, self.sampling.temperature)
                if self.reference is not None:
                    batch["ref_logps"] = response_logps(self.reference, batch, self.sampling.temperature)
            diffs.append(logprob_diff(r, batch["old_logps"], batch))
            for k, v in {"reward": rewards, **{f"reward_{k}": v for k, v in terms.items()}}.items():
                parts.setdefault(k, []).extend(v)
            parts.setdefault("response_len", []).extend(len(x) for x in r.response_ids)
            out.append(batch)
        gen_s = time.perf_counter() - t0
        self.metrics = self._reduce(parts, max(diffs, default=0.0), gen_tokens, gen_s)
        return out

    def _reduce(self, parts: dict, diff: float, gen_tokens: int, gen_s: float) -> dict:
        """Means over every rank's responses; the largest log-prob difference and generation time;
        the ranks' balance (max over mean of their generated tokens)."""
        keys = sorted(parts)
        dev = dist.collective_device()
        sums = [float(sum(parts[k])) for k in keys] + [float(len(parts["reward"])), float(gen_tokens)]
        sums = dist.all_reduce_sum(torch.tensor(sums, dtype=torch.float64, device=dev)).tolist()
        high = dist.all_reduce_max(
            torch.tensor([diff, float(gen_tokens), gen_s], dtype=torch.float64, device=dev)
        )
        diff_max, tokens_max, gen_s_max = high.tolist()
        n, total = max(sums[-2], 1.0), sums[-1]
        out = {f"{k}_mean": sums[j] / n for j, k in enumerate(keys)}
        mean_tokens = total / dist.world_size()
        out.update(
            rollout_logprob_diff=diff_max,
            rollout_imbalance=tokens_max / mean_tokens if mean_tokens else 1.0,
            rollout_tokens_per_s=total / max(gen_s_max, 1e-9),
            gen_s=gen_s_max,
        )
        return out


def setup(s: base.Setup):
    cfg = s.cfg
    rewards = Rewards(cfg.rewards.terms, cfg.rewards.file)
    split = PromptSplit(cfg.data.path, "train")
    need = rewards.fields
    for i, rec in enumerate(split.records):
        missing = sorted(need - set(rec))
        if missing:
            raise DataError(
                f"{cfg.data.path}: prompt {i} has no field {missing[0]!r}, which rewards.terms read; "
                f"prepare prompts whose records hold {', '.join(sorted(need))}"
            )
    g = cfg.grpo
    reference = None
    if g.kl_coef > 0:
        reference = build_model(cfg, s.par, s.device, trainable=False).model
        s.run.events(
            "reference: a frozen copy of the starting weights, laid out like the policy (grpo.kl_coef > 0)"
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
    )
    tok = s.found["tokenizer"]

    def wrap(loader, evaluate):
        # validation of a policy is its rewards on held-out prompts, not a loss: not yet
        return Rollouts(loader, s.unit.model, reference, rewards, split.records, cfg, tok, s.device), None

    return prompt_samples, loss, wrap


def run(cfg: LadleConfig) -> str:
    return base.run(cfg, "grpo", prompt_samples, setup=setup)
