"""PPO's mathematics against plain loops and formulas written out here."""

from __future__ import annotations

import statistics

import pytest
import torch

from ladle.train.ppo import (
    dual_clip_loss,
    entropy,
    explained_variance,
    gae,
    token_rewards,
    value_loss,
    whiten,
)

LENGTHS = [5, 2, 7, 1]


def batch(seed=0, T=7):
    g = torch.Generator().manual_seed(seed)
    R = len(LENGTHS)
    mask = torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]
    return torch.randn(R, T, generator=g), torch.randn(R, T, generator=g), mask


def gae_loop(r, v, gamma, lam):
    """The textbook recursion on one response's lists."""
    adv, last = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        next_v = v[t + 1] if t + 1 < len(r) else 0.0
        last = r[t] + gamma * next_v - v[t] + gamma * lam * last
        adv[t] = last
    return adv, [a + b for a, b in zip(adv, v, strict=True)]


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0)])
def test_gae_equals_a_plain_loop(gamma, lam):
    rewards, values, mask = batch()
    rewards = rewards * mask  # padding holds garbage values but no rewards
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for k, n in enumerate(LENGTHS):
        want_adv, want_ret = gae_loop(rewards[k, :n].tolist(), values[k, :n].tolist(), gamma, lam)
        assert adv[k, :n].tolist() == pytest.approx(want_adv, abs=1e-5)
        assert ret[k, :n].tolist() == pytest.approx(want_ret, abs=1e-5)
        assert adv[k, n:].abs().sum() == 0 and ret[k, n:].abs().sum() == 0
    if lam == 0:  # one-step TD: A = r + gamma V' - V
        assert adv[0, 0] == pytest.approx(
            float(rewards[0, 0] + gamma * values[0, 1] - values[0, 0]), abs=1e-6
        )


def test_token_rewards_put_the_score_on_the_last_token():
    kl = torch.ones(4, 7)
    _, _, mask = batch()
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0])
    r = token_rewards(scores, kl, mask, kl_coef=0.1)
    for k, n in enumerate(LENGTHS):
        want = [-0.1] * (n - 1) + [-0.1 + float(scores[k])] + [0.0] * (7 - n)
        assert r[k].tolist() == pytest.approx(want)


def test_whiten_and_explained_variance():
    x, v, mask = batch(1)
    vals = x[mask].tolist()
    m, s = statistics.fmean(vals), statistics.stdev(vals)
    w = whiten(x, mask)
    assert w[mask].tolist() == pytest.approx([(a - m) / (s * s + 1e-8) ** 0.5 for a in vals], abs=1e-5)
    assert w[~mask].abs().sum() == 0
    assert whiten(x, mask, shift_mean=False)[mask].mean() == pytest.approx(m, abs=1e-5)
    ret = x
    want = 1 - statistics.variance([a - b for a, b in zip(vals, v[mask].tolist(), strict=True)]) / s**2
    assert explained_variance(v, ret, mask) == pytest.approx(want, rel=1e-6)
    assert explained_variance(ret, ret, mask) == 1.0


def test_dual_clip_and_value_clip_by_hand():
    ratio = torch.tensor([0.5, 1.0, 1.5, 10.0, 10.0, 0.5])
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, -1.0])
    # plain clip (0.2): -min(wA, clip(w)A)
    want = [-0.5, -1.0, -1.2, -1.2, 10.0, 0.8 * 1.0]
    assert dual_clip_loss(ratio, adv).tolist() == pytest.approx(want)
    # dual clip 3: a negative advantage's loss is capped at -3 A = 3
    want[4] = 3.0
    assert dual_clip_loss(ratio, adv, dual_clip=3.0).tolist() == pytest.approx(want)
    with pytest.raises(ValueError, match="dual_clip must be above 1"):
        dual_clip_loss(ratio, adv, dual_clip=0.5)
    v, old, ret = torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0.5, 1.0, 0.5]), torch.tensor([2.0, 0.0, 0.5])
    # V moved from 0.5 to 1.0 (clipped to 0.7): max((1 - 2)^2, (0.7 - 2)^2) / 2 = 0.845
    assert value_loss(v, old, ret, 0.2).tolist() == pytest.approx([0.845, 0.5, 0.125])
    assert value_loss(v, old, ret, 0).tolist() == pytest.approx([0.5, 0.5, 0.125])


def test_entropy_equals_torch_distributions():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(2)) * 3
    want = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(entropy(logits, rows=4), want, atol=1e-5)
    assert entropy(torch.zeros(2, 8)).tolist() == pytest.approx([torch.log(torch.tensor(8.0)).item()] * 2)
