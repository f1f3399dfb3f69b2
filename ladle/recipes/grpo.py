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

import contextlib
import time

import torch

from ladle import distributed as dist
from ladle import watchdog
from ladle.config import LadleConfig
from ladle.config.schema import ModelConfig
from ladle.data.chat import END_OF_TURN
from ladle.data.prompts import PromptSamples, PromptSplit
from ladle.errors import ConfigError, DataError, LadleError
from ladle.prelaunch import resolve_init_from
from ladle.recipes import base
from ladle.rewards import Rewards
from ladle.train.builder import build_model
from ladle.train.grpo import EPS, PolicyLoss, advantages
from ladle.train.loss import IGNORE_INDEX
from ladle.train.offload import Parking
from ladle.train.rollout import (
    Sampling,
    balance,
    imbalance,
    logprob_diff,
    response_logps,
    rollout,
    score_at,
    sequences,
)

DATA_TASK = "prompts"  # `ladle data prepare --task prompts`


def check_layout(cfg: LadleConfig, layout) -> None:
    for name, degree in (("pp", layout.pp), ("cp", layout.cp)):
        if degree > 1:
            raise ConfigError(
                f"parallel.{name}={degree}: the RL recipes' rollouts run with data parallelism, FSDP and TP, "
                f"not yet with {name.upper()}; set parallel.{name}: 1"
            )
    every_batch(cfg, cfg.grpo.num_iterations, "grpo.num_iterations")


def check_paths(cfg: LadleConfig) -> None:
    """The reward model's shape and vocabulary, before launch (where the files are)."""
    if cfg.rewards.model:
        scorer_config(cfg, cfg.rewards.model)


def every_batch(cfg: LadleConfig, steps: int, name: str) -> None:
    if cfg.checkpoint.every and cfg.checkpoint.every % steps:
        raise ConfigError(
            f"checkpoint.every ({cfg.checkpoint.every}) must be a multiple of {name} ({steps}): a "
            "checkpoint inside a rollout batch's updates would resume without its old log-probs"
        )


def prompt_samples(cfg: LadleConfig, split: str, found, section: str = "grpo") -> PromptSamples:
    tok = found["tokenizer"]
    cap = getattr(cfg, section).max_response_len
    room = cfg.data.seq_len - cap  # a row: prompt + response
    if room < 1:
        raise ConfigError(
            f"{section}.max_response_len ({cap}) leaves no room for a prompt in "
            f"data.seq_len ({cfg.data.seq_len}), the length of prompt + response"
        )
    pad = tok.pad_id if tok.pad_id is not None else 0
    return PromptSamples(PromptSplit(cfg.data.path, split), room, pad_id=pad, name=split)


class Rollouts:
    """A loader of rollout batches: each step's prompt microbatches (from `inner`) become batches
    of sampled responses scored by the rewards (and a reward model), with the old (and reference)
    log-probs and GRPO's group advantages (`advantages`, which PPO's subclass replaces). A batch
    serves `reuse` optimizer steps, cycling over `minibatches` slices of its microbatches.
    `step_metrics`: the rewards and rollout figures of the last rollout, over every rank."""

    console = ("reward_mean",)

    def __init__(
        self,
        inner,
        s: base.Setup,
        section,
        rewards: Rewards,
        records,
        *,
        reference=None,
        reward_model=None,
        reuse: int = 1,
        minibatches: int = 1,
    ):
        cfg, tok = s.cfg, s.found["tokenizer"]
        self.inner, self.policy, self.reference, self.rewards = inner, s.unit.model, reference, rewards
        self.reward_model, self.records = reward_model, records
        self.cfg, self.tok, self.device = cfg, tok, s.device
        self.section, self.reuse, self.minibatches = section, reuse, minibatches
        self.sampling = Sampling(
            n=section.num_samples,
            temperature=section.temperature,
            top_p=section.top_p,
            top_k=section.top_k,
            max_new_tokens=section.max_response_len,
            stop=tuple(section.stop),
        )
        ends = {tok.eos_id, *(tok.token_to_id(t) for t in END_OF_TURN)}
        self.end_ids = {i for i in ends if i is not None}
        self.pad = tok.pad_id if tok.pad_id is not None else 0
        self.unit = s.unit
        # the rows' bookkeeping is over the data-parallel ranks (a TP group holds the same rows);
        # generation syncs every rank of the model's layout (this group of a separated placement)
        self.group, self.forward_group = s.par.data_group, s.par.group
        # tensor parallelism: every forward a multiple of tp positions (sequence shards), and the
        # heads run at every position (a rank holds a slice of them, not the ones to pick)
        self.tp = s.par.layout.tp
        self.all_positions = s.par.sequence_sharded
        # shared placement: the models a phase does not use wait in host memory (accelerators)
        self.parking = Parking(s.device, enabled=section.offload_idle)
        self.parking.add("reference", reference)
        self.parking.add("reward", reward_model)
        self.trained: tuple[str, ...] = ()  # parked models the training step needs back (PPO's critic)
        # a batch trained on once, whole, needs no forward pass for its old log-probs: the loss
        # takes its own, detached (PolicyLoss); PPO needs them before training (its KL reward)
        self.old_logps = reuse > 1 or minibatches > 1
        self.cached: list[dict] | None = None
        self.bounds: list[int] = []  # where each minibatch's microbatches start in `cached`
        self.uses = 0
        self.data_s = 0.0
        self.metrics: dict[str, float] = {}

    @contextlib.contextmanager
    def context(self):
        """The training forward's numerics (autocast; loss-parallel scoring of vocabulary shards
        under TP), so old log-probs equal the loss's at the first update and the rollout's
        sampling matches them."""
        with self.unit.precision.autocast(), self.unit.parallel.loss_context():
            yield

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

    def batch_samples(self) -> dict | None:
        """The prompts of the rollout batch the last step trained on."""
        return self.inner.batch_samples()

    def next(self) -> list[dict]:
        if self.cached is None or self.uses >= self.reuse:
            step = self.inner.consumed_samples // max(self.inner.global_batch, 1)  # before next()
            micro = self.inner.next()
            watchdog.phase("generation (rollouts)")
            t0 = time.perf_counter()
            self.cached = self.make(micro, step)
            self.uses = 0
            self.data_s = self.inner.data_s + time.perf_counter() - t0
        else:
            self.data_s = 0.0
        self.parking.unpark(*self.trained)
        k = self.uses % self.minibatches
        self.uses += 1
        return self.cached[self.bounds[k] : self.bounds[k + 1]]

    # rollouts ----------------------------------------------------------------------------------
    def sample(self, b: dict, step: int, split: str = "train"):
        """A prompt microbatch's responses: (the rollouts, their rewards (float64), each reward
        term's values by key, with `reward` and `response_len`)."""
        prompts = [row[-int(n) :].tolist() for row, n in zip(b["prompt"], b["prompt_len"], strict=True)]
        index = b["index"].tolist()
        prompt_text = {i: self.tok.decode(p) for i, p in zip(index, prompts, strict=True)}
        self.parking.park(*self.parking.items)  # the policy alone generates
        with self.context():
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
                batch_size=self.section.rollout_batch,
                group=self.forward_group,
                seq_multiple=self.tp,
            )
        records = self.records[split]
        rewards, terms = [], {}
        for i, resp, n in zip(r.prompt_index, r.response_ids, map(len, r.response_ids), strict=True):
            text = self.tok.decode([t for t in resp if t not in self.end_ids])
            total, each = self.rewards(text, records[i], prompt=prompt_text[i], response_tokens=n)
            rewards.append(total)
            for k, v in each.items():
                terms.setdefault(k, []).append(v)
        rew = torch.tensor(rewards, dtype=torch.float64)
        if self.reward_model is not None:  # its score of the whole sequence, at the last token
            self.parking.unpark("reward")
            batch = sequences(r, self.pad, self.tp)
            with torch.no_grad(), self.context():
                tokens, at = batch["tokens"].to(self.device), (batch["lengths"] - 1).to(self.device)
                score = score_at(self.reward_model, tokens, at, self.all_positions).double().cpu()
            terms["model"] = score.tolist()
            rew = rew + self.cfg.rewards.model_weight * score
            self.parking.park("reward")
        terms = {"reward": rew.tolist(), **{f"reward_{k}": v for k, v in terms.items()}}
        terms["response_len"] = [len(x) for x in r.response_ids]
        return r, rew, terms

    def make(self, micro: list[dict], step: int) -> list[dict]:
        t0 = time.perf_counter()
        sampled = [self.sample(b, step) for b in micro]
        parts: dict[str, list] = {}
        for _, _, terms in sampled:
            collect(parts, terms)
        extra = {}
        chunks = [(r, rew, True) for r, rew, _ in sampled]
        dynamic = getattr(self.section, "dynamic_sampling", False)
        exchange = self.section.balance and dist.world_size(self.group) > 1
        budget, m = self.section.micro_tokens, self.minibatches
        if dynamic or exchange or budget:
            groups = self.groups(chunks, 0)
            if dynamic:
                groups, extra = self.refill(groups, parts)
            if exchange:
                groups, extra["train_imbalance"] = self.exchange(groups)
            # each minibatch a share of the groups (in key order), cut into training passes
            groups.sort(key=lambda g: g[0])
            fallback, per_share, chunks = chunks[0], len(chunks) // m, []
            self.bounds = [0]
            for j in range(m):
                share = groups[j * len(groups) // m : (j + 1) * len(groups) // m]
                if budget:
                    chunks += self.by_tokens(share, budget, fallback)
                else:
                    chunks += self.spread(share, per_share, fallback)
                self.bounds.append(len(chunks))
        else:
            self.bounds = [j * len(chunks) // m for j in range(m + 1)]
        out, diffs = [], []
        for r, rew, live in chunks:
            batch = {k: v.to(self.device) for k, v in sequences(r, self.pad, self.tp).items()}
            if not live:
                # a placeholder: every rank runs as many microbatches (FSDP), this one trains nothing
                batch["targets"].fill_(IGNORE_INDEX)
            elif getattr(self.section, "mask_truncated", False):  # DAPO's overlong filtering
                cut = torch.tensor([not f for f in r.finished], device=self.device)
                batch["targets"][cut] = IGNORE_INDEX
            self.parking.unpark("reference", *self.trained)
            with torch.no_grad(), self.context():
                if self.old_logps:
                    batch["old_logps"] = self.logps(self.policy, batch)
                    diffs.append(logprob_diff(r, batch["old_logps"], batch))
                if self.reference is not None:
                    batch["ref_logps"] = self.logps(self.reference, batch)
                self.score(batch)
            batch["scores"] = rew.float().to(self.device)
            out.append(batch)
        self.parking.park("reference")
        extra.update(self.advantages(out))
        gen_s = time.perf_counter() - t0
        self.metrics = {**self._reduce(parts, max(diffs) if diffs else None, gen_s), **extra}
        return out

    def logps(self, model, batch: dict) -> torch.Tensor:
        return response_logps(model, batch, self.sampling.temperature, self.all_positions)

    def groups(self, chunks: list, round_: int) -> list:
        """(key, rollouts, rewards) of each prompt's group of samples; key = (round, prompt index)."""
        n, out = self.sampling.n, []
        for r, rew, _ in chunks:
            for j in range(0, len(r), n):
                out.append(((round_, r.prompt_index[j]), r.subset(list(range(j, j + n))), rew[j : j + n]))
        return out

    def spread(self, groups: list, n_chunks: int, fallback) -> list:
        """This rank's groups in key order over its `n_chunks` microbatches, whole groups in each;
        a microbatch left empty gets the first group of `fallback`, trained on nothing."""
        groups = sorted(groups, key=lambda g: g[0])
        out, at, n = [], 0, self.sampling.n
        for c in range(n_chunks):
            size = len(groups) // n_chunks + (c < len(groups) % n_chunks)
            mine = groups[at : at + size]
            at += size
            if not mine:
                r, rew, _ = fallback
                out.append((r.subset(list(range(n))), rew[:n], False))
                continue
            r = mine[0][1].subset(list(range(len(mine[0][1]))))
            for g in mine[1:]:
                r.extend(g[1])
            out.append((r, torch.cat([g[2] for g in mine]), True))
        return out

    def by_tokens(self, groups: list, budget: int, fallback) -> list:
        """This rank's groups cut into training microbatches of at most `budget` padded tokens
        (rows x the longest row), shortest first, so rows of like length pad together (verl's
        dynamic batch size). A group longer than the budget is a microbatch of its own. Every
        rank runs as many microbatches as the rank that needs most (FSDP): the others split
        their fullest ones, or train a placeholder on nothing."""

        def longest(g) -> int:
            return max(g[1].lengths())

        bins: list[list] = []
        rows = width = 0
        for g in sorted(groups, key=lambda g: (longest(g), g[0])):
            if not bins or (rows + len(g[1])) * max(width, longest(g)) > budget:
                bins.append([])
                rows = width = 0
            bins[-1].append(g)
            rows, width = rows + len(g[1]), max(width, longest(g))
        dev = dist.collective_device()
        k = int(dist.all_reduce_max(torch.tensor([max(len(bins), 1)], device=dev), self.group).item())
        while len(bins) < k:
            fullest = max(range(len(bins)), key=lambda i: len(bins[i]), default=None)
            if fullest is None or len(bins[fullest]) < 2:
                bins.append([])
                continue
            b = bins.pop(fullest)
            bins[fullest:fullest] = [b[: len(b) // 2], b[len(b) // 2 :]]
        out = []
        for b in bins:
            out += self.spread(b, 1, fallback)
        return out

    def refill(self, groups: list, parts: dict) -> tuple[list, dict]:
        """DAPO's dynamic sampling: a group whose rewards are all equal has no advantage, so it is
        dropped, and more prompts are sampled (the next batches of the loader) until the step has
        as many groups with a signal as it has prompts, or `max_sampling_rounds` are spent. The
        groups kept are the first in (round, prompt index) order over every rank, whatever the
        layout."""
        target = self.inner.global_batch
        rounds = 1
        dev = dist.collective_device()
        while True:
            mine = [g for g in groups if g[2].max() > g[2].min()]
            found = int(dist.all_reduce_sum(torch.tensor([len(mine)], device=dev), self.group).item())
            if found >= target or rounds >= self.section.max_sampling_rounds:
                break
            step = self.inner.consumed_samples // max(target, 1)
            more = [self.sample(b, step) for b in self.inner.next()]
            for _, _, terms in more:
                collect(parts, terms)
            groups = groups + self.groups([(r, rew, True) for r, rew, _ in more], rounds)
            rounds += 1
        everyone = sorted(
            k for keys in dist.all_gather_objects([g[0] for g in mine], self.group) for k in keys
        )
        keep = set(everyone[:target])
        kept = [g for g in mine if g[0] in keep]
        return kept, {"sampling_rounds": float(rounds), "groups_kept": min(found, target) / max(target, 1)}

    def exchange(self, groups: list) -> tuple[list, float]:
        """Whole groups moved between the data-parallel ranks after generation, so that each
        trains on about as many tokens (prompt + response; the longest first, each to the least
        loaded rank: `balance`). Every rank sees every group's cost and takes the same decision;
        the groups travel by one all-gather. Returns this rank's groups and the training
        imbalance after the move (max over mean of the ranks' tokens)."""
        every = [g for mine in dist.all_gather_objects(groups, self.group) for g in mine]
        every.sort(key=lambda g: g[0])
        costs = [sum(g[1].lengths()) for g in every]
        plan = balance(costs, dist.world_size(self.group))
        loads = [float(sum(costs[k] for k in rows)) for rows in plan]
        return [every[k] for k in plan[dist.rank(self.group)]], imbalance(loads)

    @torch.no_grad()
    def validate(self, batches) -> dict:
        """The rewards of responses to held-out prompts (the val split), sampled as in training
        from streams that are the same at every validation: `reward_mean`, each term's, and
        `response_len_mean`, over every rank."""
        parts: dict[str, list] = {"reward": [], "response_len": []}
        for b in batches:
            collect(parts, self.sample(b, VALIDATION_STEP, "val")[2])
        self.parking.unpark(*self.trained)
        return means(parts, self.group)

    def score(self, batch: dict) -> None:
        """More of a batch's forward-only scores (PPO: the value model's), in place."""

    def advantages(self, batches: list[dict]) -> dict:
        """GRPO's: within each prompt's group of samples (a microbatch holds whole groups). What
        is taken over the batch (`scale: batch`'s std, REINFORCE++'s whitening) is over the
        global batch, every rank's rows, so any layout gives the same advantages."""
        g = self.section
        batch_wide = g.scale == "batch" or g.advantage == "reinforce_pp"
        scale = "none" if batch_wide else g.scale
        # reinforce_pp: the centred rewards, whitened below; the others: centred (and rloo's factor)
        local = [
            advantages(
                b["scores"].cpu(),
                g.num_samples,
                "grpo" if g.advantage == "reinforce_pp" else g.advantage,
                scale,
            )
            for b in batches
        ]
        if batch_wide:
            vals = local if g.advantage == "reinforce_pp" else [b["scores"].cpu() for b in batches]
            _, mean, var = global_moments(torch.cat(vals), self.group)
            shift = mean if g.advantage == "reinforce_pp" else 0.0
            local = [(a - shift) / (var**0.5 + EPS) for a in local]
        for b, a in zip(batches, local, strict=True):
            b["advantages"] = a.float().to(self.device)
        return {}

    def _reduce(self, parts: dict, diff: float | None, gen_s: float) -> dict:
        """The means over every rank's responses; the largest log-prob difference (None: the
        loss reports it) and generation time; the ranks' balance (max over mean of their
        generated tokens)."""
        dev = dist.collective_device()
        gen_tokens = float(sum(parts["response_len"]))
        high = dist.all_reduce_max(
            torch.tensor([diff or 0.0, gen_tokens, gen_s], dtype=torch.float64, device=dev), self.group
        )
        diff_max, tokens_max, gen_s_max = high.tolist()
        out = means(parts, self.group)
        total = out["response_len_mean"] * out.pop("responses")
        mean_tokens = total / dist.world_size(self.group)
        if diff is not None:
            out["rollout_logprob_diff"] = diff_max
        out.update(
            rollout_imbalance=tokens_max / mean_tokens if mean_tokens else 1.0,
            rollout_tokens_per_s=total / max(gen_s_max, 1e-9),
            gen_s=gen_s_max,
        )
        return out


VALIDATION_STEP = -1  # the key of validation's random streams: the same responses at every validation


def collect(parts: dict[str, list], terms: dict[str, list]) -> None:
    """Appends a microbatch's per-response values to the step's, by key."""
    for k, v in terms.items():
        parts.setdefault(k, []).extend(v)


def global_moments(values: torch.Tensor, group=None) -> tuple[float, float, float]:
    """(count, mean, unbiased variance) of `values` over every rank of `group` (None: the
    world): one all-reduce."""
    v = values.double().cpu()
    stats = torch.tensor([float(v.numel()), float(v.sum()), float((v * v).sum())], dtype=torch.float64)
    n, s1, s2 = dist.all_reduce_sum(stats.to(dist.collective_device()), group).tolist()
    mean = s1 / max(n, 1.0)
    return n, mean, max((s2 - n * mean * mean) / (n - 1), 0.0) if n > 1 else 0.0


def means(parts: dict[str, list], group=None) -> dict:
    """`<key>_mean` of each list of per-response values over the responses of every rank of
    `group` (None: the world; a term all ranks log), and `responses`, their number."""
    keys = sorted(parts)
    sums = [float(sum(parts[k])) for k in keys] + [float(len(parts["reward"]))]
    sums = dist.all_reduce_sum(
        torch.tensor(sums, dtype=torch.float64, device=dist.collective_device()), group
    ).tolist()
    n = max(sums[-1], 1.0)
    return {**{f"{k}_mean": sums[j] / n for j, k in enumerate(keys)}, "responses": sums[-1]}


def load_rewards(
    s: base.Setup, model: bool = True
) -> tuple[Rewards, dict[str, list[dict]], torch.nn.Module | None]:
    """The rule rewards, the prompts' records by split (checked for the fields the rewards read)
    and the frozen reward model of `rewards.model`, laid out like the policy (`model`: False
    when it lives on other ranks: None then)."""
    cfg = s.cfg
    rewards = Rewards(cfg.rewards.terms, cfg.rewards.file, model=cfg.rewards.model is not None)
    records = {split: PromptSplit(cfg.data.path, split).records for split in ("train", "val")}
    need = rewards.fields
    for split, recs in records.items():
        for i, rec in enumerate(recs):
            missing = sorted(need - set(rec))
            if missing:
                raise DataError(
                    f"{cfg.data.path}: {split} prompt {i} has no field {missing[0]!r}, which rewards.terms "
                    f"read; prepare prompts whose records hold {', '.join(sorted(need))}"
                )
    return rewards, records, reward_model(s) if model else None


def reward_model(s: base.Setup) -> torch.nn.Module | None:
    """The frozen reward model of `rewards.model` (None without one), laid out as `s.par`."""
    cfg = s.cfg
    if not cfg.rewards.model:
        return None
    s.run.events(f"reward model: {cfg.rewards.model} (frozen), weight {cfg.rewards.model_weight}")
    return build_model(scorer_config(cfg, cfg.rewards.model), s.par, s.device, trainable=False).model


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


def frozen_reference(s: base.Setup, section: str):
    """The KL's reference: a frozen copy of the starting weights, laid out like the policy."""
    s.run.events(
        f"reference: a frozen copy of the starting weights, laid out like the policy ({section}.kl_coef > 0)"
    )
    return build_model(s.cfg, s.par, s.device, trainable=False).model


def setup(s: base.Setup):
    cfg = s.cfg
    rewards, records, reward_model = load_rewards(s)
    g = cfg.grpo
    reference = frozen_reference(s, "grpo") if g.kl_coef > 0 else None
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
    )
    loss.all_positions = s.par.sequence_sharded

    def wrap(loader, evaluate):  # validation: the rewards on held-out prompts (Rollouts.validate)
        rollouts = Rollouts(
            loader,
            s,
            g,
            rewards,
            records,
            reference=reference,
            reward_model=reward_model,
            reuse=g.num_iterations,
        )
        return rollouts, evaluate

    return base.Plan(prompt_samples, loss, wrap)


def run(cfg: LadleConfig) -> str:
    return base.run(cfg, "grpo", prompt_samples, setup=setup)
