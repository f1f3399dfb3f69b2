"""GRPO's mathematics: advantages and KL estimators against their formulas written out here, the
clipped loss and its aggregations against trl's GRPO loss on the same tensors, and the loss
object on a model's rollouts."""

from __future__ import annotations

import math
import statistics
import sys
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from ladle.rl.algorithms import advantages, aggregate, entropy, kl_penalty, policy_loss
from ladle.rl.losses import PolicyLoss

REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 1.0, 1.0, 1.0, 0.0, 0.25, 0.75, 0.0]  # 3 prompts x 4 samples


def groups(g=4):
    return [REWARDS[i : i + g] for i in range(0, len(REWARDS), g)]


def test_grpo_and_rloo_advantages_by_hand():
    r = torch.tensor(REWARDS)
    want = []
    for grp in groups():
        m, s = statistics.fmean(grp), statistics.stdev(grp)
        want += [(x - m) / (s + 1e-4) for x in grp]
    assert advantages(r, 4).tolist() == pytest.approx(want, abs=1e-6)
    # a group whose rewards are all equal has advantage 0 (no signal), not a division by 0
    same = advantages(torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]), 4)
    assert same[:4].abs().max() == 0 and same[4:].abs().min() > 0.5
    s_all = statistics.stdev(REWARDS)
    want = [(x - statistics.fmean(g)) / (s_all + 1e-4) for g in groups() for x in g]
    assert advantages(r, 4, scale="batch").tolist() == pytest.approx(want, abs=1e-6)
    want = [x - statistics.fmean(g) for g in groups() for x in g]
    assert advantages(r, 4, scale="none").tolist() == pytest.approx(want, abs=1e-6)
    # RLOO: each sample against the mean of the *other* samples of its prompt
    want = [g[i] - statistics.fmean(g[:i] + g[i + 1 :]) for g in groups() for i in range(4)]
    assert advantages(r, 4, "rloo", scale="none").tolist() == pytest.approx(want, abs=1e-6)
    # REINFORCE++ with baseline: group mean subtracted, then whitened over the batch
    centred = [x - statistics.fmean(g) for g in groups() for x in g]
    m, s = statistics.fmean(centred), statistics.stdev(centred)
    want = [(x - m) / (s + 1e-4) for x in centred]
    assert advantages(r, 4, "reinforce_pp").tolist() == pytest.approx(want, abs=1e-6)
    with pytest.raises(ValueError, match="rloo needs at least 2"):
        advantages(r, 1, "rloo")
    with pytest.raises(ValueError, match="advantage 'ppo': choose one of grpo, rloo, reinforce_pp"):
        advantages(r, 4, "ppo")


def test_kl_estimators_by_formula():
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    ref = torch.tensor([-1.5, -2.0, -0.1, -1.0])
    d = [a - b for a, b in zip(logp.tolist(), ref.tolist(), strict=True)]
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx(d)
    assert kl_penalty(logp, ref, "k2").tolist() == pytest.approx([x * x / 2 for x in d])
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx([math.exp(-x) - 1 + x for x in d])
    assert (kl_penalty(logp, ref, "k3") >= 0).all() and kl_penalty(logp, logp, "k3").abs().max() == 0
    # unbiased: under the policy, E[k1] = E[k3] = KL(p || q), by enumeration of a small distribution
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    kl = float((p * (p / q).log()).sum())
    for est in ("k1", "k3"):
        assert float((p * kl_penalty(p.log(), q.log(), est)).sum()) == pytest.approx(kl, rel=1e-6)


# -- against trl ------------------------------------------------------------------------------
def trl_loss(logp, old, ref, adv, mask, *, loss_type, level, beta, eps_low, eps_high, max_len):
    from trl import GRPOTrainer

    t = object.__new__(GRPOTrainer)
    t.model = SimpleNamespace(training=True)
    t.accelerator = SimpleNamespace(
        gather=lambda x: x,
        gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction="sum": x,
        num_processes=1,
        sync_gradients=True,
    )
    t.top_entropy_quantile, t.off_policy_mask_threshold = 1.0, None
    t.importance_sampling_level, t.beta, t.loss_type = level, beta, loss_type
    t.epsilon_low, t.epsilon_high, t.max_completion_length = eps_low, eps_high, max_len
    t.use_vllm, t.vllm_importance_sampling_correction = False, False
    t.current_gradient_accumulation_steps, t.aux_loss_enabled = 1, False
    t._entropy_bonus_enabled, t._metrics = False, defaultdict(lambda: defaultdict(list))
    t.args = SimpleNamespace(use_bias_correction_kl=False, delta=None)
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)
    R, T = logp.shape
    inputs = {
        "prompt_ids": torch.zeros(R, 1, dtype=torch.long),
        "prompt_mask": torch.ones(R, 1, dtype=torch.long),
        "completion_ids": torch.zeros(R, T, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    return t._compute_loss(None, inputs)


CASES = {
    "grpo": ("seq-mean-token-mean", "grpo", "token"),
    "bnpo / dapo": ("token-mean", "bnpo", "token"),
    "dr_grpo": ("seq-mean-token-sum-norm", "dr_grpo", "token"),
    "gspo": ("seq-mean-token-mean", "grpo", "sequence"),
}


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradient_equal_trl(case, beta):
    agg, loss_type, level = CASES[case]
    g = torch.Generator().manual_seed(0)
    R, T = 6, 9
    base = -torch.rand(R, T, generator=g) * 3
    old = base + 0.3 * torch.randn(R, T, generator=g)  # ratios well outside [0.8, 1.28]: clipping acts
    ref = base + 0.2 * torch.randn(R, T, generator=g)
    adv = torch.randn(R, generator=g)
    lengths = torch.tensor([9, 3, 5, 1, 7, 9])
    mask = torch.arange(T)[None] < lengths[:, None]
    kw = dict(beta=beta, eps_low=0.2, eps_high=0.28, max_len=T)

    theirs_in = base.clone().requires_grad_()
    theirs = trl_loss(theirs_in, old, ref, adv, mask, loss_type=loss_type, level=level, **kw)
    theirs.backward()
    ours_in = base.clone().requires_grad_()
    per_token, metrics = policy_loss(
        ours_in, old, adv, mask, clip_low=0.2, clip_high=0.28, importance=level, kl_coef=beta, ref_logps=ref
    )
    total, count = aggregate(per_token, mask, agg, max_len=T)
    (total / count).backward()
    assert float((total / count).detach()) == pytest.approx(float(theirs.detach()), rel=1e-5, abs=1e-6)
    assert torch.allclose(ours_in.grad, theirs_in.grad, atol=1e-6, rtol=1e-5)
    clipped = float((metrics["clipped"] * mask).sum() / mask.sum())
    if level == "token":
        assert 0 < clipped < 1  # the case exercises the clip


def test_sums_and_counts_make_the_batch_loss_whatever_the_split():
    # the global loss is (sum of sums) / (sum of counts): split into microbatches, it is unchanged
    g = torch.Generator().manual_seed(1)
    loss = torch.randn(8, 5, generator=g)
    mask = torch.arange(5)[None] < torch.tensor([5, 2, 3, 1, 4, 5, 2, 3])[:, None]
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        whole = aggregate(loss, mask, mode, max_len=5)
        parts = [aggregate(loss[s : s + 3], mask[s : s + 3], mode, max_len=5) for s in (0, 3, 6)]
        assert float(sum(p[0] for p in parts) / sum(p[1] for p in parts)) == pytest.approx(
            float(whole[0] / whole[1])
        )


# -- the loss object on a model's rollouts ---------------------------------------------------
def test_policy_loss_on_rollouts_is_reinforce_at_the_first_step():
    from ladle.config.schema import ModelConfig
    from ladle.models.llama import build_model
    from ladle.rl.rollout import Sampling, response_logps, rollout, sequences

    torch.manual_seed(0)
    model = build_model(
        ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
    )
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
    r = rollout(model, prompts, [0, 1, 2], Sampling(n=4, max_new_tokens=6), seed=0, step=0, end_ids={0})
    batch = sequences(r)
    rewards = torch.tensor([float(len(x) % 2) for x in r.response_ids])
    batch["advantages"] = advantages(rewards, 4)
    with torch.no_grad():
        batch["old_logps"] = response_logps(model, batch)
    batch["ref_logps"] = batch["old_logps"].clone()
    loss = PolicyLoss(loss_agg="token-mean", kl_coef=0.1)
    out = loss(model, batch)
    mask = batch["targets"] != -100
    n = mask.sum(-1).float()
    # ratio 1, no clip, KL 0: the loss is -sum_i A_i |y_i| / sum_i |y_i|, its gradient REINFORCE's
    assert float((out.sum / out.count).detach()) == pytest.approx(
        float(-(batch["advantages"] * n).sum() / n.sum()), abs=1e-5
    )
    assert out.count == loss.count(batch) == int(n.sum())
    assert loss.tokens(batch) == sum(
        len(p) + len(x) for p, x in zip(r.prompt_ids, r.response_ids, strict=True)
    )
    assert (
        float(out.metrics["kl"]) == pytest.approx(0.0, abs=1e-6) and float(out.metrics["clip_fraction"]) == 0
    )
    (out.sum / out.count).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    lp = response_logps(model, batch)
    (-(batch["advantages"][:, None] * lp).sum() / n.sum()).backward()
    for a, p in zip(got, model.parameters(), strict=True):
        assert torch.allclose(a, p.grad, atol=1e-6)
    summary = loss.summarize({k: float(v) for k, v in out.metrics.items()}, out.count, 1)
    assert set(summary) == {"kl", "clip_fraction", "entropy", "rollout_kl"}
    assert summary["rollout_kl"] == pytest.approx(0.0, abs=1e-6)  # fp32: the sampler is the trainer
    m = batch["targets"] != -100
    logits = model(batch["tokens"]).detach()
    assert summary["entropy"] == pytest.approx(entropy(logits[m]).mean().item(), rel=1e-5)
    with pytest.raises(ValueError, match="loss_agg 'mean': choose one of token-mean"):
        PolicyLoss(loss_agg="mean")


def test_rollout_correction_weights_by_hand():
    from ladle.rl.algorithms import rollout_correction, sampler_kl

    train = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.3, -0.3, 0.0, 0.0]])
    sample = torch.tensor([[-2.0, -1.5, -0.5, 0.0], [-0.3, -1.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    e = math.e
    # token ratios: e^1, e^-0.5, 1 | 1, e^1.2; cap 2 truncates e and e^1.2
    w, hit = rollout_correction(train, sample, mask, "tis", "token", 2.0)
    assert torch.allclose(w, torch.tensor([[2.0, e**-0.5, 1.0, 0.0], [1.0, 2.0, 0.0, 0.0]]))
    assert hit.tolist() == [[True, False, False, False], [False, True, False, False]]
    # mis: inside [1/2, 2] the ratio stays (e^-0.5 = 0.61 does), outside it the token leaves
    w, hit = rollout_correction(train, sample, mask, "mis", "token", 2.0)
    assert torch.allclose(w, torch.tensor([[0.0, e**-0.5, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    assert hit.tolist() == [[True, False, False, False], [False, True, False, False]]
    # sequence: the product of the tokens' ratios, e^0.5 = 1.65 and e^1.2 = 3.32, on every token
    w, hit = rollout_correction(train, sample, mask, "tis", "sequence", 2.0)
    assert torch.allclose(w, torch.tensor([[e**0.5] * 3 + [0.0], [2.0, 2.0, 0.0, 0.0]]))
    assert hit.tolist() == [[False] * 4, [True, True, False, False]]
    w, _ = rollout_correction(train, sample, mask, "mis", "sequence", 2.0)
    assert torch.allclose(w, torch.tensor([[e**0.5] * 3 + [0.0], [0.0] * 4]))
    w, hit = rollout_correction(train, sample, mask, "none")
    assert torch.equal(w, mask.float()) and not hit.any()
    # KL(sampler || trainer), k3 with d = sample - train: exp(-d) - 1 + d
    d = sample - train
    assert torch.allclose(sampler_kl(train, sample), torch.exp(-d) - 1 + d)
    with pytest.raises(ValueError, match="rollout_correction_cap must be above 1"):
        rollout_correction(train, sample, mask, "tis", "token", 1.0)


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_policy_loss_with_rollout_correction_weights_the_surrogate(mode):
    torch.manual_seed(0)
    R, T, V, cap = 3, 5, 7, 1.5
    mask = torch.ones(R, T, dtype=torch.bool)
    mask[2, 3:] = False
    targets = torch.randint(0, V, (R, T)).masked_fill(~mask, -100)
    logits = torch.randn(int(mask.sum()), V, requires_grad=True)  # the response positions' (forward)
    logps = torch.zeros(R, T)
    logps[mask] = torch.log_softmax(logits.detach(), -1).gather(-1, targets[mask][:, None])[:, 0]
    sample = (logps + 0.5 * torch.randn(R, T)) * mask
    adv = torch.tensor([1.0, -0.5, 2.0])
    batch = {"targets": targets, "advantages": adv, "sample_logps": sample, "lengths": torch.full((R,), T)}
    out = PolicyLoss(correction=mode, correction_cap=cap).from_output(logits, batch)
    # by hand: the first update's ratio is 1, so each token's surrogate is -A, weighted by rho's
    rho = torch.exp(logps - sample)
    w = rho.clamp(max=cap) if mode == "tis" else torch.where((rho < 1 / cap) | (rho > cap), 0.0, rho)
    assert float(out.sum.detach()) == pytest.approx(float((-adv[:, None] * w * mask).sum()), abs=1e-5)
    assert out.count == int(mask.sum())  # a masked token still counts (slime's MIS)
    hit = ((rho > cap) | ((rho < 1 / cap) & (mode == "mis"))) & mask
    assert float(out.metrics["rollout_is_clipped_frac"]) == pytest.approx(float(hit.sum()))
    assert float(out.metrics["rollout_is_weight_mean"]) == pytest.approx(float((w * mask).sum()), abs=1e-5)
    assert 0 < float(hit.sum()) < mask.sum()  # the case has both kinds of token
    # without a correction the loss is the plain surrogate, and the KL is still logged
    plain = PolicyLoss().from_output(logits, batch)
    assert float(plain.sum.detach()) == pytest.approx(float((-adv[:, None] * mask).sum()), abs=1e-5)
    assert "rollout_is_weight_mean" not in plain.metrics and float(plain.metrics["rollout_kl"]) > 0


# -- the recipe -----------------------------------------------------------------------------------
def grpo_config(chat_tokenizer, data, out, **grpo) -> dict:
    from conftest import make_tiny_config

    cfg = make_tiny_config(chat_tokenizer, data, out)
    cfg["model"]["vocab_size"] = 640
    cfg["data"]["seq_len"] = 48
    cfg["train"].update({"max_steps": 4, "eval_every": 0, "eval_steps": 0, "micro_batch_size": 2})
    cfg["checkpoint"] = {"every": 0, "keep_last": 1}
    cfg["scheduler"] = {"name": "constant", "warmup_steps": 0}
    cfg["sample"] = {"prompt": ""}
    cfg["grpo"] = {"num_samples": 4, "max_response_len": 8, **grpo}
    cfg["rewards"] = {
        "terms": [
            {"name": "exact"},
            {"name": "length", "max_tokens": 8, "buffer": 4, "weight": 0.1},
            # a random policy is never exact: this term gives its responses rewards that differ
            {"name": "format", "key": "has_e", "pattern": ".*e.*"},
        ]
    }
    return cfg


def test_grpo_runs_on_its_rollouts_with_the_metrics_by_name(chat_tokenizer, prompt_data, tmp_path):
    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    cfg = grpo_config(chat_tokenizer, prompt_data, tmp_path / "run", kl_coef=0.05, num_iterations=2)
    assert load("grpo").run(build_config(cfg)) == "completed"
    recs = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(recs) == 4
    for key in (
        "reward_mean",
        "reward_exact_mean",
        "reward_length_mean",
        "reward_has_e_mean",
        "response_len_mean",
        "kl",
        "clip_fraction",
        "rollout_logprob_diff",
        "rollout_imbalance",
        "rollout_tokens_per_s",
        "gen_s",
    ):
        assert all(key in r and math.isfinite(r[key]) for r in recs), key
    first = recs[0]
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # policy = reference at the first step
    assert first["rollout_logprob_diff"] < 1e-4  # fp32: sampling and training forward agree
    assert first["clip_fraction"] == 0.0  # ratio 1 on the first iteration
    assert 1 <= first["response_len_mean"] <= 8 and first["rollout_imbalance"] == 1.0
    assert 0 < first["reward_has_e_mean"] < 1 and first["grad_norm"] > 0  # a learning signal
    # num_iterations 2: steps 1-2 train on one rollout batch, 3-4 on the next
    assert recs[0]["reward_mean"] == recs[1]["reward_mean"] and recs[1]["gen_s"] == recs[0]["gen_s"]
    assert recs[1]["kl"] > 0  # the second iteration's policy has moved off the reference


def test_dynamic_sampling_keeps_groups_with_a_signal_and_refills(chat_tokenizer, prompt_data, tmp_path):
    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    def run(out, terms, **grpo):
        cfg = grpo_config(chat_tokenizer, prompt_data, out, dynamic_sampling=True, **grpo)
        cfg["rewards"] = {"terms": terms}
        cfg["train"]["max_steps"] = 2
        assert load("grpo").run(build_config(cfg)) == "completed"
        return [r for r in read_metrics(out) if "loss" in r]

    # exact: a random policy is never right, every group ties: all rounds spent, nothing trained
    recs = run(tmp_path / "none", [{"name": "exact"}], max_sampling_rounds=3)
    for r in recs:
        assert r["sampling_rounds"] == 3 and r["groups_kept"] == 0
        assert r["loss"] == 0 and r["grad_norm"] == 0
    # whether a response holds an "e": some groups tie, some do not; the step gets 2 groups (its
    # prompts) with a signal, drawing more prompts while it lacks them
    recs = run(
        tmp_path / "some", [{"name": "format", "key": "has_e", "pattern": ".*e.*"}], max_sampling_rounds=8
    )
    for r in recs:
        assert r["groups_kept"] == 1.0 and r["sampling_rounds"] >= 1 and r["grad_norm"] > 0
        # one update per batch: the loss's forward is the sampling policy's, compared with sampling
        assert 0 <= r["rollout_logprob_diff"] < 1e-4 and r["clip_fraction"] == 0
    # masking truncated responses out of the loss: with a cap of 2 tokens nearly all are cut
    cfg = grpo_config(chat_tokenizer, prompt_data, tmp_path / "cut", max_response_len=2, mask_truncated=True)
    cfg["train"]["max_steps"] = 1
    assert load("grpo").run(build_config(cfg)) == "completed"
    (rec,) = [r for r in read_metrics(tmp_path / "cut") if "loss" in r]
    assert rec["response_len_mean"] <= 2 and math.isfinite(rec["loss"])


def test_rollout_correction_with_the_local_engine_in_fp32_changes_nothing(
    chat_tokenizer, prompt_data, tmp_path
):
    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    runs = {}
    for mode in ("none", "tis"):
        cfg = grpo_config(chat_tokenizer, prompt_data, tmp_path / mode, rollout_correction=mode)
        cfg["train"]["max_steps"] = 2
        assert load("grpo").run(build_config(cfg)) == "completed"
        runs[mode] = [r for r in read_metrics(tmp_path / mode) if "loss" in r]
    for plain, tis in zip(runs["none"], runs["tis"], strict=True):
        assert tis["loss"] == pytest.approx(plain["loss"], abs=1e-5)
        assert tis["rollout_is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert tis["rollout_is_clipped_frac"] == 0.0 and tis["rollout_kl"] < 1e-8
        assert "rollout_is_weight_mean" not in plain


def test_grpo_bad_input_is_refused_by_name(chat_tokenizer, prompt_data, tmp_path, capsys, monkeypatch):
    import yaml

    from ladle.cli import main

    path = tmp_path / "c.yaml"
    cfg = grpo_config(chat_tokenizer, prompt_data, tmp_path / "r")
    cfg["rewards"] = {"terms": [{"name": "exactt"}]}
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", "grpo", "--config", str(path)]) == 2
    assert "unknown reward 'exactt'; registered rewards are exact" in capsys.readouterr().err
    cfg = grpo_config(chat_tokenizer, prompt_data, tmp_path / "r", num_samples=1)
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", "grpo", "--config", str(path)]) == 2
    assert "grpo.num_samples=1 leaves a group of one" in capsys.readouterr().err
    cfg = grpo_config(chat_tokenizer, prompt_data, tmp_path / "r")
    cfg["rewards"] = {"terms": [{"name": "math", "field": "solution", "verify": "builtin"}]}
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", "grpo", "--config", str(path)]) == 2
    assert "prompt 0 has no field 'solution'" in capsys.readouterr().err

    def refused(message: str, **grpo) -> None:
        path.write_text(yaml.safe_dump(grpo_config(chat_tokenizer, prompt_data, tmp_path / "v", **grpo)))
        assert main(["run", "grpo", "--config", str(path)]) == 2
        assert message in capsys.readouterr().err

    refused("rollout_correction_cap", rollout_correction="tis", rollout_correction_cap=1.0)
    refused("grpo.engine_args: arguments for the vLLM engine, but grpo.engine is ladle", engine_args={"x": 1})
    monkeypatch.setitem(sys.modules, "vllm", None)  # as where the extra is not installed
    refused("grpo.engine=vllm needs vLLM, which is not installed here", engine="vllm")
    refused("pip install 'ladle[vllm]'", engine="vllm")
    assert not (tmp_path / "v").exists()  # refused before anything ran


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True], ids=["plain", "dynamic_sampling"])
def test_grpo_under_fsdp_equals_one_process(chat_tokenizer, prompt_data, tmp_path, dynamic):
    from conftest import one_and_two_ranks

    # the same global batch (4 prompts x 4 samples): one process accumulates 2 microbatches of 2
    # prompts, two FSDP ranks take one each
    # dynamic sampling: the groups kept are chosen over all ranks, in (round, prompt) order
    extra = {"dynamic_sampling": True, "max_sampling_rounds": 4} if dynamic else {}
    cfg = grpo_config(chat_tokenizer, prompt_data, tmp_path / "one", kl_coef=0.05, **extra)
    one, par = one_and_two_ranks("grpo", cfg, tmp_path)
    assert len(par) == len(one) == 4
    for a, b in zip(one, par, strict=True):
        # the same responses (a function of their key, not of the layout), so the same rewards
        same = ("reward_mean", "reward_has_e_mean", "response_len_mean")
        for key in same + (("groups_kept", "sampling_rounds") if dynamic else ()):
            assert b[key] == pytest.approx(a[key], abs=1e-9), key
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=1e-7)
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-4, abs=1e-9)
        # the 2 ranks exchanged groups after generation to even their training tokens
        assert 1.0 <= b["train_imbalance"] < 2.0 and "train_imbalance" not in a


def test_grpo_resume_equals_an_uninterrupted_run(chat_tokenizer, prompt_data, tmp_path):
    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    def run(out, **train):
        cfg = grpo_config(chat_tokenizer, prompt_data, out, kl_coef=0.05, num_iterations=2)
        cfg["checkpoint"] = {"every": 2, "keep_last": 2}
        cfg["train"].update(train)
        return load("grpo").run(build_config(cfg))

    assert run(tmp_path / "whole") == "completed"
    assert run(tmp_path / "cut", exit_at_step=2) == "exit"
    assert run(tmp_path / "cut", resume="auto") == "completed"
    whole = [r for r in read_metrics(tmp_path / "whole") if "loss" in r]
    cut = [r for r in read_metrics(tmp_path / "cut") if "loss" in r and r["step"] > 2]
    assert [r["step"] for r in cut] == [3, 4]
    for a, b in zip(whole[2:], cut, strict=True):
        for key in ("loss", "grad_norm", "kl", "reward_mean", "response_len_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key)


REAL = {  # (recipe, world, layout)
    "rl/qwen2.5-1.5b-grpo-math-1dev": ("grpo", 1, "one process"),
    "rl/qwen2.5-coder-1.5b-grpo-code-1dev": ("grpo", 1, "one process"),
    "rl/qwen3-8b-grpo-8dev": ("grpo", 8, "dp_shard=8 (FSDP2)"),
    "rl/qwen2.5-7b-ppo-16dev": ("ppo", 16, "2 groups of dp_shard=8 (FSDP2)"),  # separated placement
    "rl/qwen2.5-1.5b-distill-7b-8dev": ("distill", 8, "dp_shard=8 (FSDP2)"),
}


@pytest.mark.parametrize("name", REAL)
def test_real_model_configs_validate_for_their_world(name, capsys):
    from ladle.cli import main

    recipe, world, layout = REAL[name]
    args = ["validate", "--config", name, "--no-paths", "--nproc", str(world), "--recipe", recipe]
    assert main(args) == 0
    assert f"layout for {world} processes: {layout}\n" in capsys.readouterr().err


def test_token_budget_microbatches_change_the_passes_not_the_update(
    chat_tokenizer, prompt_data, tmp_path, monkeypatch
):
    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    rows = []
    real = PolicyLoss.forward
    monkeypatch.setattr(
        PolicyLoss, "forward", lambda self, m, b: rows.append(len(b["tokens"])) or real(self, m, b)
    )

    def run(out, **grpo):
        rows.clear()
        cfg = grpo_config(chat_tokenizer, prompt_data, out, **grpo)
        cfg["train"]["max_steps"] = 2
        assert load("grpo").run(build_config(cfg)) == "completed"
        return [r for r in read_metrics(out) if "loss" in r], list(rows)

    plain, passes = run(tmp_path / "plain")
    assert passes == [8] * 4  # 2 steps x 2 microbatches of 2 prompts x 4 samples
    # 4 rows of up to ~30 tokens a group: a budget of 150 padded tokens holds one group
    budget, passes = run(tmp_path / "budget", micro_tokens=150)
    assert passes == [4] * 8
    for a, b in zip(plain, budget, strict=True):
        assert b["reward_mean"] == a["reward_mean"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


@pytest.mark.parametrize(
    "kind,scale", [("grpo", "group"), ("grpo", "batch"), ("rloo", "batch"), ("reinforce_pp", "group")]
)
def test_batch_wide_advantages_are_over_the_global_batch(kind, scale):
    # a step's rows in two microbatches (or on two ranks) get the advantages of the whole batch
    from types import SimpleNamespace

    from ladle.rl.advantages import group_advantages

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 1.0, 0.0, 3.0, 1.0, 1.0, 0.0, 0.25])
    batches = [{"scores": rewards[:4]}, {"scores": rewards[4:]}]
    section = SimpleNamespace(num_samples=2, advantage=kind, scale=scale)
    group_advantages(batches, section, group=None)
    got = torch.cat([b["advantages"] for b in batches])
    assert torch.allclose(got, advantages(rewards, 2, kind, scale), atol=1e-6)


def test_generation_is_timed_as_gen_s_never_as_data_s():
    # the loop's data_s is the prompts' read; generating and scoring the batch is gen_s, and a
    # batch's later uses (num_iterations) neither read nor generate
    import time

    from ladle.rl.engine import RolloutEngine
    from ladle.rl.loader import RolloutLoader
    from ladle.rl.roles import Parking

    inner = SimpleNamespace(consumed_samples=0, global_batch=2, data_s=0.0)

    def read():
        inner.data_s = 0.01
        return [{"prompt": None}]

    def make(micro, step):
        time.sleep(0.05)
        loader.bounds = [0, 1]
        return [{"tokens": None}]

    inner.next = read
    loader = object.__new__(RolloutLoader)
    loader.inner, loader.reuse, loader.minibatches, loader.cached, loader.uses = inner, 2, 1, None, 0
    loader.parking, loader.trained, loader.make = Parking(torch.device("cpu")), (), make
    loader.engine = RolloutEngine()  # generates nothing ahead
    assert loader.next() == [{"tokens": None}]
    assert loader.data_s == 0.01 and loader.gen_s >= 0.05
    assert loader.next() == [{"tokens": None}]
    assert loader.data_s == 0.0 and loader.gen_s == 0.0
