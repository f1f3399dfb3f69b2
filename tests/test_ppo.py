"""PPO's mathematics against plain loops and formulas written out here."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from ladle.rl.algorithms import (
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


def test_gae_and_token_rewards_after_a_prompt_equal_the_responses_alone():
    # In a training row the response follows its prompt: the same response shifted right by a
    # prompt of 3 gives the same rewards, advantages and returns, shifted.
    r, v, mask = batch(3)
    scores, kl = torch.tensor([1.0, -1.0, 0.5, 2.0]), r.abs()
    shift = lambda x: torch.cat([torch.zeros(4, 3, dtype=x.dtype), x], 1)  # noqa: E731
    want = token_rewards(scores, kl, mask, 0.1)
    got = token_rewards(scores, shift(kl), shift(mask), 0.1)
    assert torch.equal(got, shift(want))
    adv, ret = gae(want, v, mask, 0.9, 0.8)
    adv2, ret2 = gae(got, shift(v), shift(mask), 0.9, 0.8)
    assert torch.allclose(adv2, shift(adv)) and torch.allclose(ret2, shift(ret))


def test_value_loss_object_sums_and_explained_variance():
    from ladle.rl.losses import ValueLoss

    g = torch.Generator().manual_seed(4)
    R, T = 3, 6
    targets = torch.full((R, T), -100)
    targets[0, 2:5], targets[1, 1:6], targets[2, 3:4] = 1, 1, 1
    mask = targets != -100
    out = torch.randn(R, T, 1, generator=g)
    b = {
        "targets": targets,
        "returns": torch.randn(R, T, generator=g) * mask,
        "old_values": torch.randn(R, T, generator=g) * mask,
        "lengths": torch.tensor([5, 6, 4]),
    }
    loss = ValueLoss(clip=0.3)
    got = loss.from_output(out, b)
    per = value_loss(out[..., 0], b["old_values"], b["returns"], 0.3)
    assert got.sum.item() == pytest.approx(per[mask].sum().item(), rel=1e-6)
    assert int(got.count) == loss.count(b) == int(mask.sum())
    summary = loss.summarize({k: float(v) for k, v in got.metrics.items()}, loss.count(b), 1)
    want = explained_variance(out[..., 0], b["returns"], mask)
    assert summary["explained_variance"] == pytest.approx(want, rel=1e-5)
    assert summary["value_mean"] == pytest.approx(out[..., 0][mask].mean().item(), rel=1e-5)


# -- the recipe ---------------------------------------------------------------------------------
from test_grpo import grpo_config  # noqa: E402  (the GRPO tests' config)


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory):
    """A random reward model (score head) of the tests' tiny shape, as a Hugging Face folder."""
    from ladle.config.schema import ModelConfig
    from ladle.models.hf import save_hf
    from ladle.models.llama import Llama

    cfg = ModelConfig(
        vocab_size=640, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64, head="score"
    )
    torch.manual_seed(11)
    model = Llama(cfg)
    out = tmp_path_factory.mktemp("rm") / "hf"
    save_hf(model.state_dict(), cfg, out, pad_id=0)
    return out


def ppo_config(chat_tokenizer, data, out, rm=None, **ppo) -> dict:
    cfg = grpo_config(chat_tokenizer, data, out)
    del cfg["grpo"]
    cfg["ppo"] = {"num_samples": 2, "max_response_len": 8, "kl_coef": 0.05, "critic_lr": 1e-3, **ppo}
    if rm is not None:
        cfg["rewards"]["model"] = str(rm)
        cfg["rewards"]["model_weight"] = 0.5
    return cfg


def test_ppo_runs_actor_and_critic_with_the_metrics_by_name(
    chat_tokenizer, prompt_data, reward_folder, tmp_path
):
    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    cfg = ppo_config(
        chat_tokenizer, prompt_data, tmp_path / "run", reward_folder, ppo_epochs=2, kl_estimator="k3"
    )
    assert load("ppo").run(build_config(cfg)) == "completed"
    recs = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(recs) == 4
    for key in (
        "reward_mean",
        "reward_exact_mean",
        "reward_model_mean",
        "response_len_mean",
        "kl",
        "clip_fraction",
        "entropy",
        "value_loss",
        "explained_variance",
        "value_mean",
        "critic_grad_norm",
        "rollout_logprob_diff",
        "rollout_imbalance",
        "rollout_tokens_per_s",
        "gen_s",
    ):
        assert all(key in r and math.isfinite(r[key]) for r in recs), key
    first = recs[0]
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # policy = reference at the first rollout
    assert first["rollout_logprob_diff"] < 1e-4 and first["clip_fraction"] == 0.0
    # whitened advantages, ratio 1: the first update's token-mean loss is -mean(A) = 0
    assert first["loss"] == pytest.approx(0.0, abs=1e-5)
    assert 0 < first["entropy"] <= math.log(640) + 1e-4
    # the reward is the rule terms plus 0.5 x the reward model's score
    terms = first["reward_exact_mean"] + 0.1 * first["reward_length_mean"] + first["reward_has_e_mean"]
    assert first["reward_mean"] == pytest.approx(terms + 0.5 * first["reward_model_mean"], abs=1e-6)
    # ppo_epochs 2: steps 1-2 train on one rollout batch; the critic learns on it
    assert recs[1]["reward_mean"] == first["reward_mean"] and recs[1]["value_loss"] < first["value_loss"]
    assert recs[2]["kl"] > 0  # k3 >= 0, and the policy has moved off the reference
    # the policy's checkpoint is a causal LM any eval or export reads; the critic sits beside it
    from ladle.ops.export import load_checkpoint_model

    model, _, _ = load_checkpoint_model(tmp_path / "run")
    assert model.cfg.head == "lm"


def test_ppo_whitening_is_over_the_whole_batch(chat_tokenizer, prompt_data, tmp_path):
    # two microbatches' advantages are whitened together: as ladle.rl.algorithms.whiten on the
    # concatenated batch (so 1 process and 2 ranks whiten alike)
    from types import SimpleNamespace

    from ladle.rl.advantages import gae_advantages

    g = torch.Generator().manual_seed(5)
    batches = []
    for rows in (2, 3):
        targets = torch.full((rows, 6), -100)
        targets[:, 2:5] = 1
        batches.append(
            {
                "targets": targets,
                "old_logps": torch.randn(rows, 6, generator=g) * (targets != -100),
                "old_values": torch.randn(rows, 6, generator=g) * (targets != -100),
                "scores": torch.randn(rows, generator=g),
            }
        )
    section = SimpleNamespace(kl_estimator="k1", kl_coef=0.1, gamma=1.0, lam=0.95, whiten_advantages=True)
    raw = []
    for b in batches:
        mask = b["targets"] != -100
        rw = token_rewards(b["scores"], torch.zeros_like(b["old_logps"]), mask, 0.1)
        raw.append(gae(rw, b["old_values"], mask, 1.0, 0.95)[0])
    gae_advantages(batches, section, group=None)
    mask = torch.cat([b["targets"] for b in batches]) != -100
    want = whiten(torch.cat(raw), mask)
    assert torch.allclose(torch.cat([b["advantages"] for b in batches]), want, atol=1e-6)


def test_running_reward_moments_merge_as_the_concatenation_and_normalise_the_scores():
    from types import SimpleNamespace

    from ladle.rl.advantages import gae_advantages
    from ladle.rl.stats import RunningMoments

    g = torch.Generator().manual_seed(3)
    chunks = [torch.randn(n, generator=g, dtype=torch.float64) * 3 + 2 for n in (5, 1, 7)]
    m = RunningMoments()
    for c in chunks:
        m.update(float(c.numel()), float(c.mean()), float(c.var()) if c.numel() > 1 else 0.0)
    every = torch.cat(chunks)
    assert (
        m.n == 13
        and m.mean == pytest.approx(float(every.mean()))
        and m.var == pytest.approx(float(every.var()))
    )
    restored = RunningMoments()
    restored.load_state_dict(m.state_dict())
    assert restored.state_dict() == m.state_dict()
    # in GAE: the scores are standardised by the moments of every score so far, this batch's
    # included (a placeholder microbatch, trained on nothing, is not counted)
    targets = torch.full((3, 5), -100)
    targets[:, 1:4] = 1
    scores = torch.tensor([1.0, 4.0, 7.0])
    live = {
        "targets": targets,
        "scores": scores.clone(),
        "old_values": torch.zeros(3, 5),
        "old_logps": torch.zeros(3, 5),
    }
    placeholder = {**live, "targets": torch.full((3, 5), -100), "scores": torch.tensor([100.0] * 3)}
    section = SimpleNamespace(kl_estimator="k1", kl_coef=0.0, gamma=1.0, lam=1.0, whiten_advantages=False)
    moments = RunningMoments()
    moments.update(2.0, 0.0, 2.0)  # two earlier scores: -1 and 1
    gae_advantages([live, placeholder], section, moments=moments)
    seen = torch.tensor([-1.0, 1.0, 1.0, 4.0, 7.0], dtype=torch.float64)
    want = (scores - seen.mean()) / (seen.var() + 1e-8) ** 0.5
    assert moments.n == 5 and torch.allclose(live["scores"], want.float())
    # zero values and lam 1: each response token's advantage is its response's normalised score
    assert torch.allclose(live["advantages"][:, 1:4], want.float()[:, None].expand(3, 3))


def test_critic_start_and_warmup(chat_tokenizer, prompt_data, reward_folder, tmp_path):
    """`value_head: zero` starts every value at 0 (`keep`: the reward model's scores); during
    `critic_warmup` the actor's weights and schedule wait while the critic learns."""
    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    runs = {}
    for name, ppo in (("zero", {"critic_warmup": 2}), ("keep", {"value_head": "keep"})):
        cfg = ppo_config(chat_tokenizer, prompt_data, tmp_path / name, reward_folder, **ppo)
        cfg["checkpoint"] = {"every": 2, "keep_last": 3}
        assert load("ppo").run(build_config(cfg)) == "completed"
        runs[name] = [r for r in read_metrics(tmp_path / name) if "loss" in r]
    zero, keep = runs["zero"], runs["keep"]
    assert zero[0]["value_mean"] == 0.0 and keep[0]["value_mean"] != 0.0
    assert [r["lr"] for r in zero] == [0.0, 0.0, 3e-3, 3e-3]  # the actor's first update at step 3
    assert zero[1]["value_loss"] < zero[0]["value_loss"] and zero[1]["critic_grad_norm"] > 0
    from ladle.ops.export import load_checkpoint_model

    def policy(run: str, step: int | None = None) -> dict:
        where = tmp_path / run if step is None else tmp_path / run / "checkpoints" / f"step_{step:08d}"
        return load_checkpoint_model(where)[0].state_dict()

    # the start: a run that stays in its warm-up (the same seed, the same initial weights)
    fresh = ppo_config(chat_tokenizer, prompt_data, tmp_path / "fresh", reward_folder, critic_warmup=4)
    fresh["train"]["max_steps"] = 1
    assert load("ppo").run(build_config(fresh)) == "completed"
    init, at2, at4 = policy("fresh"), policy("zero", 2), policy("zero", 4)
    assert all(torch.equal(at2[k], v) for k, v in init.items())
    assert any(not torch.equal(at4[k], v) for k, v in init.items())


def test_ppo_resume_equals_an_uninterrupted_run(chat_tokenizer, prompt_data, tmp_path):
    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    def run(out, ppo=None, **train):
        cfg = ppo_config(chat_tokenizer, prompt_data, out, minibatches=2, **(ppo or {}))
        cfg["train"].update({"grad_accum_steps": 2, **train})
        cfg["checkpoint"] = {"every": 2, "keep_last": 2}
        return load("ppo").run(build_config(cfg))

    assert run(tmp_path / "whole") == "completed"
    assert run(tmp_path / "cut", exit_at_step=2) == "exit"
    assert run(tmp_path / "cut", resume="auto") == "completed"
    whole = [r for r in read_metrics(tmp_path / "whole") if "loss" in r]
    cut = [r for r in read_metrics(tmp_path / "cut") if "loss" in r and r["step"] > 2]
    assert [r["step"] for r in cut] == [3, 4]
    for a, b in zip(whole[2:], cut, strict=True):  # the critic and its optimizer came back too
        for key in ("loss", "grad_norm", "value_loss", "critic_grad_norm", "kl", "reward_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key)
    # resumed with the reward normalisation turned off (the saved moments left aside), then on
    # again from a checkpoint that has none (fresh moments)
    off = {"normalize_rewards": False}
    assert run(tmp_path / "cut", ppo=off, resume="auto", max_steps=6) == "completed"
    assert run(tmp_path / "cut", resume="auto", max_steps=8) == "completed"


def test_ppo_bad_input_is_refused_by_name(chat_tokenizer, prompt_data, reward_folder, tmp_path, capsys):
    import yaml

    from ladle.cli import main

    path = tmp_path / "c.yaml"

    def refused(cfg, message):
        path.write_text(yaml.safe_dump(cfg))
        assert main(["run", "ppo", "--config", str(path)]) == 2
        assert message in capsys.readouterr().err

    refused(
        ppo_config(chat_tokenizer, prompt_data, tmp_path / "r", minibatches=3),
        "ppo.minibatches (3) must divide train.grad_accum_steps (2)",
    )
    refused(
        ppo_config(chat_tokenizer, prompt_data, tmp_path / "r", dual_clip=0.5),
        "ppo.dual_clip=0.5: must be above 1",
    )
    # a separated placement on too few ranks: how many it needs, before anything is written
    refused(
        ppo_config(chat_tokenizer, prompt_data, tmp_path / "r", placement="separated"),
        "ppo.placement=separated puts the actor and reference on one group of ranks and the critic and "
        "reward model on another: it needs a multiple of 2 ranks",
    )
    refused(
        ppo_config(chat_tokenizer, prompt_data, tmp_path / "r", placement="separated", engine="vllm"),
        "ppo.engine=vllm with ppo.placement=separated: vLLM's in-process engine joins every rank",
    )
    refused(ppo_config(chat_tokenizer, prompt_data, tmp_path / "r", critic_warmup=-1), "ppo.critic_warmup")
    assert not (tmp_path / "r").exists()
    path.write_text(
        yaml.safe_dump(ppo_config(chat_tokenizer, prompt_data, tmp_path / "r", placement="separated"))
    )
    args = ["validate", "--config", str(path), "--recipe", "ppo", "parallel.dp_shard=2"]
    assert main([*args, "--nproc", "4"]) == 0
    assert "layout for 4 processes: 2 groups of dp_shard=2 (FSDP2)" in capsys.readouterr().err
    assert main([*args, "--nproc", "2"]) == 2
    assert (
        "it needs 4 ranks, 2 groups of parallel.dp_replicate x dp_shard x tp x pp x cp = 2, but 2 were "
        in (capsys.readouterr().err)
    )
    cfg = ppo_config(chat_tokenizer, prompt_data, tmp_path / "r", critic_init=str(tmp_path / "nowhere"))
    refused(cfg, f"ppo.critic_init={tmp_path / 'nowhere'}")
    cfg = ppo_config(chat_tokenizer, prompt_data, tmp_path / "r", reward_folder)
    cfg["model"]["vocab_size"] = 700
    cfg["model"]["max_seq_len"] = 64
    refused(cfg, "a vocabulary of 640 tokens, the policy's has 700")
    cfg = ppo_config(chat_tokenizer, prompt_data, tmp_path / "r")
    cfg["rewards"] = {"terms": []}
    refused(cfg, "rewards.terms: name at least one reward (or a reward model, rewards.model")


def test_policy_loss_takes_token_advantages_dual_clip_and_an_entropy_bonus():
    from ladle.rl.algorithms import policy_loss
    from ladle.rl.losses import PolicyLoss

    g = torch.Generator().manual_seed(6)
    logps, old = -torch.rand(3, 5, generator=g) * 3, -torch.rand(3, 5, generator=g) * 3
    adv, mask = torch.randn(3, 5, generator=g) * 2, torch.ones(3, 5, dtype=torch.bool)
    got, _ = policy_loss(logps, old, adv, mask, dual_clip=3.0)
    assert torch.allclose(got, dual_clip_loss(torch.exp(logps - old), adv, dual_clip=3.0))
    # the bonus: the loss minus entropy_coef x the mean entropy, and its gradient
    logits = torch.randn(2, 4, 9, generator=g, requires_grad=True)
    targets = torch.tensor([[-100, 3, 4, -100], [-100, -100, 1, 2]])
    b = {"targets": targets, "old_logps": torch.zeros(2, 4), "advantages": torch.zeros(2)}
    out = PolicyLoss(entropy_coef=0.5).from_output(logits, b)
    m = targets != -100
    want = -0.5 * entropy(logits[m]).sum()
    assert out.sum.item() == pytest.approx(want.item(), rel=1e-5)
    (ga,) = torch.autograd.grad(out.sum, logits)
    (gb,) = torch.autograd.grad(want, logits)
    assert torch.allclose(ga, gb, atol=1e-6)


@pytest.fixture(scope="module")
def prompt_data_val(chat_tokenizer, prompt_data):
    from ladle.data.prompts import prepare_prompts

    out = prompt_data.parent / "with_val"
    prepare_prompts(
        [prompt_data.parent / "p.jsonl"],
        tokenizer=chat_tokenizer,
        output=out,
        val_fraction=0.3,
        progress=False,
    )
    return out


@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_validation_is_the_rewards_on_held_out_prompts(chat_tokenizer, prompt_data_val, tmp_path, recipe):
    from ladle.config.load import build_config
    from ladle.data.prompts import PromptSplit
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    def run(out, lr):
        cfg = ppo_config(chat_tokenizer, prompt_data_val, out)
        if recipe == "grpo":
            cfg["grpo"] = {"num_samples": 2, "max_response_len": 8}
            del cfg["ppo"]
        cfg["optim"]["lr"] = lr
        cfg["train"].update({"eval_every": 2, "eval_steps": 2, "eval_at_start": True})
        assert load(recipe).run(build_config(cfg)) == "completed"
        return [r for r in read_metrics(out) if "val_reward_mean" in r]

    val = PromptSplit(prompt_data_val, "val")
    assert len(val) >= 4  # the two validation batches of 2 prompts are held-out ones
    frozen = run(tmp_path / "frozen", 1e-12)
    assert [r["step"] for r in frozen] == [0, 2, 4]
    for r in frozen:  # the same weights and the same random streams: the same responses
        for key in ("val_reward_mean", "val_reward_has_e_mean", "val_response_len_mean"):
            assert r[key] == frozen[0][key], key
        assert r["val_reward_mean"] == pytest.approx(
            r["val_reward_exact_mean"] + 0.1 * r["val_reward_length_mean"] + r["val_reward_has_e_mean"]
        )
    moved = run(tmp_path / "moved", 3e-3 if recipe == "grpo" else 1e-2)  # a move validation shows
    assert moved[0] == {**frozen[0], "eval_s": moved[0]["eval_s"]}
    assert moved[-1]["val_response_len_mean"] != frozen[-1]["val_response_len_mean"] or (
        moved[-1]["val_reward_mean"] != frozen[-1]["val_reward_mean"]
    )


@pytest.mark.slow
def test_ppo_under_fsdp_equals_one_process(chat_tokenizer, prompt_data, reward_folder, tmp_path):
    from conftest import one_and_two_ranks

    # one process accumulates 2 microbatches, two FSDP ranks take one each: the same rollouts,
    # values, whitening (over both ranks) and updates of actor and critic
    cfg = ppo_config(chat_tokenizer, prompt_data, tmp_path / "one", reward_folder, ppo_epochs=2)
    one, par = one_and_two_ranks("ppo", cfg, tmp_path)
    assert len(par) == len(one) == 4
    for a, b in zip(one, par, strict=True):
        for key in ("reward_mean", "reward_model_mean", "response_len_mean"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), key
        for key in ("loss", "value_loss", "kl", "explained_variance"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        for key in ("grad_norm", "critic_grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), key


def test_shared_placement_parks_the_idle_models(
    chat_tokenizer, prompt_data, reward_folder, tmp_path, monkeypatch
):
    # where each model is at each phase (on a CPU run nothing moves, the bookkeeping is the same):
    # while the policy generates, the reference, reward model and critic wait in host memory;
    # the critic is back on the device for the training step, the reference and reward model not
    import ladle.recipes.rl as rl_recipe
    import ladle.rl.engine as engine
    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.rl import roles
    from ladle.rl.losses import ValueLoss

    seen, parkings = [], []

    class Recording(roles.Parking):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            parkings.append(self)

    def recording_rollout(*a, **kw):
        seen.append(("generate", dict(parkings[-1].where)))
        return real_rollout(*a, **kw)

    real_rollout = engine.rollout
    monkeypatch.setattr(rl_recipe, "Parking", Recording)
    monkeypatch.setattr(engine, "rollout", recording_rollout)
    real_step = ValueLoss.from_output

    def recording_value(self, out, batch):
        seen.append(("train", dict(parkings[-1].where)))
        return real_step(self, out, batch)

    monkeypatch.setattr(ValueLoss, "from_output", recording_value)
    cfg = ppo_config(chat_tokenizer, prompt_data, tmp_path / "run", reward_folder)
    cfg["train"]["max_steps"] = 2
    assert load("ppo").run(build_config(cfg)) == "completed"
    host = {"reference": "host", "reward": "host", "critic": "host"}
    generate = [w for phase, w in seen if phase == "generate"]
    train = [w for phase, w in seen if phase == "train"]
    assert len(generate) == len(train) == 4  # 2 steps x 2 microbatches
    assert generate == [host] * 4 and train == [{**host, "critic": "device"}] * 4
    assert not parkings[-1].enabled  # a CPU run: the host is the device


def test_ppo_token_budget_passes_keep_the_update(chat_tokenizer, prompt_data, tmp_path):
    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    def run(out, **ppo):
        cfg = ppo_config(chat_tokenizer, prompt_data, out, **ppo)
        cfg["train"]["max_steps"] = 2
        assert load("ppo").run(build_config(cfg)) == "completed"
        return [r for r in read_metrics(out) if "loss" in r]

    plain, budget = run(tmp_path / "plain"), run(tmp_path / "budget", micro_tokens=60)
    for a, b in zip(plain, budget, strict=True):
        for key in ("loss", "value_loss", "grad_norm", "critic_grad_norm", "reward_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    # with minibatches, each minibatch's share of the groups is cut into passes of its own
    recs = run(tmp_path / "mini", micro_tokens=60, minibatches=2)
    assert len(recs) == 2 and all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in recs)


def test_separated_placement_gives_the_shared_updates_and_resumes(
    chat_tokenizer, prompt_data, reward_folder, tmp_path
):
    # the actor and reference on rank 0, the critic and reward model on rank 1 (the rows, values,
    # scores and the critic's record cross between them): every step equals the run with all
    # models in one process, and a run cut at step 2 and resumed (the checkpoint holds the
    # actor's part from rank 0 and the critic's from rank 1) equals the uninterrupted one
    import subprocess
    import sys

    import yaml

    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    cfg = ppo_config(chat_tokenizer, prompt_data, tmp_path / "shared", reward_folder, ppo_epochs=2)
    cfg["train"].update({"threads": 1})
    cfg["checkpoint"] = {"every": 2, "keep_last": 2}
    assert load("ppo").run(build_config(cfg)) == "completed"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))

    def separated(out, *extra):
        cmd = [sys.executable, "-m", "ladle", "run", "ppo", "--config", str(path)]
        nproc = [] if "--nproc" in extra else ["--nproc", "2"]
        over = [*nproc, f"output_dir={tmp_path / out}", "ppo.placement=separated", *extra]
        r = subprocess.run([*cmd, *over], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return [r for r in read_metrics(tmp_path / out) if "loss" in r]

    shared = [r for r in read_metrics(tmp_path / "shared") if "loss" in r]
    sep = separated("sep")
    assert len(sep) == len(shared) == 4
    for a, b in zip(shared, sep, strict=True):
        for key in ("reward_mean", "reward_model_mean", "response_len_mean", "rollout_logprob_diff"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), (a["step"], key)
        for key in ("loss", "value_loss", "kl", "explained_variance", "grad_norm", "critic_grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
    # two FSDP ranks a group: each group's collectives stay within it, the pairs line up
    for a, b in zip(shared, separated("sep4", "--nproc", "4", "train.grad_accum_steps=1"), strict=True):
        for key in ("loss", "value_loss", "kl", "grad_norm", "critic_grad_norm", "reward_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    separated("cut", "train.exit_at_step=2")
    cut = separated("cut", "train.resume=auto")
    cut = [r for r in cut if r["step"] > 2]
    assert [r["step"] for r in cut] == [3, 4]
    for a, b in zip(sep[2:], cut, strict=True):  # the critic, its optimizer and schedule came back
        for key in ("loss", "grad_norm", "value_loss", "critic_grad_norm", "kl", "reward_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key)


@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_rollouts_under_tensor_parallel_equal_one_process(
    recipe, chat_tokenizer, prompt_data, reward_folder, tmp_path
):
    # tp=2: generation on the TP-sharded policy (each forward a multiple of 2 positions for the
    # sequence shards, a KV cache of the rank's heads, the last position's vocabulary shards
    # gathered), log-probs, entropy, values and reward-model scores at every position: the first
    # step's responses, rewards, losses and gradient norms are one process's. Later steps sample
    # from weights that differ in the last bits (TP sums in another order, and Adam's first step
    # moves a weight by lr whatever its gradient's size), which a near-uniform tiny policy turns
    # into other tokens; at every step the sampler's log-probs equal the training forward's.
    import subprocess
    import sys

    import yaml

    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    if recipe == "ppo":
        cfg = ppo_config(chat_tokenizer, prompt_data, tmp_path / "one", reward_folder)
    else:
        cfg = grpo_config(chat_tokenizer, prompt_data, tmp_path / "one", kl_coef=0.05, entropy_coef=0.01)
    cfg["train"].update({"threads": 1, "max_steps": 3})
    assert load(recipe).run(build_config(cfg)) == "completed"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "ladle", "run", recipe, "--config", str(path), "--nproc", "2"]
    r = subprocess.run(
        [*cmd, f"output_dir={tmp_path / 'tp'}", "parallel.tp=2"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    one, tp = ([r for r in read_metrics(tmp_path / d) if "loss" in r] for d in ("one", "tp"))
    assert len(tp) == len(one) == 3
    keys = ["loss", "kl", "entropy", "grad_norm"] + (
        ["value_loss", "critic_grad_norm"] if recipe == "ppo" else []
    )
    a, b = one[0], tp[0]
    for key in ("reward_mean", "response_len_mean"):
        assert b[key] == pytest.approx(a[key], abs=1e-6), key
    for key in keys:
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert all(r["rollout_logprob_diff"] < 1e-4 and math.isfinite(r["loss"]) for r in tp)
