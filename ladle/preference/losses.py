"""Preference losses: the DPO family and a reward model's Bradley-Terry loss, as loss objects
(ladle/train/loss.py) on rows of pairs (ladle/data/pairs.py).

A microbatch holds B pairs as `tokens` (B, 2, T): each pair's chosen and rejected sequences,
each a row of its own from position 0, padded at the end (so causal attention alone keeps them
apart); `targets` mark the completion tokens only. The 2B rows run in a few forward passes of
rows of similar length, each cut to its longest (`per_row`), and both sides are scored before the
loss. A pair is the unit of the count: every loss is a sum over pairs, divided by the pairs of
the global batch.

With pi / ref the summed completion log-probs of the policy / reference, the DPO losses of
`dpo.loss` (beta = dpo.beta, eps = dpo.label_smoothing) on
    h = (pi_c - ref_c) - (pi_r - ref_r):
    sigmoid  -(1 - eps) log s(beta h) - eps log s(-beta h)                 DPO; eps > 0: cDPO
    robust   (-(1 - eps) log s(beta h) + eps log s(-beta h)) / (1 - 2 eps)  rDPO
    hinge    max(0, 1 - beta h)                                              SLiC
    ipo      (h' - 1 / (2 beta))^2, h' on per-token mean log-probs           IPO (as trl)
    simpo    -log s(beta (pi_c / |c| - pi_r / |r|) - gamma)                  SimPO, no reference
and `dpo.rpo_alpha` > 0 adds alpha x the chosen completions' NLL per token (RPO). The rewards
logged are beta (pi - ref) per side (beta pi / |side| for SimPO), as trl logs them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ladle.config.schema import DPOConfig, RewardConfig
from ladle.train.loss import IGNORE_INDEX, Loss, LossOut, token_logps

DPO_METRICS = (
    "rewards_chosen",
    "rewards_rejected",
    "reward_margin",
    "reward_accuracy",
    "logps_chosen",
    "logps_rejected",
)


def pad_multiple(tp: int) -> int:
    """What a bucket's length is rounded up to: a multiple of the TP degree (sequence parallelism
    splits the tokens tp ways) and of 8 (few shapes for torch.compile)."""
    return math.lcm(8, tp)


def buckets(ends: torch.Tensor, T: int, multiple: int = 8, n: int = 4) -> list[tuple[torch.Tensor, int]]:
    """The rows of a microbatch (`ends` (R,), each row's last position) in up to `n` groups of
    similar length, shortest first: (row indices, length to keep) each, the length that of the
    group's longest row rounded up to `multiple` (at most T). Rows are padded to data.seq_len, and
    one row per batch may be far longer than the rest; a group pays only for its own longest, so
    the forward passes cost about what the rows hold. The number of groups depends on the row
    count alone, so every rank runs as many forward passes (FSDP gathers per pass). One host sync."""
    lengths = (ends + 1).tolist()
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    size = -(-len(order) // max(1, min(n, len(order) // 4)))  # >= 4 rows a group
    out = []
    for s in range(0, len(order), size):
        idx = order[s : s + size]
        keep = min(T, -(-lengths[idx[-1]] // multiple) * multiple)
        out.append((torch.tensor(idx, device=ends.device), keep))
    return out


def per_row(batch: dict, value, multiple: int = 8) -> torch.Tensor:
    """`value(tokens, targets, ends)` (a forward pass and what is read from it) of every row of the
    pairs' 2B rows, run by length groups (`buckets`), as (B, 2, ...) in the batch's order."""
    B, _, T = batch["tokens"].shape
    tokens, targets = batch["tokens"].flatten(0, 1), batch["targets"].flatten(0, 1)
    ends = batch["ends"].flatten()
    parts, order = [], []
    for idx, keep in buckets(ends, T, multiple):
        parts.append(value(tokens[idx, :keep], targets[idx, :keep], ends[idx]))
        order.append(idx)
    order = torch.cat(order)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order), device=order.device)
    out = torch.cat(parts)[inverse]
    return out.view(B, 2, *out.shape[1:])


def _row_logps(model, tokens, targets, completions_only: bool) -> torch.Tensor:
    mask = targets != IGNORE_INDEX
    if completions_only:  # the head at the completion positions only: a prompt's logits are never read
        lp = token_logps(model(tokens, keep=mask), targets[mask])
        lp = torch.zeros(mask.shape, dtype=lp.dtype, device=lp.device).masked_scatter(mask, lp)
    else:
        lp = token_logps(model(tokens), targets)  # (R, T), 0 where ignored
    return torch.stack([lp.sum(-1), mask.sum(-1).to(lp.dtype)], -1)


def pair_logps(
    model, batch: dict, multiple: int = 8, completions_only: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed completion log-probs (B, 2), completion tokens (B, 2)) of `model` on a batch of
    pairs. `completions_only`: the LM head runs at the completion positions alone (False under
    tensor parallelism, whose sequence parallelism leaves each rank a slice of the positions)."""
    v = per_row(
        batch, lambda tokens, targets, ends: _row_logps(model, tokens, targets, completions_only), multiple
    )
    return v[..., 0], v[..., 1].long()


def pair_scores(model, batch: dict, multiple: int = 8, last_only: bool = True) -> torch.Tensor:
    """A reward model's score of each side, at its last token: (B, 2) fp32. `last_only`: the final
    block computes that position alone (`Llama.forward`'s `at`); False under tensor parallelism."""

    def score(tokens, targets, ends):
        if last_only:
            return model(tokens, at=ends)[:, 0, 0].float()
        return model(tokens).squeeze(-1).float().gather(1, ends[:, None])[:, 0]

    return per_row(batch, score, multiple)


class PairLoss(Loss):
    """A loss over pairs: both sides of each pair scored, the 2B rows by length groups (`per_row`;
    `multiple` as there). `from_output` takes one forward pass over all rows."""

    def __init__(self, multiple: int = 8):
        self.multiple = multiple

    def count(self, batch: dict) -> int:
        return batch["tokens"].shape[0]

    def tokens(self, batch: dict) -> int:
        return int((batch["ends"] + 1).sum())  # the rows' own tokens, not their padding to seq_len

    def forward(self, model, batch: dict):
        return model(batch["tokens"].flatten(0, 1))

    def summarize(self, totals: dict, count: int, parts: int) -> dict:
        return {k: float(v) / max(count, 1) for k, v in totals.items()}


def side_logps(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed completion log-probs (B, 2), completion tokens (B, 2)) of logits (2B, T, V) and
    targets (B, 2, T)."""
    B = targets.shape[0]
    t = targets.flatten(0, 1)
    lp = token_logps(logits, t)  # (2B, T), 0 where ignored
    return lp.sum(-1).view(B, 2), (t != IGNORE_INDEX).sum(-1).view(B, 2)


class DPOLoss(PairLoss):
    """The DPO family (module docstring). The reference log-probs come from the batch
    (`ref_logps` (B, 2), a cached reference) or from `reference(tokens (2B, T)) -> logits`, run
    without gradients (an online reference: a frozen model, or the policy with its adapters off)."""

    console = ("reward_accuracy", "reward_margin")

    def __init__(self, cfg: DPOConfig, reference=None, multiple: int = 8, completions_only: bool = True):
        super().__init__(multiple)
        self.cfg, self.reference, self.completions_only = cfg, reference, completions_only

    def __call__(self, model, batch: dict) -> LossOut:
        if self.reference is not None and self.cfg.loss != "simpo":
            with torch.no_grad():
                ref, _ = pair_logps(self.reference, batch, self.multiple, self.completions_only)
            batch = {**batch, "ref_logps": ref}
        return self.from_logps(*pair_logps(model, batch, self.multiple, self.completions_only), batch)

    def from_output(self, logits, batch: dict) -> LossOut:
        return self.from_logps(*side_logps(logits, batch["targets"]), batch)

    def from_logps(self, logps: torch.Tensor, n: torch.Tensor, batch: dict) -> LossOut:
        ref = batch.get("ref_logps")
        losses, rewards = dpo_losses(self.cfg, logps, n, None if ref is None else ref.float())
        if self.cfg.rpo_alpha:  # NLL of the chosen completions per token, as a microbatch mean (trl)
            nll = -logps[:, 0].sum() / n[:, 0].sum().clamp(min=1)
            losses = losses + self.cfg.rpo_alpha * nll
        d = rewards.detach()
        metrics = {
            "rewards_chosen": d[:, 0].sum(),
            "rewards_rejected": d[:, 1].sum(),
            "reward_margin": (d[:, 0] - d[:, 1]).sum(),
            "reward_accuracy": (d[:, 0] > d[:, 1]).float().sum(),
            "logps_chosen": logps[:, 0].detach().sum(),
            "logps_rejected": logps[:, 1].detach().sum(),
        }
        return LossOut(losses.sum(), logps.shape[0], metrics)


def dpo_losses(
    cfg: DPOConfig, logps: torch.Tensor, n: torch.Tensor, ref: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per pair (B,), rewards (B, 2)) from the policy's summed completion log-probs (B, 2),
    the completion lengths (B, 2) and the reference's (B, 2) (None for SimPO)."""
    beta, eps = cfg.beta, cfg.label_smoothing
    if cfg.loss == "simpo":
        avg = logps / n.clamp(min=1)
        h = beta * (avg[:, 0] - avg[:, 1]) - cfg.simpo_gamma
        loss = -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)
        return loss, beta * avg.detach()
    if ref is None:
        raise ValueError(f"dpo.loss={cfg.loss} needs the reference log-probs")
    ratios = logps - ref  # (B, 2): log pi / ref per side
    rewards = beta * ratios.detach()
    if cfg.loss == "ipo":  # on per-token means, as the IPO authors and trl compute it
        r = ratios / n.clamp(min=1)
        return (r[:, 0] - r[:, 1] - 1 / (2 * beta)) ** 2, rewards
    h = beta * (ratios[:, 0] - ratios[:, 1])
    if cfg.loss == "sigmoid":
        loss = -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)
    elif cfg.loss == "robust":
        loss = (-(1 - eps) * F.logsigmoid(h) + eps * F.logsigmoid(-h)) / (1 - 2 * eps)
    elif cfg.loss == "hinge":
        loss = torch.relu(1 - h)
    else:
        raise ValueError(f"unknown dpo.loss {cfg.loss!r}")
    return loss, rewards


class RewardLoss(PairLoss):
    """Bradley-Terry on the score of each side's last token: -log s(r_c - r_r - margin), plus
    center_coef (r_c + r_r)^2 (trl's center_rewards_coefficient). Metrics: `accuracy` (r_c > r_r)
    and `margin` (r_c - r_r), per pair."""

    console = ("accuracy", "margin")

    def __init__(self, cfg: RewardConfig, multiple: int = 8, last_only: bool = True):
        super().__init__(multiple)
        self.cfg, self.last_only = cfg, last_only

    def __call__(self, model, batch: dict) -> LossOut:
        return self.from_scores(pair_scores(model, batch, self.multiple, self.last_only))

    def from_output(self, scores, batch: dict) -> LossOut:
        return self.from_scores(last_scores(scores, batch["ends"]))

    def from_scores(self, r: torch.Tensor) -> LossOut:
        """r (B, 2): each side's score."""
        diff = r[:, 0] - r[:, 1]
        loss = -F.logsigmoid(diff - self.cfg.margin)
        if self.cfg.center_coef:
            loss = loss + self.cfg.center_coef * (r[:, 0] + r[:, 1]) ** 2
        d = diff.detach()
        metrics = {"accuracy": (d > 0).float().sum(), "margin": d.sum()}
        return LossOut(loss.sum(), r.shape[0], metrics)


def last_scores(scores: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Each row's score at its last token: scores (2B, T, 1), ends (B, 2) -> (B, 2) fp32."""
    B = ends.shape[0]
    s = scores.squeeze(-1).float()
    return s.gather(1, ends.reshape(-1, 1)).view(B, 2)
