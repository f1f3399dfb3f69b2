"""Rollouts of the RL recipes: a response depends on its key (seed, step, prompt, sample), not on
the batch or the layout it was sampled in; the training forward's log-probs equal the sampling
ones; stop tokens and the cap; load balancing."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ladle.config.schema import ModelConfig
from ladle.models.generation import sample_next
from ladle.models.llama import build_model
from ladle.rl.rollout import (
    Sampling,
    balance,
    imbalance,
    logprob_diff,
    response_logps,
    rollout,
    sequences,
)

CFG = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(ModelConfig(**CFG))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [
        torch.randint(1, 64, (int(n),), generator=g).tolist() for n in torch.randint(2, 12, (6,), generator=g)
    ]


def keyed(r):
    return {
        (i, s): (ids, lps)
        for i, s, ids, lps in zip(r.prompt_index, r.sample_index, r.response_ids, r.sample_logps, strict=True)
    }


def test_inverse_cdf_sampling():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]])
    logits = probs.log()  # -inf for the token of mass 0
    for u, want in [(0.0, 0), (0.05, 0), (0.1, 2), (0.69, 2), (0.71, 3), (0.999, 3)]:
        assert sample_next(logits, 1.0, uniforms=torch.tensor([u])).item() == want, u
    # many uniforms: the frequencies are the probabilities (and a 0-mass token never comes)
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(sample_next(logits.expand(20000, 4), 1.0, uniforms=u), minlength=4) / 20000
    assert counts[1] == 0 and torch.allclose(counts, probs[0], atol=0.015)
    # top-k / top-p apply before the draw: top_k 1 is the argmax whatever the uniform
    assert sample_next(logits, 1.0, top_k=1, uniforms=torch.tensor([0.99])).item() == 2


def test_a_response_depends_on_its_key_not_on_the_batch(model, prompts):
    s = Sampling(n=3, temperature=1.0, top_p=0.9, top_k=40, max_new_tokens=10)
    idx = list(range(len(prompts)))
    whole = keyed(rollout(model, prompts, idx, s, seed=3, step=7, end_ids={0}, batch_size=64))
    small = keyed(rollout(model, prompts, idx, s, seed=3, step=7, end_ids={0}, batch_size=4))
    rev = keyed(rollout(model, prompts[::-1], idx[::-1], s, seed=3, step=7, end_ids={0}, batch_size=5))
    assert len(whole) == 18 and small.keys() == whole.keys() == rev.keys()
    for k in whole:
        assert small[k][0] == whole[k][0] == rev[k][0], k  # the same tokens
        assert small[k][1] == pytest.approx(whole[k][1], abs=1e-5)
    # another step, seed or sample index draws other responses
    later = keyed(rollout(model, prompts, idx, s, seed=3, step=8, end_ids={0}, batch_size=64))
    assert sum(later[k][0] != whole[k][0] for k in whole) > 12
    assert sum(whole[(i, 0)][0] != whole[(i, 1)][0] for i in idx) >= 5


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_training_forward_logps_equal_sampling_logps(model, prompts, temperature):
    s = Sampling(n=2, temperature=temperature, max_new_tokens=8)
    r = rollout(model, prompts, list(range(len(prompts))), s, seed=0, step=0, end_ids=set(), batch_size=5)
    batch = sequences(r)
    logps = response_logps(model, batch, temperature)
    assert logprob_diff(r, logps, batch) < 1e-4  # fp32: the same numbers up to rounding
    # the batch: each response token is a target at the position before it, prompts never
    for k in range(len(r)):
        p, resp = r.prompt_ids[k], r.response_ids[k]
        t = batch["targets"][k]
        assert t[len(p) - 1 : len(p) - 1 + len(resp)].tolist() == resp
        assert (t[: len(p) - 1] == -100).all() and (t[len(p) - 1 + len(resp) :] == -100).all()
    if temperature == 0:  # greedy: the same response for every sample of a prompt
        assert all(r.response_ids[2 * i] == r.response_ids[2 * i + 1] for i in range(len(prompts)))


def test_end_tokens_stop_strings_and_the_cap(model, prompts):
    s = Sampling(n=4, temperature=1.5, max_new_tokens=6)
    ends = set(range(0, 64, 4))  # a quarter of the vocabulary ends a response
    r = rollout(model, prompts, list(range(len(prompts))), s, seed=1, step=0, end_ids=ends)
    for ids, fin in zip(r.response_ids, r.finished, strict=True):
        assert 1 <= len(ids) <= 6
        assert fin == (ids[-1] in ends) and not any(t in ends for t in ids[:-1])
    assert any(r.finished) and not all(r.finished)
    # a stop string: the row ends once its decoded text holds it
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    s = Sampling(n=2, temperature=1.0, max_new_tokens=30, stop=("3",))
    r = rollout(model, prompts, list(range(len(prompts))), s, seed=1, step=0, end_ids=set(), decode=decode)
    for ids, fin in zip(r.response_ids, r.finished, strict=True):
        assert fin == ("3" in decode(ids)) and "3" not in decode(ids[:-1])


def test_balance_spreads_costs():
    costs = [9, 7, 6, 5, 4, 3, 1]
    parts = balance(costs, 2)
    assert sorted(i for p in parts for i in p) == list(range(7))
    loads = [sum(costs[i] for i in p) for p in parts]
    best = min(
        max(
            sum(c for c, m in zip(costs, mask, strict=True) if m),
            sum(c for c, m in zip(costs, mask, strict=True) if not m),
        )
        for mask in itertools.product([0, 1], repeat=7)
    )
    assert max(loads) <= best * 4 / 3 and max(loads) == 18 == best
    assert imbalance(loads) == pytest.approx(18 / 17.5)
    assert balance([5], 3) == [[0], [], []] and imbalance([0, 0]) == 1.0


def test_balance_keeps_the_rows_a_rank_holds_and_prompts_are_dealt_by_expected_work(monkeypatch):
    # per_rank: the costliest first, each to the least loaded rank with room (by hand below)
    # 10 -> rank 0, then the 1s to rank 1 until it holds 2 rows; unbounded, rank 1 takes all three
    assert balance([10, 1, 1, 1], 2, per_rank=2) == [[0, 3], [1, 2]]
    assert balance([10, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    # Dealt: rank 0 read prompts of 6 and 5 tokens, rank 1 of 2 and 1; with 2 samples and 3
    # expected response tokens each costs 2 x (len + 3): 18, 16, 10, 8 -> rank 0 takes 18 and 8,
    # rank 1 16 and 10, each in one microbatch of 2 as it read them
    from types import SimpleNamespace

    from ladle.rl import loader as L

    def micro(lens, first):
        prompt = torch.zeros(len(lens), 8, dtype=torch.long)
        for i, n in enumerate(lens):
            prompt[i, 8 - n :] = first + i + 1
        return [
            {
                "prompt": prompt,
                "prompt_len": torch.tensor(lens),
                "index": torch.arange(first, first + len(lens)),
            }
        ]

    reads = {0: micro([6, 5], 0), 1: micro([2, 1], 2)}
    monkeypatch.setattr(L.dist, "all_gather_objects", lambda obj, group=None: [
        [{k: v[i] for k, v in reads[r][0].items()} for i in range(2)] for r in (0, 1)
    ])  # fmt: skip
    monkeypatch.setattr(L.dist, "world_size", lambda group=None: 2)
    for rank, want in ((0, [0, 3]), (1, [1, 2])):
        monkeypatch.setattr(L.dist, "rank", lambda group=None, r=rank: r)
        inner = SimpleNamespace(next=lambda r=rank: reads[r], consumed_samples=0, data_s=0.25)
        got = L.Dealt(inner, group=None, samples=2, expected=lambda: 3.0).next()
        assert len(got) == 1 and got[0]["index"].tolist() == want
        assert got[0]["prompt_len"].tolist() == [[6, 5, 2, 1][i] for i in want]
        assert got[0]["prompt"][:, -1].tolist() == [i + 1 for i in want]  # each row whole
        assert L.Dealt(inner, group=None, samples=2, expected=lambda: 3.0).data_s == 0.25


def test_fsdp_rollouts_equal_one_process():
    script = Path(__file__).parent / "dist_rollout.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("FSDP rollouts equal one process's") == 2
