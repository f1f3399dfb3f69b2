"""The mathematics of the RL recipes, as plain functions on tensors, each variant by name in a
small registry (`ADVANTAGES`, `KL_ESTIMATORS`, `IMPORTANCE`, `LOSS_AGGS`): no model, no process
group, no config. The recipes pick them by their config's names; tests check each against a
hand computation. Rollouts are ladle/rl/rollout.py's rows: tensors (R, T) with `mask` marking
each row's response tokens (one contiguous run after the prompt).

GRPO and its variants, with G samples of each prompt, rewards r (N = prompts x G, a group's
samples adjacent):
    advantage  grpo         r - mean(group)                               (GRPO)
               rloo         G / (G - 1) (r - mean(group)): the leave-one-out baseline (RLOO)
               reinforce_pp r - mean(group), then whitened over the batch  (REINFORCE++ with baseline)
    scale      group: / (std(group) + 1e-4); batch: / (std(all) + 1e-4); none (Dr. GRPO)
               (for grpo and rloo; reinforce_pp whitens over the batch by definition)
Per response token, with w the importance weight of the policy against the sampling ("old")
policy, token: exp(logp - old), sequence (GSPO): exp(mean over the response of logp - old):
    policy     -min(w A, clip(w, 1 - clip_low, 1 + clip_high) A)   (clip_high > clip_low: DAPO);
               with `dual_clip` c > 1, a negative advantage's loss is also capped at -c A
               (Ye et al., 2020), so a huge ratio cannot blow it up
    kl         with d = logp - ref: k1 d; k2 d^2 / 2; k3 exp(-d) - 1 + d   (Schulman's estimators)
    loss       policy + kl_coef kl
aggregated over the global batch (`loss_agg`, verl's names):
    token-mean                sum over all response tokens / their count   (DAPO; trl's bnpo)
    seq-mean-token-mean       mean over responses of their token mean      (GRPO; trl's grpo)
    seq-mean-token-sum-norm   sum over all tokens / (responses x max_len)  (Dr. GRPO; trl's dr_grpo)
Each is a sum over a count, the shape of every loss of the shared loop (ladle/train/loss.py), so
accumulation and data parallelism do not change it.

Rollout correction: the engine that sampled (another kernel, precision or an older copy of the
weights) is not the policy the trainer scores, so with rho = p_train / p_sample per token (or per
response, `sequence`: the product over its tokens), each token's policy loss is weighted by
    tis   min(rho, cap)                                    (truncated importance sampling)
    mis   rho inside [1 / cap, cap], else 0                (masked: the token, or the whole response,
                                                           leaves the gradient; it still counts)
(verl's rollout correction, slime's TIS/MIS), and the sampler-to-trainer KL is k3 with
d = log p_sample - log p_train, an unbiased estimate on the sampler's own tokens.

PPO, per response token t of a response of length L:
    reward     r_t = -kl_coef KL_t, plus the score of the whole response on its last token
    GAE        delta_t = r_t + gamma V_{t+1} - V_t (V_L = 0);  A_t = delta_t + gamma lam A_{t+1}
    returns    R_t = A_t + V_t, the value head's target
    whitening  (A - mean) / sqrt(var + 1e-8) over all response tokens of the batch (unbiased var)
    value      0.5 max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2)
    entropy    H_t = logsumexp(z) - sum softmax(z) z of the logits z at t (the bonus subtracts
               entropy_coef H)
and `explained_variance` = 1 - Var(R - V) / Var(R), how much of the returns the values explain.
Standard deviations are unbiased (Bessel), as trl's. What is taken over the whole batch on every
rank (batch-wide scales, whitening) gets its moments from ladle/rl/stats.py and applies them here
(`standardize`).
"""

from __future__ import annotations

import math

import torch

EPS = 1e-4  # GRPO's: std + EPS
WHITEN_EPS = 1e-8  # PPO's whitening: sqrt(var + WHITEN_EPS)


# -- advantages ---------------------------------------------------------------------------------
def _centred(r: torch.Tensor, group: int) -> torch.Tensor:
    return r - r.mean(1, keepdim=True)


def _rloo(r: torch.Tensor, group: int) -> torch.Tensor:
    if group < 2:
        raise ValueError("rloo needs at least 2 samples per prompt")
    return _centred(r, group) * group / (group - 1)


ADVANTAGES = {"grpo": _centred, "rloo": _rloo, "reinforce_pp": _centred}  # (prompts, G) -> same shape
SCALES = ("group", "batch", "none")


def advantages(rewards: torch.Tensor, group: int, kind: str = "grpo", scale: str = "group") -> torch.Tensor:
    """One advantage per response from rewards (N,), each group's `group` samples adjacent."""
    if kind not in ADVANTAGES:
        raise ValueError(f"advantage {kind!r}: choose one of {', '.join(ADVANTAGES)}")
    if scale not in SCALES:
        raise ValueError(f"scale {scale!r}: choose one of {', '.join(SCALES)}")
    r = rewards.float().view(-1, group)
    a = ADVANTAGES[kind](r, group)
    if kind == "reinforce_pp":
        a = a.flatten()
        return (a - a.mean()) / (a.std() + EPS) if a.numel() > 1 else a
    if scale == "group":
        std = r.std(1, keepdim=True) if group > 1 else torch.zeros_like(r[:, :1])
        a = a / (std + EPS)
    elif scale == "batch":
        a = a / ((r.std() if r.numel() > 1 else torch.zeros(())) + EPS)
    return a.flatten()


def standardize(x: torch.Tensor, mean: float, var: float, *, center: bool = True, whiten: bool = False):
    """x scaled by moments taken elsewhere (over every rank: ladle/rl/stats.py): GRPO's
    (x - mean) / (std + 1e-4), or with `whiten` PPO's (x - mean) / sqrt(var + 1e-8);
    `center=False` keeps the mean (rescales only)."""
    if whiten:
        return ((x - mean) if center else x) * (1.0 / (var + WHITEN_EPS) ** 0.5)
    return (x - (mean if center else 0.0)) / (var**0.5 + EPS)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """x normalised over the masked entries: (x - mean) / sqrt(var + 1e-8), var unbiased; 0 off
    the mask. `shift_mean=False` keeps the mean (rescales only)."""
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        out = out + mean
    return out * m


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
    """(advantages, returns), each (R, T), 0 off the response. One pass from the end, over the
    masked positions alone: a position off the mask (past the end, or an episode's context
    between the model's turns) passes the next value and advantage on unchanged, so the model's
    tokens chain across its turns as if the context were not there (verl's multi-turn GAE)."""
    T = rewards.shape[1]
    m = mask.to(rewards.dtype)
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = a * m[:, t]
        # past the response's end the next value and advantage stay 0 (nothing flows back)
        next_value = torch.where(m[:, t] > 0, values[:, t], next_value)
        next_adv = torch.where(m[:, t] > 0, a, next_adv)
    return adv, (adv + values) * m


# -- KL estimators and importance weights -------------------------------------------------------
KL_ESTIMATORS = {  # d = logp - ref_logp, per token
    "k1": lambda d: d,
    "k2": lambda d: 0.5 * d * d,
    "k3": lambda d: torch.expm1(-d) + d,
}


def kl_penalty(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator {estimator!r}: choose one of {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](logps - ref_logps)


def _sequence_weights(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    n = mask.sum(-1, keepdim=True).clamp(min=1)
    return torch.exp((log_ratio * mask).sum(-1, keepdim=True) / n)


IMPORTANCE = {  # (log_ratio (R, T), mask) -> weights (R, T) or (R, 1)
    "token": lambda log_ratio, mask: torch.exp(log_ratio),
    "sequence": _sequence_weights,  # GSPO
}


def importance_weights(logps, old_logps, mask, level: str = "token") -> torch.Tensor:
    """exp(logp - old) per token (R, T), or GSPO's exp(mean log-ratio) per response (R, 1)."""
    if level not in IMPORTANCE:
        raise ValueError(f"importance {level!r}: choose one of {', '.join(IMPORTANCE)}")
    return IMPORTANCE[level](logps - old_logps, mask)


ROLLOUT_CORRECTIONS = ("none", "tis", "mis")
LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: a sequence's product cannot overflow


def rollout_correction(
    logps: torch.Tensor,
    sample_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "tis",
    level: str = "token",
    cap: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights (R, T) of each response token's policy loss for the mismatch between the
    trainer's log-probs and the sampler's, and where the cap acted (R, T, bool: truncated by
    `tis`, masked by `mis`); 0 and False off the response."""
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"rollout_correction {mode!r}: choose one of {', '.join(ROLLOUT_CORRECTIONS)}")
    if level not in ("token", "sequence"):
        raise ValueError(f"rollout_correction_level {level!r}: choose token or sequence")
    if cap <= 1:
        raise ValueError(f"rollout_correction_cap must be above 1, got {cap}")
    m = mask.to(torch.float32)
    if mode == "none":
        return m, torch.zeros_like(mask, dtype=torch.bool)
    log_rho = (logps.detach().float() - sample_logps.float()) * m
    if level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    rho = torch.exp(log_rho.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    if mode == "tis":
        hit = rho > cap
        weights = rho.clamp(max=cap)
    else:
        hit = (rho < 1 / cap) | (rho > cap)
        weights = torch.where(hit, torch.zeros_like(rho), rho)
    return weights * m, hit & mask.bool()


def sampler_kl(logps: torch.Tensor, sample_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(sampler || trainer) on the sampler's tokens."""
    return KL_ESTIMATORS["k3"](sample_logps.float() - logps.detach().float())


# -- losses and their aggregation ---------------------------------------------------------------
def _token_mean(per_token, m, rows, max_len):
    return (per_token * m).sum(), m.sum()


def _seq_mean_token_mean(per_token, m, rows, max_len):
    per_seq = (per_token * m).sum(-1) / m.sum(-1).clamp(min=1)
    return per_seq.sum(), rows


def _seq_mean_token_sum_norm(per_token, m, rows, max_len):
    if not max_len:
        raise ValueError("seq-mean-token-sum-norm needs the response-length cap (max_len)")
    return (per_token * m).sum(), rows * max_len


LOSS_AGGS = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, max_len: int | None = None):
    """(sum, count) of a per-token loss (R, T) over the response tokens (`mask`), per `loss_agg`:
    the loss of the global batch is the sum of the sums over the sum of the counts."""
    if mode not in LOSS_AGGS:
        raise ValueError(f"loss_agg {mode!r}: choose one of {', '.join(LOSS_AGGS)}")
    m = mask.to(per_token.dtype)
    rows = mask.any(-1).sum().to(per_token.dtype)  # responses with a token in the loss
    return LOSS_AGGS[mode](per_token, m, rows, max_len)


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


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    importance: str = "token",
    kl_coef: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    kl_estimator: str = "k3",
    dual_clip: float = 0.0,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token loss (R, T) of the clipped surrogate plus kl_coef x KL, and per-token metrics
    (R, T): `kl`, `clipped` (the clip decides the gradient: ratio out of range on the side the
    advantage pushes). `adv`: one per response (R,), or per token (R, T) as PPO's GAE gives;
    `dual_clip` c > 1 caps a negative advantage's loss at -c A (PPO's dual clip); `weights`
    (R, T): the rollout correction's, on the surrogate (not the KL)."""
    w = importance_weights(logps, old_logps, mask, importance)
    a = (adv[:, None] if adv.dim() == 1 else adv).to(w.dtype)
    clipped_w = w.clamp(1 - clip_low, 1 + clip_high)
    loss = -torch.minimum(w * a, clipped_w * a)
    if dual_clip:
        loss = torch.where(a < 0, torch.minimum(loss, -dual_clip * a), loss)
    if weights is not None:
        loss = loss * weights.detach()
    metrics = {"clipped": (((w < 1 - clip_low) & (a < 0)) | ((w > 1 + clip_high) & (a > 0))).float()}
    if kl_coef:
        if ref_logps is None:
            raise ValueError("kl_coef > 0 needs the reference log-probs")
        kl = kl_penalty(logps, ref_logps, kl_estimator)
        loss = loss + kl_coef * kl
        metrics["kl"] = kl.detach()
    loss = loss.expand_as(logps) if loss.shape != logps.shape else loss
    metrics = {k: v.expand_as(logps) for k, v in metrics.items()}
    return loss, metrics


def value_loss(values, old_values, returns, clip: float = 0.2) -> torch.Tensor:
    """Per-token clipped value loss 0.5 max((V - R)^2, (V_clipped - R)^2); clip 0: unclipped."""
    plain = (values - returns) ** 2
    if not clip:
        return 0.5 * plain
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum(plain, (clipped - returns) ** 2)


# -- routing replay (MoE) -------------------------------------------------------------------------
def routing_agreement(choices: torch.Tensor, recorded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens routed alike, tokens compared), summed over MoE layers: the trainer's own top-k
    `choices` (N, L, k) against the sampler's `recorded` (B, T, L, k) (-1 where none was
    recorded), as sets (the order of the k experts does not matter)."""
    L, k = choices.shape[1:]
    rec = recorded.reshape(-1, L, k).to(choices.device).long()
    valid = rec[:, 0, 0] >= 0
    same = (choices.sort(-1).values == rec.sort(-1).values).all(-1)  # (N, L)
    return same[valid].sum(), valid.sum() * L


# -- on-policy distillation -----------------------------------------------------------------------
DIVERGENCES = ("reverse_kl", "forward_kl", "jsd")


def divergence(student: torch.Tensor, teacher: torch.Tensor, kind: str = "reverse_kl", beta: float = 0.5):
    """Per position (N, V) -> (N,), fp32, the divergence of the student's next-token distribution
    from the teacher's, both given as logits (at the sampling temperature already):

        reverse_kl   KL(student || teacher) = sum_v p_s (log p_s - log p_t)   (mode seeking)
        forward_kl   KL(teacher || student) = sum_v p_t (log p_t - log p_s)   (mode covering)
        jsd          beta KL(teacher || m) + (1 - beta) KL(student || m),
                     m = beta p_t + (1 - beta) p_s                            (GKD's generalised JSD)

    over the whole vocabulary at each position the student sampled (the exact divergence, not a
    one-token estimate). The teacher carries no gradient."""
    if kind not in DIVERGENCES:
        raise ValueError(f"distill.loss {kind!r}: choose one of {', '.join(DIVERGENCES)}")
    ls = torch.log_softmax(student.float(), -1)
    lt = torch.log_softmax(teacher.detach().float(), -1)
    if kind == "reverse_kl":
        return (ls.exp() * (ls - lt)).sum(-1)
    if kind == "forward_kl":
        return (lt.exp() * (lt - ls)).sum(-1)
    lm = torch.logsumexp(torch.stack([ls + math.log1p(-beta), lt + math.log(beta)]), 0)
    return beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)


# -- diagnostics --------------------------------------------------------------------------------
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
