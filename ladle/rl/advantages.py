"""The advantage phase of an RL step: each recipe's estimator over a whole rollout batch (this
rank's microbatches, and every rank's through one all-reduce of moments), filling each
microbatch's `advantages` (PPO's also `returns`) in place and returning the figures to log. The
per-row mathematics is ladle/rl/algorithms.py; what is taken over the batch uses
ladle/rl/stats.py, so any layout gives the advantages of one process.
"""

from __future__ import annotations

import torch

from ladle.rl.algorithms import advantages, gae, kl_penalty, standardize, token_rewards
from ladle.rl.stats import RunningMoments, global_moments, global_sum
from ladle.train.loss import IGNORE_INDEX


def group_advantages(batches: list[dict], section, group=None) -> dict:
    """GRPO's: within each prompt's group of samples (a microbatch holds whole groups), from each
    microbatch's `scores`. What is taken over the batch (`scale: batch`'s std, REINFORCE++'s
    whitening) is over the global batch, every rank's rows. `section`: `grpo.*`
    (num_samples, advantage, scale)."""
    g = section
    batch_wide = g.scale == "batch" or g.advantage == "reinforce_pp"
    scale = "none" if batch_wide else g.scale
    # reinforce_pp: the centred rewards, whitened below; the others: centred (and rloo's factor)
    local = [
        advantages(
            b["scores"].cpu(), g.num_samples, "grpo" if g.advantage == "reinforce_pp" else g.advantage, scale
        )
        for b in batches
    ]
    if batch_wide:
        vals = local if g.advantage == "reinforce_pp" else [b["scores"].cpu() for b in batches]
        _, mean, var = global_moments(torch.cat(vals), group)
        local = [standardize(a, mean, var, center=g.advantage == "reinforce_pp") for a in local]
    for b, a in zip(batches, local, strict=True):
        b["advantages"] = a.float().to(b["scores"].device)
    return {}


def gae_advantages(batches: list[dict], section, group=None, moments: RunningMoments | None = None) -> dict:
    """PPO's: a response's reward is its score on its last token minus `kl_coef` x KL to the
    reference (`ref_logps`, when the batch has them) on every token; GAE over the critic's
    `old_values` gives per-token advantages and returns; the advantages are whitened over every
    rank's response tokens (`whiten_advantages`). With `moments` the scores are first
    normalised by the running mean and std of every score so far, this batch's included
    (`normalize_rewards`). Logs `kl` (per response token) with a reference. `section`: `ppo.*`
    (kl_estimator, kl_coef, gamma, lam, whiten_advantages)."""
    p = section
    kl_sum, adv, with_ref = 0.0, [], False
    if moments is not None:
        live = [b["scores"][(b["targets"] != IGNORE_INDEX).any(-1)].cpu() for b in batches]  # no placeholder
        moments.update(*global_moments(torch.cat(live), group))
        for b in batches:
            b["scores"] = standardize(b["scores"], moments.mean, moments.var, whiten=True)
    for b in batches:
        mask = b["targets"] != IGNORE_INDEX
        kl = torch.zeros_like(b["old_logps"])
        if "ref_logps" in b:
            kl = kl_penalty(b["old_logps"], b["ref_logps"], p.kl_estimator) * mask
            kl_sum, with_ref = kl_sum + float(kl.sum()), True
        rewards = token_rewards(b["scores"], kl, mask, p.kl_coef)
        b["advantages"], b["returns"] = gae(rewards, b["old_values"], mask, p.gamma, p.lam)
        adv.append(b["advantages"][mask])
    # whitened over every rank's response tokens: the same batch on any layout whitens alike
    n, mean, var = global_moments(torch.cat(adv), group)
    kl_total = global_sum(kl_sum, group)
    if p.whiten_advantages and n > 1:
        for b in batches:
            mask = b["targets"] != IGNORE_INDEX
            b["advantages"] = standardize(b["advantages"], mean, var, whiten=True) * mask
    return {"kl": kl_total / max(n, 1.0)} if with_ref else {}
