"""PPO's mathematics on rollouts (ladle/train/rollout.py), as plain functions; the clipped policy
surrogate and the KL estimators are GRPO's (ladle/train/grpo.py).

Per response token t of a response of length L (tensors (R, T), `mask` marking each row's
response tokens, one contiguous run: after the prompt in a training row):
    reward     r_t = -kl_coef KL_t, plus the score of the whole response on its last token
    GAE        delta_t = r_t + gamma V_{t+1} - V_t (V_L = 0);  A_t = delta_t + gamma lam A_{t+1}
    returns    R_t = A_t + V_t, the value head's target
    whitening  (A - mean) / sqrt(var + 1e-8) over all response tokens of the batch (unbiased var)
    policy     the clipped surrogate; with `dual_clip` c > 1, a negative advantage's loss is also
               capped at -c A (Ye et al., 2020), so a huge ratio cannot blow it up
    value      0.5 max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2)
    entropy    H_t = logsumexp(z) - sum softmax(z) z of the logits z at t (the bonus subtracts
               entropy_coef H)
and `explained_variance` = 1 - Var(R - V) / Var(R), how much of the returns the values explain.
"""

from __future__ import annotations

import torch

from ladle.train.loss import IGNORE_INDEX, Loss, LossOut


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """(R, T): -kl_coef x KL per response token, plus each response's score (R,) on its last one."""
    r = -kl_coef * kl * mask
    T = mask.shape[-1]
    last = T - 1 - mask.flip(-1).long().argmax(-1)  # the last masked column
    has = mask.any(-1)
    rows = torch.arange(len(scores), device=r.device)[has]
    r[rows, last[has]] += scores[has].to(r.dtype)
    return r


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
):
    """(advantages, returns), each (R, T), 0 off the response. One pass from the end."""
    T = rewards.shape[1]
    m = mask.to(rewards.dtype)
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = a * m[:, t]
        # past the response's end nothing flows back: the next value and advantage are 0 there
        next_value = values[:, t] * m[:, t]
        next_adv = a * m[:, t]
    return adv, (adv + values) * m


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """x normalised over the masked entries: (x - mean) / sqrt(var + 1e-8), var unbiased; 0 off
    the mask. `shift_mean=False` keeps the mean (rescales only)."""
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out * m


def dual_clip_loss(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float = 0.0,
) -> torch.Tensor:
    """Per-token clipped surrogate -min(w A, clip(w) A); with dual_clip c > 1, for A < 0 also
    min(that, -c A)."""
    loss = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    if dual_clip:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be above 1 (or 0: off), got {dual_clip}")
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    return loss


def value_loss(values, old_values, returns, clip: float = 0.2) -> torch.Tensor:
    """Per-token clipped value loss 0.5 max((V - R)^2, (V_clipped - R)^2); clip 0: unclipped."""
    plain = (values - returns) ** 2
    if not clip:
        return 0.5 * plain
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum(plain, (clipped - returns) ** 2)


def entropy(logits: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """The entropy of softmax(logits) at each position (..., V) -> (...), fp32, a chunk of rows at
    a time (no (N, V) fp32 copy of all the logits at once)."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = [flat.new_zeros(0, dtype=torch.float32)]
    for s in range(0, flat.shape[0], rows):
        z = flat[s : s + rows].float()
        lse = torch.logsumexp(z, -1)
        out.append(lse - (torch.softmax(z, -1) * z).sum(-1))
    return torch.cat(out).view(logits.shape[:-1])


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the response tokens (1: perfect, 0: no better than the mean)."""
    m = mask.bool()
    r, v = returns[m].double(), values[m].double()
    var = r.var()
    return float(1 - (r - v).var() / var) if var > 0 else float("nan")


class ValueLoss(Loss):
    """The value model's loss on a batch of rollouts: its outputs at the positions that predict a
    response token (`targets`) against `returns`, clipped around `old_values`; a mean
    over response tokens. Metrics: `explained_variance` and `value_mean`."""

    console = ("value_loss",)

    def __init__(self, clip: float = 0.2):
        self.clip = clip

    def count(self, batch: dict):
        return int((batch["targets"] != IGNORE_INDEX).sum())

    def tokens(self, batch: dict) -> int:
        return int(batch["lengths"].sum())

    def forward(self, model, batch: dict):
        if self.all_positions:  # tensor parallel: (R, T, 1) at every position
            return model(batch["tokens"])
        return model(batch["tokens"], keep=batch["targets"] != IGNORE_INDEX)  # (N, 1): the response positions

    def from_output(self, out, batch: dict) -> LossOut:
        """`out` (N, 1) at the response positions (`forward`), or (R, T, 1) at every position."""
        mask = batch["targets"] != IGNORE_INDEX
        m = mask.float()
        if out.dim() == 2:
            out = torch.zeros(*mask.shape, 1, dtype=out.dtype, device=out.device).masked_scatter(
                mask[..., None], out
            )
        v = out[..., 0].float()
        per = value_loss(v, batch["old_values"], batch["returns"], self.clip)
        r = batch["returns"]
        err = (r - v.detach()) * m
        metrics = {  # the sums explained_variance is made of, over every rank's response tokens
            "n": m.sum(),
            "r": (r * m).sum(),
            "r2": (r * r * m).sum(),
            "e": err.sum(),
            "e2": (err * err).sum(),
            "v": (v.detach() * m).sum(),
        }
        return LossOut((per * m).sum(), mask.sum(), metrics)

    def summarize(self, totals: dict, count: int, parts: int) -> dict:
        t = {k: float(v) for k, v in totals.items()}
        n = max(t["n"], 1.0)

        def var(s, s2):  # unbiased, as explained_variance above
            return (s2 - s * s / n) / max(n - 1, 1.0)

        var_r = var(t["r"], t["r2"])
        ev = 1 - var(t["e"], t["e2"]) / var_r if var_r > 0 else float("nan")
        return {"explained_variance": ev, "value_mean": t["v"] / n}
