"""The RL recipes' loss objects on rollout batches (ladle/rl/rollout.py `sequences`): the policy's
(GRPO's, and PPO's actor) and the value model's (PPO's critic). Each is the shared loop's shape,
(sum, count, metrics) (ladle/train/loss.py); the mathematics is ladle/rl/algorithms.py.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ladle.models.moe import choices
from ladle.rl.algorithms import (
    IMPORTANCE,
    KL_ESTIMATORS,
    LOSS_AGGS,
    ROLLOUT_CORRECTIONS,
    aggregate,
    divergence,
    entropy,
    policy_loss,
    rollout_correction,
    routing_agreement,
    sampler_kl,
    value_loss,
)
from ladle.train.loss import IGNORE_INDEX, Loss, LossOut, token_logps


def sharded_entropy(logits: DTensor) -> torch.Tensor:
    """The entropy at each position (R, T) of vocabulary-sharded logits (R, T, V), under
    loss_parallel: its log-softmax runs on the shards, the sum over the vocabulary is one
    all-reduce."""
    lp = torch.log_softmax(logits.float(), -1)
    ent = -(lp.exp() * lp).sum(-1)
    return ent.full_tensor() if isinstance(ent, DTensor) else ent


class PolicyLoss(Loss):
    """The policy's loss on a batch of rollouts (GRPO's, and PPO's actor): `tokens` (R, T) prompt +
    response, `targets` the response tokens (ladle/rl/rollout.py `sequences`), `advantages` (R,)
    or (R, T), `old_logps` (R, T) of the sampling policy (0 off the response), and `ref_logps`
    (R, T) with a KL term. Metrics per response token: `kl`, `clip_fraction` and `entropy` (of
    softmax(logits / T); with `entropy_coef` > 0 its bonus joins the loss).

    Without `old_logps` the batch is trained on once, right after it was sampled: the sampling
    policy is the policy itself, and its log-probs are this forward's, detached (ratio 1, no
    second forward pass to compute them). `rollout_logprob_diff` is then the largest difference
    between them and the batch's `sample_logps`, over every rank.

    With `sample_logps` (the sampler's) the loss logs `rollout_kl`, the sampler-to-trainer KL per
    token, and with a `correction` (`tis`, `mis`) weights each token's surrogate by the ratio of
    the trainer's old log-probs to the sampler's (ladle/rl/algorithms.py `rollout_correction`),
    logging `rollout_is_weight_mean` and `rollout_is_clipped_frac`."""

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
        correction: str = "none",
        correction_level: str = "token",
        correction_cap: float = 2.0,
        routing_replay: bool = False,
    ):
        for value, known, name in (
            (importance, IMPORTANCE, "importance"),
            (loss_agg, LOSS_AGGS, "loss_agg"),
            (kl_estimator, KL_ESTIMATORS, "kl_estimator"),
            (correction, ROLLOUT_CORRECTIONS, "rollout_correction"),
        ):
            if value not in known:
                raise ValueError(f"{name} {value!r}: choose one of {', '.join(known)}")
        self.clip_low, self.clip_high, self.importance = clip_low, clip_high, importance
        self.loss_agg, self.max_len = loss_agg, max_len
        self.kl_coef, self.kl_estimator, self.temperature = kl_coef, kl_estimator, temperature
        self.dual_clip, self.entropy_coef = dual_clip, entropy_coef
        self.correction, self.correction_level = correction, correction_level
        self.correction_cap, self.routing_replay = correction_cap, routing_replay

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
        replay = {"routing": batch["routing"]} if self.routing_replay and "routing" in batch else {}
        return model(
            batch["tokens"], keep=batch["targets"] != IGNORE_INDEX, **replay
        )  # the responses' logits only

    def __call__(self, model, batch: dict) -> LossOut:
        out = self.from_output(self.forward(model, batch), batch)
        own = choices(model)
        if own is not None:  # an MoE policy: is it routing as its sampler did? (replayed or not)
            # every microbatch of every rank reports both (0 where none was recorded): the
            # step's reduction takes the same metrics from each
            zero = own.new_zeros((), dtype=torch.float32)
            agree, n = routing_agreement(own, batch["routing"]) if "routing" in batch else (zero, zero)
            out.metrics["routing_agree"], out.metrics["routing_tokens"] = agree.float(), n.float()
        return out

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
        sampled = batch.get("sample_logps")  # the sampler's, against the trainer's at sampling time
        weights = hit = None
        if sampled is not None and self.correction != "none":
            weights, hit = rollout_correction(
                old, sampled, mask, self.correction, self.correction_level, self.correction_cap
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
            weights=weights,
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
        if sampled is not None:
            metrics["rollout_kl"] = (sampler_kl(old, sampled) * m).sum()
        if weights is not None:
            metrics["rollout_is_weight_mean"] = (weights * m).sum()
            metrics["rollout_is_clipped_frac"] = (hit.float() * m).sum()
        if diff is not None:
            metrics["rollout_logprob_diff_max"] = diff
        return LossOut(total, count, metrics)

    def summarize(self, totals: dict, count: int, parts: int) -> dict:
        n = max(float(totals.pop("response_tokens", 0.0)), 1.0)
        routed = totals.pop("routing_agree", None), totals.pop("routing_tokens", None)
        out = {k: float(v) / n for k, v in totals.items() if not k.endswith("_max")}
        if routed[1] is not None and float(routed[1]) > 0:  # share of (token, MoE layer) routed alike
            out["routing_agreement"] = float(routed[0]) / float(routed[1])
        if "rollout_logprob_diff_max" in totals:
            out["rollout_logprob_diff"] = float(totals["rollout_logprob_diff_max"])
        return out


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


class DistillLoss(Loss):
    """On-policy distillation's loss on the student's rollouts (`ladle run distill`): at every
    response position the divergence (`kind`: ladle/rl/algorithms.py `divergence`) of the
    student's next-token distribution from the frozen `teacher`'s, which runs its forward on the
    same tokens in the same step (one microbatch of its logits at a time), both at `temperature`.
    Summed over response tokens, a mean per token. With `reward_weight` > 0 the rewards join as
    REINFORCE on the sampled tokens: - weight x `advantages` x log p (on-policy: one update per
    batch). Metrics per token: `teacher_kl` (the reverse KL, whatever the loss), `distill_loss`,
    and `rollout_logprob_diff` (the trainer's against the sampler's log-probs)."""

    console = ("teacher_kl",)

    def __init__(self, teacher, *, kind: str = "reverse_kl", beta: float = 0.5, temperature: float = 1.0,
                 reward_weight: float = 0.0):  # fmt: skip
        divergence(torch.zeros(1, 2), torch.zeros(1, 2), kind, beta)  # the kind checked now
        self.teacher, self.kind, self.beta = teacher, kind, beta
        self.temperature, self.reward_weight = temperature, reward_weight

    def count(self, batch: dict):
        return int((batch["targets"] != IGNORE_INDEX).sum())

    def tokens(self, batch: dict) -> int:
        return int(batch["lengths"].sum())

    def __call__(self, model, batch: dict) -> LossOut:
        mask = batch["targets"] != IGNORE_INDEX
        student = model(batch["tokens"], keep=mask)  # (N, V): the response positions only
        with torch.no_grad():
            teacher = self.teacher(batch["tokens"], keep=mask)
        return self.from_logits(student, teacher, batch)

    def from_logits(self, student: torch.Tensor, teacher: torch.Tensor, batch: dict) -> LossOut:
        """`student`, `teacher`: logits (N, V) at the N response positions; a teacher of a larger
        (padded) vocabulary is read over the student's ids alone."""
        mask = batch["targets"] != IGNORE_INDEX
        t = self.temperature if self.temperature not in (0, 1) else 1.0
        student, teacher = student / t, teacher[..., : student.shape[-1]] / t
        per = divergence(student, teacher, self.kind, self.beta)
        with torch.no_grad():
            kl = per.detach() if self.kind == "reverse_kl" else divergence(student, teacher, "reverse_kl")
        total = per.sum()
        logps = token_logps(student, batch["targets"][mask])
        if self.reward_weight:
            adv = batch["advantages"]
            adv = adv[:, None].expand_as(mask)[mask] if adv.dim() == 1 else adv[mask]
            total = total - self.reward_weight * (adv * logps).sum()
        metrics = {"teacher_kl": kl.sum(), "distill_loss": per.detach().sum()}
        if "sample_logps" in batch and mask.any():
            metrics["rollout_logprob_diff_max"] = (logps.detach() - batch["sample_logps"][mask]).abs().amax()
        return LossOut(total, mask.sum(), metrics)

    def summarize(self, totals: dict, count: int, parts: int) -> dict:
        n = max(float(count), 1.0)
        out = {k: float(v) / n for k, v in totals.items() if not k.endswith("_max")}
        if "rollout_logprob_diff_max" in totals:
            out["rollout_logprob_diff"] = float(totals["rollout_logprob_diff_max"])
        return out
