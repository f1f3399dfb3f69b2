"""The RL recipes' loader: each step's prompt microbatches (from the shared loader) become a batch
of training rows through the phases of an RL step, in this order:

    generate    the engine samples `num_samples` responses per prompt (ladle/rl/engine.py)
    score       the rule rewards on the decoded text and the reward model's score (`rewards.*`)
    arrange     DAPO's refill of groups without signal, groups exchanged between the ranks so each
                trains on about as many tokens, micro-batches cut by a token budget
    forward     the reference's and the sampling policy's ("old") log-probs, and the recipe's
                other forward-only scores (PPO's values)
    advantages  the recipe's estimator over the whole batch (GRPO's group advantages, PPO's GAE)

and the loop's update trains on them: a batch serves `reuse` optimizer steps, cycling over
`minibatches` slices of its microbatches. Generation and scoring are timed as `gen_s`, never as
the loop's `data_s` (which is the prompts' read). `step_metrics`: the rewards and rollout figures
of the last rollout, over every rank.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch

from ladle import distributed as dist
from ladle import watchdog
from ladle.data.chat import END_OF_TURN
from ladle.rl.engine import RolloutEngine
from ladle.rl.rewards import RewardError, Rewards
from ladle.rl.roles import Parking
from ladle.rl.rollout import Sampling, balance, imbalance, logprob_diff, response_logps, score_at, sequences
from ladle.rl.stats import collect, means
from ladle.train.loss import IGNORE_INDEX
from ladle.train.unit import TrainUnit

VALIDATION_STEP = -1  # the key of validation's random streams: the same responses at every validation


def sampling_of(section) -> Sampling:
    """The sampling settings of an RL config section (`grpo`, `ppo`)."""
    return Sampling(
        n=section.num_samples,
        temperature=section.temperature,
        top_p=section.top_p,
        top_k=section.top_k,
        max_new_tokens=section.max_response_len,
        stop=tuple(section.stop),
    )


def prompt_lists(b: dict) -> tuple[list[list[int]], list[int]]:
    """A prompt microbatch's prompts (token ids, left padding dropped) and their indices."""
    prompts = [row[-int(n) :].tolist() for row, n in zip(b["prompt"], b["prompt_len"], strict=True)]
    return prompts, b["index"].tolist()


def end_ids(tok) -> set[int]:
    """The tokens that end a response: EOS and the chat templates' end-of-turn tokens."""
    ends = {tok.eos_id, *(tok.token_to_id(t) for t in END_OF_TURN)}
    return {i for i in ends if i is not None}


class Dealt:
    """The prompt loader of several data-parallel ranks, its prompts dealt out before generation
    so each rank's engine has about as much work: every rank's prompts of a step gathered, the
    costliest first to the least loaded rank (`balance`), each rank keeping its number of
    prompts and microbatches (its engine runs in step with the others). A prompt's cost is its
    samples' expected tokens: `samples` x (its length + `expected()`, the last batch's mean
    response length). A response does not depend on the rank that samples it (keyed streams),
    so the rollouts are the same; the exchange after generation then evens the training."""

    def __init__(self, inner, *, group, samples: int, expected: Callable[[], float]):
        self.inner, self.group, self.samples, self.expected = inner, group, samples, expected

    def __getattr__(self, name):  # the loader's position, state, timing and reports
        return getattr(self.inner, name)

    def next(self) -> list[dict]:
        micro = self.inner.next()
        device = micro[0]["index"].device
        sizes = [len(b["index"]) for b in micro]
        rows = [{k: v[i].cpu() for k, v in b.items()} for b in micro for i in range(len(b["index"]))]
        every = [r for mine in dist.all_gather_objects(rows, self.group) for r in mine]
        extra = self.expected()
        costs = [self.samples * (int(r["prompt_len"]) + extra) for r in every]
        plan = balance(costs, dist.world_size(self.group), per_rank=len(rows))
        mine = [every[k] for k in plan[dist.rank(self.group)]]
        out, at = [], 0
        for size in sizes:
            chunk, at = mine[at : at + size], at + size
            out.append({k: torch.stack([r[k] for r in chunk]).to(device) for k in chunk[0]})
        return out


class RolloutLoader:
    """The loop's loader of rollout batches (see the module's docstring). `unit`: the policy's
    (its precision and layout give the forward's numerics); `advantages(batches) -> metrics`
    fills each batch's `advantages` (and PPO's `returns`) over the whole batch; `values(batch)`
    adds forward-only scores in place (PPO's critic); `on_batch(batches, bounds)` and
    `on_validate()` tell a separated placement's partner; `keeps`: objects with a state_dict
    that the estimate updates batch by batch, checkpointed with the loader's position."""

    console = ("reward_mean",)

    def __init__(
        self,
        inner,
        *,
        section,
        engine: RolloutEngine,
        tokenizer,
        rewards: Rewards,
        records: dict[str, list[dict]],
        unit: TrainUnit,
        seed: int,
        advantages: Callable[[list[dict]], dict],
        parking: Parking,
        reference=None,
        reward_model=None,
        reward_weight: float = 1.0,
        values: Callable[[dict], None] | None = None,
        on_batch: Callable[[list[dict], list[int]], None] | None = None,
        on_validate: Callable[[], None] | None = None,
        old_logps: bool | None = None,
        reuse: int = 1,
        minibatches: int = 1,
        trained: tuple[str, ...] = (),
        keeps: dict | None = None,
        log: Callable[..., None] = lambda msg, level="info": None,
        rollouts_log=None,
        episodes=None,
    ):
        self.inner, self.section, self.engine, self.tok = inner, section, engine, tokenizer
        self.rewards, self.records, self.unit, self.seed = rewards, records, unit, seed
        self.policy, self.device = unit.model, unit.device
        self.reference, self.reward_model, self.reward_weight = reference, reward_model, reward_weight
        self.estimate, self.values = advantages, values
        self.on_batch, self.on_validate = on_batch, on_validate
        self.reuse, self.minibatches = reuse, minibatches
        par = unit.parallel
        # the rows' bookkeeping is over the data-parallel ranks (a TP group holds the same rows)
        self.group = par.data_group
        if section.balance and dist.world_size(self.group) > 1:
            cap = section.max_response_len
            expected = lambda: self.metrics.get("response_len_mean", cap)  # noqa: E731
            self.inner = Dealt(inner, group=self.group, samples=section.num_samples, expected=expected)
        self.log, self.named = log, 0  # the run's events.log; reward failures named so far
        # rank 0: rollouts.jsonl, `section.log_rollouts` episodes a batch (`logged`: this batch's)
        self.rollouts_log, self.logged = rollouts_log, []
        self.episodes = episodes  # multi-turn episodes (ladle/rl/env.py), or one response a row
        self.keeps = keeps or {}  # state that carries over batches (PPO's reward moments): checkpointed
        self.sampling = sampling_of(section)
        self.end_ids = end_ids(tokenizer)
        self.pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
        # tensor parallelism: every forward a multiple of tp positions (sequence shards), and the
        # heads run at every position (a rank holds a slice of them, not the ones to pick)
        self.tp = par.layout.tp
        self.all_positions = par.sequence_sharded
        # shared placement: the models a phase does not use wait in host memory (accelerators)
        self.parking = parking
        self.trained = trained  # parked models the training step needs back (PPO's critic)
        # a batch trained on once, whole, needs no forward pass for its old log-probs: the loss
        # takes its own, detached (PolicyLoss); PPO needs them before training (its KL reward)
        self.old_logps = reuse > 1 or minibatches > 1 if old_logps is None else old_logps
        self.cached: list[dict] | None = None
        self.bounds: list[int] = []  # where each minibatch's microbatches start in `cached`
        self.uses = 0
        self.data_s = 0.0  # reading the prompts
        self.gen_s = 0.0  # generating, scoring and the forward-only passes of the rollout batch
        self.sync_s = 0.0  # of which the engine's weight syncs
        self.metrics: dict[str, float] = {}

    # the loop's loader interface --------------------------------------------------------------
    def state_dict(self) -> dict:
        state = self.inner.state_dict()
        if self.keeps:
            state = {**state, "rl": {k: v.state_dict() for k, v in self.keeps.items()}}
        return state

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        for k, v in state.pop("rl", {}).items():
            if k in self.keeps:  # a run resumed without what was kept (normalize_rewards turned off)
                self.keeps[k].load_state_dict(v)
        self.inner.load_state_dict(state)
        self.cached, self.uses = None, 0
        self.engine.mark_stale()  # a resume or rollback loads the policy's weights as well

    def close(self) -> None:
        self.inner.close()
        self.engine.close()
        if self.episodes is not None:
            self.episodes.close()

    def step_metrics(self) -> dict:
        return {**self.metrics, **self.engine.metrics()}

    def batch_samples(self) -> dict | None:
        """The prompts of the rollout batch the last step trained on."""
        return self.inner.batch_samples()

    def next(self) -> list[dict]:
        self.data_s = self.gen_s = 0.0
        self.engine.begin()
        if self.cached is None or self.uses >= self.reuse:
            step = self.inner.consumed_samples // max(self.inner.global_batch, 1)  # before next()
            micro = self.inner.next()
            self.data_s = self.inner.data_s
            watchdog.phase("generation (rollouts)")
            t0 = time.perf_counter()
            self.cached = self.make(micro, step)
            self.uses = 0
            self.gen_s = time.perf_counter() - t0
        self.parking.unpark(*self.trained)
        k = self.uses % self.minibatches
        self.uses += 1
        return self.cached[self.bounds[k] : self.bounds[k + 1]]

    # the phases --------------------------------------------------------------------------------
    def make(self, micro: list[dict], step: int) -> list[dict]:
        """A rollout batch from a step's prompt microbatches: generate and score, arrange,
        forward, advantages."""
        t0 = time.perf_counter()
        self.sync_s = 0.0
        sampled = [self.sample(b, step) for b in micro]
        parts: dict[str, list] = {}
        for _, _, terms in sampled:
            collect(parts, terms)
        chunks, extra = self.arrange([(r, rew, True) for r, rew, _ in sampled], parts)
        out, diffs = [], []
        for r, rew, live in chunks:
            batch = self.forward(r, rew, live, diffs)
            out.append(batch)
        self.parking.park("reference")
        if self.logged:  # rank 0's episodes of this batch
            with open(self.rollouts_log, "a") as f:
                f.writelines(json.dumps(e) + "\n" for e in self.logged)
            self.logged = []
        extra.update(self.estimate(out))
        gen_s = time.perf_counter() - t0
        self.metrics = {**self._reduce(parts, max(diffs) if diffs else None, gen_s), **extra}
        if self.on_batch is not None:
            self.on_batch(out, self.bounds)
        return out

    def sample(self, b: dict, step: int, split: str = "train"):
        """Generate and score a prompt microbatch's responses: (the rollouts, their rewards
        (float64), each reward term's values by key, with `reward` and `response_len`)."""
        prompts, index = prompt_lists(b)
        self.parking.park(*self.parking.items)  # the policy alone generates
        self.sync_s += self.engine.sync_weights()
        eps = None
        if self.episodes is not None:
            r, eps = self.engine.run_episodes(
                self.episodes, self.records[split], index, self.sampling, step=step
            )
        else:
            r = self.engine.generate(prompts, index, self.sampling, step=step)
        rew, terms = self.score(r, prompts, index, split, step, eps)
        terms["response_len"] = [r.model_tokens(k) for k in range(len(r))]  # the model's own tokens
        if eps is not None:
            terms["turns"] = [e.turns for e in eps]
            terms["tool_calls"] = [len(e.tool_calls) for e in eps]
        return r, rew, terms

    def score(self, r, prompts: list[list[int]], index: list[int], split: str, step: int = 0, eps=None):
        """The rewards of the rollouts `r`: the rule terms on each response's text (end tokens
        dropped; an episode's last reply, with its transcript) and its prompt's record, an
        episode's environment rewards (`eps`: ladle/rl/env.py), plus the reward model's score of
        the whole sequence at its last token, weighted. Returns (rewards (float64), every term's
        values by key)."""
        records = self.records[split]
        rewards, terms, failed, errors = [], {}, None, []
        if eps is None:
            prompt_text = {i: self.tok.decode(p) for i, p in zip(index, prompts, strict=True)}
            texts = [self.tok.decode([t for t in resp if t not in self.end_ids]) for resp in r.response_ids]
            rows = [
                (text, records[i], {"prompt": prompt_text[i], "response_tokens": len(resp)})
                for text, i, resp in zip(texts, r.prompt_index, r.response_ids, strict=True)
            ]
        else:
            texts = [e.last for e in eps]
            rows = [
                (
                    e.last,
                    records[e.prompt_index],
                    {
                        "prompt": self.tok.decode(e.prompt),
                        "response_tokens": r.model_tokens(k),
                        "messages": e.messages,
                        "turns": e.turns,
                    },
                )
                for k, e in enumerate(eps)
            ]

        def at(k: int) -> str:
            where = "validation" if split == "val" else f"step {step * self.reuse + 1}"
            return f"{where}, {split} prompt {r.prompt_index[k]} sample {r.sample_index[k]}"

        try:
            scored = self.rewards.score(rows)
        except RewardError as e:
            scored, failed = [], f"{e}; at {at(e.row)}; the response began {texts[e.row][:120]!r}"
        except Exception as e:  # anything else still stops every rank together, named
            scored, failed = (
                [],
                f"the rewards raised {type(e).__name__}: {e}; at {at(0)} and the rest of its batch",
            )
        env = eps is not None and self.episodes.cls is not None  # the environment's rewards: a term
        for k, (total, each, why) in enumerate(scored):
            if env:
                each = {**each, "env": eps[k].reward}
                total += eps[k].reward
            if eps is not None and eps[k].failed is not None:  # the environment raised: the episode fails
                why, each = eps[k].failed, {key: 0.0 for key in each}
                total = 0.0
                if self.rewards.on_error == "stop" and failed is None:
                    failed = f"{why}; at {at(k)}; the last reply began {texts[k][:120]!r}"
            errors.append(int(why is not None))
            if why is not None and self.named < 3:  # rewards.on_error: zero; the first cases named
                self.named += 1
                began = f"the {'last reply' if eps is not None else 'response'} began {texts[k][:120]!r}"
                self.log(f"{why}; at {at(k)}; {began}: scored 0 (rewards.on_error: zero)", "warning")
            rewards.append(total)
            for key, v in each.items():
                terms.setdefault(key, []).append(v)
        # every rank stops when one's reward raised (the next collective would wait for it)
        if dist.any_rank(failed is not None, self.device, self.group):
            failed = failed or "a reward raised on another rank (its message is in events.log)"
            self.log(
                failed + "; the run stops (rewards.on_error: stop; its checkpoints so far are kept)", "error"
            )
            raise RewardError(failed)
        if self.rewards.on_error == "zero":
            terms["errors"] = errors  # logged as the count, `reward_errors`
        rew = torch.tensor(rewards, dtype=torch.float64)
        if self.reward_model is not None:
            self.parking.unpark("reward")
            batch = sequences(r, self.pad, self.tp)
            with torch.no_grad(), self.unit.numerics():
                tokens, at = batch["tokens"].to(self.device), (batch["lengths"] - 1).to(self.device)
                score = score_at(self.reward_model, tokens, at, self.all_positions).double().cpu()
            terms["model"] = score.tolist()
            rew = rew + self.reward_weight * score
            self.parking.park("reward")
        out = {"reward": rew.tolist(), **{f"reward_{k}": v for k, v in terms.items()}}
        if split == "train" and self.rollouts_log is not None:
            self.log_episodes(r, records, out, step, eps)
        return rew, out

    def log_episodes(self, r, records: list[dict], values: dict, step: int, eps=None) -> None:
        """The first rows of the batch (up to `log_rollouts`) as episodes for rollouts.jsonl (as
        scored: a group that DAPO's refill drops later is logged all the same)."""

        def trained(k: int) -> bool:  # DAPO's overlong filtering keeps a cut response out of the loss
            return r.finished[k] or not getattr(self.section, "mask_truncated", False)

        for k in range(min(self.section.log_rollouts - len(self.logged), len(r))):
            if eps is None:
                prompt = records[r.prompt_index[k]].get("prompt", "")
                messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
                text = self.tok.decode([t for t in r.response_ids[k] if t not in self.end_ids])
                messages.append({"role": "assistant", "content": text})
            else:
                messages = eps[k].messages
            self.logged.append(
                {
                    "step": step * self.reuse + 1,  # the first optimizer step that trains on it
                    "prompt_index": r.prompt_index[k],
                    "sample": r.sample_index[k],
                    "messages": messages,
                    "tokens": [*r.prompt_ids[k], *r.response_ids[k]],
                    "mask": [0] * len(r.prompt_ids[k]) + [m * int(trained(k)) for m in r.model_mask(k)],
                    "reward": values["reward"][k],
                    "rewards": {
                        key[7:]: v[k]
                        for key, v in values.items()
                        if key.startswith("reward_") and key != "reward_errors"
                    },
                    "turns": eps[k].turns if eps is not None else 1,
                    "tool_calls": eps[k].tool_calls if eps is not None else [],
                }
            )

    def forward(self, r, rew: torch.Tensor, live: bool, diffs: list[float]) -> dict:
        """A training microbatch of rollouts with its forward-only scores: the sampling policy's
        log-probs (when the batch is trained on more than once, or the recipe needs them), the
        reference's, the recipe's `values`, and the rewards as `scores`."""
        batch = {k: v.to(self.device) for k, v in sequences(r, self.pad, self.tp).items()}
        if not live:
            # a placeholder: every rank runs as many microbatches (FSDP), this one trains nothing
            batch["targets"].fill_(IGNORE_INDEX)
        elif getattr(self.section, "mask_truncated", False):  # DAPO's overlong filtering
            cut = torch.tensor([not f for f in r.finished], device=self.device)
            batch["targets"][cut] = IGNORE_INDEX
        self.parking.unpark("reference", *self.trained)
        with torch.no_grad(), self.unit.numerics():
            if self.old_logps:
                batch["old_logps"] = self.logps(self.policy, batch)
                diffs.append(logprob_diff(r, batch["old_logps"], batch))
            if self.reference is not None:
                batch["ref_logps"] = self.logps(self.reference, batch)
            if self.values is not None:
                self.values(batch)
        batch["scores"] = rew.float().to(self.device)
        return batch

    def logps(self, model, batch: dict) -> torch.Tensor:
        # routing replay: the policy's forwards route as its sampler did (the reference its own way)
        replay = model is self.policy and getattr(self.section, "routing_replay", False)
        routing = batch.get("routing") if replay else None
        return response_logps(model, batch, self.sampling.temperature, self.all_positions, routing)

    # arranging the rows over microbatches and ranks -------------------------------------------
    def arrange(self, chunks: list, parts: dict) -> tuple[list, dict]:
        """The rollouts as this rank's training microbatches, (rollouts, rewards, live) each, and
        the figures of the arrangement. Without a refill, an exchange or a token budget the
        prompt microbatches stay as they are."""
        extra = {}
        dynamic = getattr(self.section, "dynamic_sampling", False)
        exchange = self.section.balance and dist.world_size(self.group) > 1
        budget, m = self.section.micro_tokens, self.minibatches
        if not (dynamic or exchange or budget):
            self.bounds = [j * len(chunks) // m for j in range(m + 1)]
            return chunks, extra
        groups = self.groups(chunks, 0)
        if dynamic:
            groups, extra = self.refill(groups, parts)
        if exchange:
            groups, extra["train_imbalance"] = self.exchange(groups)
        # each minibatch a share of the groups (in key order), cut into training passes
        groups.sort(key=lambda g: g[0])
        fallback, per_share, out = chunks[0], len(chunks) // m, []
        self.bounds = [0]
        for j in range(m):
            share = groups[j * len(groups) // m : (j + 1) * len(groups) // m]
            if budget:
                out += self.by_tokens(share, budget, fallback)
            else:
                out += self.spread(share, per_share, fallback)
            self.bounds.append(len(out))
        return out, extra

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

    # validation and the step's figures ---------------------------------------------------------
    @torch.no_grad()
    def validate(self, batches) -> dict:
        """The rewards of responses to held-out prompts (the val split), sampled as in training
        from streams that are the same at every validation: `reward_mean`, each term's, and
        `response_len_mean`, over every rank."""
        parts: dict[str, list] = {"reward": [], "response_len": []}
        for b in batches:
            collect(parts, self.sample(b, VALIDATION_STEP, "val")[2])
        self.parking.unpark(*self.trained)
        out = means(parts, self.group)
        if self.on_validate is not None:
            self.on_validate()
        return out

    def _reduce(self, parts: dict, diff: float | None, gen_s: float) -> dict:
        """The means over every rank's responses; the largest log-prob difference (None: the
        loss reports it) and generation time; the ranks' balance (max over mean of their
        generated tokens)."""
        dev = dist.collective_device()
        gen_tokens = float(sum(parts["response_len"]))
        high = dist.all_reduce_max(
            torch.tensor([diff or 0.0, gen_tokens, gen_s, self.sync_s], dtype=torch.float64, device=dev),
            self.group,
        )
        diff_max, tokens_max, gen_s_max, sync_s_max = high.tolist()
        out = means(parts, self.group)
        responses = out.pop("responses")
        total = out["response_len_mean"] * responses
        if "reward_errors_mean" in out:  # rewards.on_error: zero: how many raised this step
            out["reward_errors"] = round(out.pop("reward_errors_mean") * responses)
        mean_tokens = total / dist.world_size(self.group)
        if diff is not None:
            out["rollout_logprob_diff"] = diff_max
        if self.engine.copies_weights:
            out["weight_sync_s"] = sync_s_max
        out.update(
            rollout_imbalance=tokens_max / mean_tokens if mean_tokens else 1.0,
            rollout_tokens_per_s=total / max(gen_s_max, 1e-9),
            gen_s=gen_s_max,
        )
        return out
