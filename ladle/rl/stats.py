"""Statistics of a rollout batch over every rank of a group, each one all-reduce: the moments that
batch-wide advantages and whitening use (so any layout gives the same numbers as one process),
and the per-response means the RL recipes log."""

from __future__ import annotations

import torch

from ladle import distributed as dist


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


class RunningMoments:
    """Count, mean and (unbiased) variance of every value seen so far, merged batch by batch
    (Chan et al.'s parallel update), kept in checkpoints: PPO's running reward statistics."""

    def __init__(self):
        self.n, self.mean, self.var = 0.0, 0.0, 0.0

    def update(self, n: float, mean: float, var: float) -> None:
        """Merge a batch's (count, mean, unbiased variance)."""
        if n <= 0:
            return
        total = self.n + n
        delta = mean - self.mean
        m2 = self.var * max(self.n - 1, 0) + var * max(n - 1, 0) + delta * delta * self.n * n / total
        self.n, self.mean = total, self.mean + delta * n / total
        self.var = m2 / (total - 1) if total > 1 else 0.0

    def state_dict(self) -> dict:
        return {"n": self.n, "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: dict) -> None:
        self.n, self.mean, self.var = state["n"], state["mean"], state["var"]


def global_sum(value: float, group=None) -> float:
    """`value` summed over every rank of `group`."""
    t = torch.tensor([value], dtype=torch.float64, device=dist.collective_device())
    return float(dist.all_reduce_sum(t, group))


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
