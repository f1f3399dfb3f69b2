"""The policy-gradient mathematics of GRPO and its variants, as plain functions and one loss
object on rollouts (ladle/train/rollout.py).

With G samples of each prompt, rewards r (N = prompts x G, a group's samples adjacent):
    advantage  grpo         r - mean(group)                               (GRPO)
               rloo         G / (G - 1) (r - mean(group)): the leave-one-out baseline (RLOO)
               reinforce_pp r - mean(group), then whitened over the batch  (REINFORCE++ with baseline)
    scale      group: / (std(group) + 1e-4); batch: / (std(all) + 1e-4); none (Dr. GRPO)
               (for grpo and rloo; reinforce_pp whitens over the batch by definition)
Per response token, with w the importance weight of the policy against the sampling ("old")
policy, token: exp(logp - old), sequence (GSPO): exp(mean over the response of logp - old):
    policy     -min(w A, clip(w, 1 - clip_low, 1 + clip_high) A)   (clip_high > clip_low: DAPO)
    kl         with d = logp - ref: k1 d; k2 d^2 / 2; k3 exp(-d) - 1 + d   (Schulman's estimators)
    loss       policy + kl_coef kl
aggregated over the global batch (`loss_agg`, verl's names):
    token-mean                sum over all response tokens / their count   (DAPO; trl's bnpo)
    seq-mean-token-mean       mean over responses of their token mean      (GRPO; trl's grpo)
    seq-mean-token-sum-norm   sum over all tokens / (responses x max_len)  (Dr. GRPO; trl's dr_grpo)
Each is a sum over a count, the shape of every loss of the shared loop (ladle/train/loss.py), so
accumulation and data parallelism do not change it. Standard deviations are unbiased (Bessel), as
trl's.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ladle.train.loss import IGNORE_INDEX, Loss, LossOut, token_logps
from ladle.train.ppo import entropy

ADVANTAGES = ("grpo", "rloo", "reinforce_pp")
SCALES = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
IMPORTANCE = ("token", "sequence")
EPS = 1e-4


def advantages(rewards: torch.Tensor, group: int, kind: str = "grpo", scale: str = "group") -> torch.Tensor:
    """One advantage per response from rewards (N,), each group's `group` samples adjacent."""
    if kind not in ADVANTAGES:
        raise ValueError(f"advantage {kind!r}: choose one of {', '.join(ADVANTAGES)}")
    if scale not in SCALES:
        raise ValueError(f"scale {scale!r}: choose one of {', '.join(SCALES)}")
    r = rewards.float().view(-1, group)
    a = r - r.mean(1, keepdim=True)
    if kind == "reinforce_pp":
        a = a.flatten()
        return (a - a.mean()) / (a.std() + EPS) if a.numel() > 1 else a
    if kind == "rloo":
        if group < 2:
            raise ValueError("rloo needs at least 2 samples per prompt")
        a = a * group / (group - 1)
    if scale == "group":
        std = r.std(1, keepdim=True) if group > 1 else torch.zeros_like(r[:, :1])
        a = a / (std + EPS)
    elif scale == "batch":
        a = a / ((r.std() if r.numel() > 1 else torch.zeros(())) + EPS)
    return a.flatten()


def kl_penalty(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs."""
    d = logps - ref_logps
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"kl_estimator {estimator!r}: choose one of {', '.join(KL_ESTIMATORS)}")


def importance_weights(logps, old_logps, mask, level: str = "token") -> torch.Tensor:
    """exp(logp - old) per token (R, T), or GSPO's exp(mean log-ratio) per response (R, 1)."""
    log_ratio = logps - old_logps
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        n = mask.sum(-1, keepdim=True).clamp(min=1)
        return torch.exp((log_ratio * mask).sum(-1, keepdim=True) / n)
    raise ValueError(f"importance {level!r}: choose one of {', '.join(IMPORTANCE)}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, max_len: int | None = None):
    """(sum, count) of a per-token loss (R, T) over the response tokens (`mask`), per `loss_agg`:
    the loss of the global batch is the sum of the sums over the sum of the counts."""
    m = mask.to(per_token.dtype)
    rows = mask.any(-1).sum().to(per_token.dtype)  # responses with a token in the loss
    if mode == "token-mean":
        return (per_token * m).sum(), m.sum()
    if mode == "seq-mean-token-mean":
        per_seq = (per_token * m).sum(-1) / m.sum(-1).clamp(min=1)
        return per_seq.sum(), rows
    if mode == "seq-mean-token-sum-norm":
        if not max_len:
            raise ValueError("seq-mean-token-sum-norm needs the response-length cap (max_len)")
        return (per_token * m).sum(), rows * max_len
    raise ValueError(f"loss_agg {mode!r}: choose one of {', '.join(LOSS_AGGS)}")


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token loss (R, T) of the clipped surrogate plus kl_coef x KL, and per-token metrics
    (R, T): `kl`, `clipped` (the clip decides the gradient: ratio out of range on the side the
    advantage pushes). `adv`: one per response (R,), or per token (R, T) as PPO's GAE gives;
    `dual_clip` c > 1 caps a negative advantage's loss at -c A (PPO's dual clip)."""
    w = importance_weights(logps, old_logps, mask, importance)
    a = (adv[:, None] if adv.dim() == 1 else adv).to(w.dtype)
    clipped_w = w.clamp(1 - clip_low, 1 + clip_high)
    loss = -torch.minimum(w * a, clipped_w * a)
    if dual_clip:
        loss = torch.where(a < 0, torch.minimum(loss, -dual_clip * a), loss)
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


def sharded_entropy(logits: DTensor) -> torch.Tensor:
    """The entropy at each position (R, T) of vocabulary-sharded logits (R, T, V), under
    loss_parallel: its log-softmax runs on the shards, the sum over the vocabulary is one
    all-reduce."""
    lp = torch.log_softmax(logits.float(), -1)
    ent = -(lp.exp() * lp).sum(-1)
    return ent.full_tensor() if isinstance(ent, DTensor) else ent


class PolicyLoss(Loss):
    """The policy's loss on a batch of rollouts (GRPO's, and PPO's actor): `tokens` (R, T) prompt +
    response, `targets` the response tokens (ladle/train/rollout.py `sequences`), `advantages` (R,)
    or (R, T), `old_logps` (R, T) of the sampling policy (0 off the response), and `ref_logps`
    (R, T) with a KL term. Metrics per response token: `kl`, `clip_fraction` and `entropy` (of
    softmax(logits / T); with `entropy_coef` > 0 its bonus joins the loss).

    Without `old_logps` the batch is trained on once, right after it was sampled: the sampling
    policy is the policy itself, and its log-probs are this forward's, detached (ratio 1, no
    second forward pass to compute them). `rollout_logprob_diff` is then the largest difference
    between them and the batch's `sample_logps`, over every rank."""

    console = ("kl", "clip_fraction")

    def __init__(
        self,
        *,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        importance: str = "token",
        loss_agg: str = "token-mean",
        max_len: int | None = None,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        temperature: float = 1.0,
        dual_clip: float = 0.0,
        entropy_coef: float = 0.0,
    ):
        for value, known, name in (
            (importance, IMPORTANCE, "importance"),
            (loss_agg, LOSS_AGGS, "loss_agg"),
            (kl_estimator, KL_ESTIMATORS, "kl_estimator"),
        ):
            if value not in known:
                raise ValueError(f"{name} {value!r}: choose one of {', '.join(known)}")
        self.clip_low, self.clip_high, self.importance = clip_low, clip_high, importance
        self.loss_agg, self.max_len = loss_agg, max_len
        self.kl_coef, self.kl_estimator, self.temperature = kl_coef, kl_estimator, temperature
        self.dual_clip, self.entropy_coef = dual_clip, entropy_coef

    def count(self, batch: dict):
        mask = batch["targets"] != IGNORE_INDEX
        if self.loss_agg == "token-mean":
            return int(mask.sum())
        rows = int(mask.any(-1).sum())  # a response masked out of the loss (all IGNORE) counts for nothing
        return rows * (self.max_len if self.loss_agg == "seq-mean-token-sum-norm" else 1)

    def tokens(self, batch: dict) -> int:
        return int(batch["lengths"].sum())  # prompt + response, not the padding

    def forward(self, model, batch: dict):
        if self.all_positions:  # tensor parallel: the head cannot pick positions from sequence shards
            return model(batch["tokens"])
        return model(batch["tokens"], keep=batch["targets"] != IGNORE_INDEX)  # the responses' logits only

    def from_output(self, logits, batch: dict) -> LossOut:
        """`logits` (N, V) of the response positions (`forward`), or (R, T, V) of every position
        (vocabulary-sharded under TP: scored under loss_parallel, which the unit enters)."""
        if self.temperature not in (0, 1):
            logits = logits / self.temperature
        mask = batch["targets"] != IGNORE_INDEX
        sharded = isinstance(logits, DTensor)
        if logits.dim() == 3 and not sharded:
            logits = logits[mask]
        if sharded:
            logps = token_logps(logits, batch["targets"]).float() * mask
        else:
            logps = torch.zeros(mask.shape, dtype=torch.float32, device=logits.device)
            logps = logps.masked_scatter(mask, token_logps(logits, batch["targets"][mask]))
        old = batch.get("old_logps")
        diff = None
        if old is None:  # one update on fresh rollouts: the sampling policy is this one
            old = logps.detach()
            if "sample_logps" in batch:
                diff = (
                    ((old - batch["sample_logps"]).abs() * mask).amax() if mask.any() else old.new_zeros(())
                )
        loss, per_token = policy_loss(
            logps,
            old,
            batch["advantages"],
            mask,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            importance=self.importance,
            kl_coef=self.kl_coef,
            ref_logps=batch.get("ref_logps"),
            kl_estimator=self.kl_estimator,
            dual_clip=self.dual_clip,
        )
        # the entropy of the response positions only (not a (B, T, V) pass over the prompts)
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.entropy_coef > 0):
            if sharded:
                ent = sharded_entropy(logits) * mask
            else:
                ent = torch.zeros_like(logps).masked_scatter(mask, entropy(logits))
        if self.entropy_coef:
            loss = loss - self.entropy_coef * ent
        total, count = aggregate(loss, mask, self.loss_agg, self.max_len)
        m = mask.float()
        # metrics are per response token whatever the aggregation: sums here, the token count below
        metrics = {
            "clip_fraction": (per_token["clipped"] * m).sum(),
            "entropy": (ent.detach() * m).sum(),
            "response_tokens": m.sum(),
        }
        if "kl" in per_token:
            metrics["kl"] = (per_token["kl"] * m).sum()
        if diff is not None:
            metrics["rollout_logprob_diff_max"] = diff
        return LossOut(total, count, metrics)

    def summarize(self, totals: dict, count: int, parts: int) -> dict:
        n = max(float(totals.pop("response_tokens", 0.0)), 1.0)
        out = {k: float(v) / n for k, v in totals.items() if not k.endswith("_max")}
        if "rollout_logprob_diff_max" in totals:
            out["rollout_logprob_diff"] = float(totals["rollout_logprob_diff_max"])
        return out
