"""Rollouts for the RL recipes: responses sampled from the policy's current weights, inside the
training processes, with the model as it is laid out for training.

A response is a function of (seed, step, prompt index, sample index), not of the layout or the
batch it was sampled in: each row draws its uniforms from its own generator, seeded from that key,
and picks its token by the inverse of the cumulative distribution (`ladle.models.generation.sample`). So
1 process and 2 FSDP ranks, or any split into batches, sample the same responses, and runs can
be compared exactly as for pretraining (up to the rounding of logits across batch shapes, which
decides a token only when a uniform falls within it of a boundary).

Each response keeps the log-probs it was sampled with (`sample_logps`, of softmax(logits / T));
the ratio uses those of the training forward (`response_logps`), and the largest difference of
the two is `rollout_logprob_diff` (fp32: ~0; a backend that computes differently shows it).
Under FSDP every rank runs forward passes until all ranks are done (`sync`), since each pass
gathers the weights layer by layer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from ladle import distributed as dist
from ladle.models.generation import sample, stop_strings
from ladle.train.loss import IGNORE_INDEX, token_logps


def row_seed(seed: int, step: int, prompt_index: int, sample_index: int, turn: int = 0) -> int:
    """The generator seed of one response (an episode's `turn`-th reply): a hash of its key (63
    bits). The first turn's key is a single-turn response's, so one turn samples alike either way."""
    key = f"rollout:{seed}:{step}:{prompt_index}:{sample_index}" + (f":{turn}" if turn else "")
    digest = hashlib.blake2b(key.encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


@dataclass
class Rollouts:
    """Sampled responses, one row per (prompt, sample); lists in row order. A multi-turn
    episode (ladle/rl/env.py) is one row: `response_ids` every token after the first prompt, the
    model's replies and the environment's messages between them, `mask` 1 on the model's own
    tokens and 0 on that context (its `sample_logps` 0); a single-turn row has an empty `mask`
    (all its response tokens the model's)."""

    prompt_index: list[int] = field(default_factory=list)
    sample_index: list[int] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    sample_logps: list[list[float]] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)  # ended by EOS or a stop string, not the cap
    version: list[int] = field(default_factory=list)  # the policy's optimizer step it was sampled with
    mask: list[list[int]] = field(default_factory=list)  # per response token: 1 the model's, 0 context
    # an MoE policy's routing as sampled: (tokens read, MoE layers, k) int16 a row, or None
    routing: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.response_ids)

    def add(
        self,
        prompt_index: int,
        sample_index: int,
        prompt,
        response,
        logps,
        finished: bool,
        version: int = 0,
        mask: list[int] | None = None,
        routing: torch.Tensor | None = None,
    ) -> None:
        """One more row."""
        self.prompt_index.append(prompt_index)
        self.sample_index.append(sample_index)
        self.prompt_ids.append(list(prompt))
        self.response_ids.append(response)
        self.sample_logps.append(logps)
        self.finished.append(finished)
        self.version.append(version)
        self.mask.append(list(mask) if mask is not None else [])
        self.routing.append(routing)

    def model_mask(self, k: int) -> list[int]:
        """Row `k`'s mask over its response tokens (1: the model's own)."""
        return self.mask[k] or [1] * len(self.response_ids[k])

    def model_tokens(self, k: int) -> int:
        """How many of row `k`'s response tokens the model sampled."""
        return sum(self.mask[k]) if self.mask[k] else len(self.response_ids[k])

    def extend(self, other: Rollouts) -> None:
        for name in self.__dataclass_fields__:
            getattr(self, name).extend(getattr(other, name))

    def lengths(self) -> list[int]:
        """Each row's tokens: prompt + response."""
        return [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids, strict=True)]

    def subset(self, rows: list[int]) -> Rollouts:
        return Rollouts(
            **{name: [getattr(self, name)[k] for k in rows] for name in self.__dataclass_fields__}
        )


@dataclass
class Sampling:
    """How responses are sampled (the RL recipes' config): `n` per prompt, temperature, top-p,
    top-k, stop strings and the response-length cap."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()


def rollout(
    model,
    prompts: list[list[int]],
    prompt_index: list[int],
    sampling: Sampling,
    *,
    seed: int,
    step: int,
    end_ids: set[int],
    decode=None,
    pad_id: int = 0,
    batch_size: int = 16,
    group=None,
    seq_multiple: int = 1,
    keys: list[tuple[int, int, int]] | None = None,
    limits: list[int] | None = None,
    routing: bool = False,
) -> Rollouts:
    """`sampling.n` responses to each prompt (token ids; `prompt_index` their global indices, the
    key of their random streams), sampled in batches of `batch_size` rows. A response ends at a
    token of `end_ids` (kept) or a stop string (`decode` needed; the text up to it is the
    caller's to cut) or at the cap. `group`: the ranks that sample together (a laid-out model's;
    None: the world); `seq_multiple`: tensor parallelism's degree (`generation.sample`).
    `keys`: one response to each prompt instead, keyed (prompt index, sample, turn) (an
    episode's later turns: ladle/rl/env.py), `limits` its tokens at most (the cap otherwise).
    `routing`: an MoE policy's routing recorded with each row (routing replay)."""
    if keys is not None:
        rows = [(p, *k) for p, k in zip(prompts, keys, strict=True)]
    elif len(prompts) != len(prompt_index):
        raise ValueError("one prompt index per prompt")
    else:
        rows = [(p, i, s, 0) for p, i in zip(prompts, prompt_index, strict=True) for s in range(sampling.n)]
    cap = [sampling.max_new_tokens] * len(rows) if limits is None else limits
    stop = stop_strings(decode, list(sampling.stop)) if sampling.stop else None
    out = Rollouts()
    # Every rank runs as many batches (FSDP: a forward pass is a collective); a rank with fewer
    # rows runs its last batch again on a copy of its first row and drops the result.
    batches = -(-len(rows) // batch_size)
    longest = max(cap, default=1)  # every batch sampled up to it (ranks stop together under FSDP)
    ranks = dist.world_size(group)
    if ranks > 1:
        device = next(model.parameters()).device
        high = dist.all_reduce_max(torch.tensor([batches, longest], device=device), group)
        batches, longest = (int(x) for x in high.tolist())
    model_was_training = model.training
    model.eval()
    try:
        for b in range(batches):
            chunk = rows[b * batch_size : (b + 1) * batch_size] or rows[:1] or [([pad_id], -1, 0, 0)]
            caps = cap[b * batch_size : (b + 1) * batch_size] or [longest]
            real = b * batch_size < len(rows)
            gens = [torch.Generator().manual_seed(row_seed(seed, step, i, s, t)) for _, i, s, t in chunk]
            got = sample(
                model,
                [p for p, _, _, _ in chunk],
                max_new_tokens=longest,
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                end_ids=end_ids,
                pad_id=pad_id,
                row_generators=gens,
                stop=stop,
                prepack=ranks == 1,
                sync=(lambda done: not dist.any_rank(not done, device, group)) if ranks > 1 else None,
                seq_multiple=seq_multiple,
                routing=routing,
            )
            if not real:
                continue
            routes = got.routing if got.routing is not None else [None] * len(chunk)
            for (p, i, s, _), n, ids, lps, fin, rt in zip(
                chunk, caps, got.tokens, got.logps, got.finished, routes, strict=True
            ):
                if len(ids) > n:  # a row's own limit below the batch's (an episode's token budget)
                    ids, lps, fin = ids[:n], lps[:n], False
                    rt = rt[: len(p) + n - 1] if rt is not None else None
                out.add(i, s, p, ids, lps, fin, routing=rt)
    finally:
        model.train(model_was_training)
    return out


def sequences(rollouts: Rollouts, pad_id: int = 0, multiple: int = 1) -> dict[str, torch.Tensor]:
    """The rows as a training batch: `tokens` (R, T) prompt + response, right-padded (T a
    `multiple`: tensor parallelism's sequence shards); `targets` the model's own response tokens
    at the positions that predict them (IGNORE_INDEX elsewhere: the prompt, an episode's context
    between turns, the padding); `lengths`; `sample_logps` (R, T) the sampling-time log-probs at
    those positions (0 elsewhere)."""
    lengths = rollouts.lengths()
    T = -(-max(lengths) // multiple) * multiple
    tokens = torch.full((len(lengths), T), pad_id, dtype=torch.long)
    targets = torch.full((len(lengths), T), IGNORE_INDEX, dtype=torch.long)
    sampled = torch.zeros((len(lengths), T), dtype=torch.float32)
    for k, (p, r) in enumerate(zip(rollouts.prompt_ids, rollouts.response_ids, strict=True)):
        seq = torch.tensor(p + r, dtype=torch.long)
        tokens[k, : len(seq)] = seq
        own = seq[len(p) :]
        if rollouts.mask[k]:  # an episode's context is not trained on
            own = own.masked_fill(torch.tensor(rollouts.mask[k]) == 0, IGNORE_INDEX)
        targets[k, len(p) - 1 : len(seq) - 1] = own
        if k < len(rollouts.sample_logps) and len(rollouts.sample_logps[k]) == len(r):
            sampled[k, len(p) - 1 : len(seq) - 1] = torch.tensor(rollouts.sample_logps[k])
    out = {"tokens": tokens, "targets": targets, "lengths": torch.tensor(lengths), "sample_logps": sampled}
    routes = [(k, x) for k, x in enumerate(rollouts.routing) if x is not None]
    if routes:  # (R, T, MoE layers, k): the sampler's experts, -1 where none was recorded
        routing = torch.full((len(lengths), T, *routes[0][1].shape[1:]), -1, dtype=torch.int16)
        for k, x in routes:
            routing[k, : len(x)] = x
        out["routing"] = routing
    return out


def response_logps(
    model, batch: dict, temperature: float = 1.0, all_positions: bool = False, routing=None
) -> torch.Tensor:
    """log softmax(logits / T) of each response token under `model` (the training forward):
    (R, T) fp32, 0 off the responses. Greedy sampling (T = 0) is scored at T = 1. The head runs
    at the response positions only, or at every position (`all_positions`: tensor parallelism,
    whose sequence shards the head cannot pick from; its vocabulary-sharded logits are scored
    under loss_parallel). `routing`: the experts an MoE policy replays (routing replay)."""
    mask = batch["targets"] != IGNORE_INDEX
    replay = {"routing": routing} if routing is not None else {}
    logits = model(batch["tokens"], keep=None if all_positions else mask, **replay)
    if temperature not in (0, 1):
        logits = logits / temperature
    if all_positions:
        return token_logps(logits, batch["targets"]).float() * mask
    out = torch.zeros(mask.shape, dtype=torch.float32, device=logits.device)
    out[mask] = token_logps(logits, batch["targets"][mask])
    return out


def score_at(model, tokens: torch.Tensor, at: torch.Tensor, all_positions: bool = False) -> torch.Tensor:
    """A score-head model's output (R,) at position `at` of each row: computed there only, or
    at every position and then picked (`all_positions`: tensor parallelism)."""
    if not all_positions:
        return model(tokens, at=at)[:, 0, 0]
    out = model(tokens)  # (R, T, 1)
    return out[torch.arange(len(at), device=out.device), at, 0]


def logprob_diff(rollouts: Rollouts, logps: torch.Tensor, batch: dict) -> float:
    """The largest |training - sampling| log-prob over the model's own response tokens
    (`rollout_logprob_diff`)."""
    worst = 0.0
    logps = logps.detach()
    mask = batch["targets"] != IGNORE_INDEX
    for k, lps in enumerate(rollouts.sample_logps):
        own = [lp for lp, m in zip(lps, rollouts.model_mask(k), strict=True) if m] if lps else []
        if own and int(mask[k].sum()) == len(own):  # a row masked out of the loss is not compared
            train = logps[k][mask[k]]
            worst = max(worst, float((train - torch.tensor(own, dtype=train.dtype)).abs().max()))
    return worst


def balance(costs: list[float], ranks: int, per_rank: int | None = None) -> list[list[int]]:
    """Rows spread over `ranks` so the summed costs (e.g. padded tokens) are even: the longest
    first, each to the least loaded rank (LPT; within 4/3 of the best), or the least loaded of
    those holding fewer than `per_rank` rows. Returns each rank's row indices, in ascending order."""
    load = [0.0] * ranks
    out: list[list[int]] = [[] for _ in range(ranks)]
    for k in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        room = [r for r in range(ranks) if per_rank is None or len(out[r]) < per_rank]
        r = min(room, key=lambda r: (load[r], r))
        out[r].append(k)
        load[r] += costs[k]
    return [sorted(x) for x in out]


def imbalance(loads: list[float]) -> float:
    """max / mean of the ranks' loads (`rollout_imbalance`; 1.0 = even)."""
    mean = sum(loads) / max(len(loads), 1)
    return max(loads) / mean if mean else 1.0
