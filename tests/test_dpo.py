"""Reward models and the DPO family: each loss against a computation written here and against
trl's own code on the same log-probs; the recipes end to end on tiny models."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import make_tiny_config

from ladle.cli import main
from ladle.config.load import build_config
from ladle.config.schema import DPOConfig, RewardConfig
from ladle.data.pairs import PairSamples
from ladle.data.preference import PreferenceSplit, prepare_preference
from ladle.errors import DataError
from ladle.preference.losses import DPO_METRICS, RewardLoss, dpo_losses
from ladle.train.loss import IGNORE_INDEX, token_logps
from ladle.train.metrics import read_metrics

LOSSES = ("sigmoid", "ipo", "hinge", "robust", "simpo")


# -- the losses -------------------------------------------------------------------------------
def _logps(seed=0, B=6):
    g = torch.Generator().manual_seed(seed)
    pi = -torch.rand(B, 2, generator=g) * 20
    ref = pi + torch.randn(B, 2, generator=g)
    n = torch.randint(1, 9, (B, 2), generator=g)
    return pi, ref, n


def _by_hand(loss, beta, eps, gamma, pi, ref, n):
    """The papers' formulas, pair by pair, in Python floats."""
    out = []
    for (pc, pr), (rc, rr), (nc, nr) in zip(pi.tolist(), ref.tolist(), n.tolist(), strict=True):
        h = (pc - rc) - (pr - rr)

        def ls(x):
            return -math.log1p(math.exp(-x))

        if loss == "sigmoid":
            out.append(-(1 - eps) * ls(beta * h) - eps * ls(-beta * h))
        elif loss == "robust":
            out.append((-(1 - eps) * ls(beta * h) + eps * ls(-beta * h)) / (1 - 2 * eps))
        elif loss == "hinge":
            out.append(max(0.0, 1 - beta * h))
        elif loss == "ipo":
            out.append(((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2)
        elif loss == "simpo":
            x = beta * (pc / nc - pr / nr) - gamma
            out.append(-(1 - eps) * ls(x) - eps * ls(-x))
    return out


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_each_loss_is_its_formula(loss, eps):
    pi, ref, n = _logps()
    cfg = DPOConfig(loss=loss, beta=0.3, label_smoothing=eps, simpo_gamma=0.7)
    got, rewards = dpo_losses(cfg, pi, n, None if loss == "simpo" else ref)
    want = _by_hand(loss, 0.3, eps, 0.7, pi, ref, n)
    assert got.tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
    if loss != "simpo":
        assert torch.allclose(rewards, 0.3 * (pi - ref))


def _trl_dpo(loss, beta, eps, per_token, mask, ref, rpo_alpha=0.0):
    """trl's DPOTrainer._compute_loss on given per-token log-probs: the model is a stand-in that
    returns them, the reference log-probs come precomputed, as in trl's fastest setting."""
    from trl import DPOTrainer

    t = object.__new__(DPOTrainer)
    t.model = SimpleNamespace(training=True)
    t.accelerator = SimpleNamespace(
        device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x
    )
    t.aux_loss_enabled, t.ld_alpha, t.precompute_ref_logps = False, None, True
    t.f_divergence_type, t.beta, t.label_smoothing = "reverse_kl", beta, eps
    t.loss_types, t.loss_weights = ([loss, "sft"], [1.0, rpo_alpha]) if rpo_alpha else ([loss], [1.0])
    t.use_weighting, t._metrics, t._total_train_tokens, t._tp_size = (
        False,
        defaultdict(lambda: defaultdict(list)),
        0,
        1,
    )
    t.args = SimpleNamespace()
    B2, T = per_token.shape
    outputs = SimpleNamespace(
        log_probs=per_token,
        entropy=torch.zeros(B2, T),
        mean_logits=torch.zeros(B2, T),
        is_top1=torch.zeros(B2, T, dtype=torch.bool),
    )
    inputs = {
        "input_ids": torch.zeros(B2, T + 1, dtype=torch.long),
        "attention_mask": torch.ones(B2, T + 1, dtype=torch.long),
        "completion_mask": torch.cat([torch.zeros(B2, 1, dtype=torch.long), mask.long()], 1),
        "ref_chosen_logps": ref[:, 0],
        "ref_rejected_logps": ref[:, 1],
    }
    return t._compute_loss(lambda **kw: outputs, inputs, False)


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge", "robust"])
def test_dpo_losses_equal_trl(loss):
    B, T = 5, 7
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(2 * B, T, generator=g) > 0.3
    mask[:, 0] = True
    per_token = -torch.rand(2 * B, T, generator=g) * 3 * mask  # trl's are 0 off the completion
    ref = -torch.rand(B, 2, generator=g) * 10
    eps = 0.1 if loss == "robust" else 0.0
    for alpha in (0.0, 0.5):
        want = _trl_dpo(loss, 0.2, eps, per_token, mask, ref, alpha)
        # ours: trl's batch is [chosen..., rejected...]; ours pairs them (B, 2)
        logps = torch.stack([per_token[:B].sum(1), per_token[B:].sum(1)], 1)
        n = torch.stack([mask[:B].sum(1), mask[B:].sum(1)], 1)
        cfg = DPOConfig(loss=loss, beta=0.2, label_smoothing=eps, rpo_alpha=alpha)
        got, _ = dpo_losses(cfg, logps, n, ref)
        if alpha:
            got = got + alpha * -logps[:, 0].sum() / n[:, 0].sum()
        assert float(got.mean()) == pytest.approx(float(want), rel=1e-5)


def test_simpo_equals_trl_cpo():
    from trl.experimental.cpo import CPOTrainer

    pi, _, n = _logps(2)
    avg = pi / n
    t = object.__new__(CPOTrainer)
    t.loss_type, t.beta, t.simpo_gamma, t.label_smoothing, t.alpha = "simpo", 2.0, 0.5, 0.1, 0.0
    t.accelerator = SimpleNamespace(device=torch.device("cpu"))
    want, want_c, want_r = t.cpo_loss(avg[:, 0], avg[:, 1])
    got, rewards = dpo_losses(
        DPOConfig(loss="simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.1), pi, n, None
    )
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(rewards[:, 0], want_c) and torch.allclose(rewards[:, 1], want_r)


def test_reward_loss_equals_trl():
    from trl import RewardTrainer

    g = torch.Generator().manual_seed(3)
    B, T = 4, 6
    scores = torch.randn(2 * B, T, 1, generator=g)
    ends = torch.randint(0, T, (B, 2), generator=g)
    cfg = RewardConfig(margin=0.3, center_coef=0.01)
    out = RewardLoss(cfg).from_output(scores, {"ends": ends})
    # trl: a stand-in model whose logits are each sequence's last-token score, [chosen..., rejected...]
    last = scores.squeeze(-1).gather(1, ends.reshape(-1, 1)).view(B, 2)
    t = object.__new__(RewardTrainer)
    t.model = SimpleNamespace(training=False)
    t.args = SimpleNamespace(center_rewards_coefficient=0.01)
    t.accelerator = SimpleNamespace(gather_for_metrics=lambda x: x, gather=lambda x: x)
    t._metrics, t._total_train_tokens = defaultdict(lambda: defaultdict(list)), 0
    logits = torch.cat([last[:, 0], last[:, 1]])[:, None]
    want = t.compute_loss(
        lambda **kw: SimpleNamespace(logits=logits), {"margin": torch.full((B,), 0.3), "attention_mask": None}
    )
    assert float(out.sum) / B == pytest.approx(float(want), rel=1e-6)
    assert float(out.metrics["accuracy"]) / B == pytest.approx(t._metrics["eval"]["accuracy"][0])
    assert float(out.metrics["margin"]) / B == pytest.approx(t._metrics["eval"]["margin"][0], rel=1e-6)


def test_token_logps_is_log_softmax_and_its_gradient():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5), generator=g)
    targets[0, :2] = IGNORE_INDEX
    w = torch.randn(3, 5, generator=g)
    got = token_logps(logits, targets)
    (got * w).sum().backward()
    g1 = logits.grad.clone()
    logits.grad = None
    ref = F.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    ref = ref * (targets != IGNORE_INDEX)
    (ref * w).sum().backward()
    assert torch.allclose(got, ref, atol=1e-6) and torch.allclose(g1, logits.grad, atol=1e-6)


def _pair_batch(B=5, T=40, vocab=64, seed=0):
    """B pairs of random tokens, each side of its own length (one far longer than the rest),
    padded at the end to T; completions are each side's second half."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab, (B, 2, T), generator=g)
    targets = torch.full((B, 2, T), IGNORE_INDEX)
    lengths = torch.randint(4, 17, (B, 2), generator=g)
    lengths[1, 0] = T
    for b in range(B):
        for side in range(2):
            n = int(lengths[b, side])
            tokens[b, side, n:] = 2
            targets[b, side, n // 2 : n - 1] = tokens[b, side, n // 2 + 1 : n]
    return {"tokens": tokens, "targets": targets, "ends": lengths - 1}


def test_length_buckets_score_pairs_as_one_padded_forward():
    from ladle.config.schema import ModelConfig
    from ladle.models.llama import build_model
    from ladle.preference.losses import buckets, pair_logps, pair_scores, side_logps

    batch = _pair_batch()
    ends = batch["ends"].flatten()
    groups = buckets(ends, 40, multiple=8)
    assert sorted(i for idx, _ in groups for i in idx.tolist()) == list(range(10))  # every row once
    assert len(groups) == 2  # 10 rows: groups of at least 4 rows
    assert len(buckets(torch.zeros(10, dtype=torch.long), 40)) == 2  # the count depends on the rows alone
    for idx, keep in groups:
        assert keep % 8 == 0 or keep == 40
        assert int(ends[idx].max()) < keep
    assert groups[0][1] < 40 and groups[-1][1] == 40  # the short rows do not pay for the long one
    # tokens/s and MFU count the rows' tokens, not their padding to seq_len
    from ladle.preference.losses import PairLoss

    assert PairLoss().tokens(batch) == int((ends + 1).sum()) < batch["tokens"].numel()

    torch.manual_seed(0)
    cfg = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
    model = build_model(ModelConfig(**cfg))
    logps, n = pair_logps(model, batch)
    logps.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref, ref_n = side_logps(model(batch["tokens"].flatten(0, 1)), batch["targets"])
    ref.sum().backward()
    assert torch.equal(n, ref_n) and torch.allclose(logps, ref, atol=1e-4, rtol=1e-5)
    for a, p in zip(grads, model.parameters(), strict=True):
        assert torch.allclose(a, p.grad, atol=1e-5, rtol=1e-4)

    # A reward model's scores: the final block computing only each row's last position (`at`)
    # gives the scores and gradients of scoring every position and reading the last.
    torch.manual_seed(0)
    scorer = build_model(ModelConfig(**cfg, head="score", qk_norm=True, qkv_bias=True))
    from ladle.preference.losses import last_scores

    want = last_scores(scorer(batch["tokens"].flatten(0, 1)), batch["ends"])
    want.sum().backward()
    want_grads = [p.grad.clone() for p in scorer.parameters()]
    for last_only in (True, False):
        scorer.zero_grad()
        got = pair_scores(scorer, batch, last_only=last_only)
        got.sum().backward()
        assert torch.allclose(got, want, atol=1e-5)
        for a, p in zip(want_grads, scorer.parameters(), strict=True):
            assert torch.allclose(a, p.grad, atol=1e-5, rtol=1e-4)
    tokens, ends = batch["tokens"].flatten(0, 1), batch["ends"].flatten()
    assert scorer(tokens, at=ends).shape == (10, 1, 1)
    with pytest.raises(ValueError, match="plain causal rows only"):
        scorer(tokens, doc_ids=torch.ones_like(tokens), at=ends)


# -- data and rows ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pref_data(chat_tokenizer, tmp_path_factory):
    """Pairs of a synthetic task: the correct sum against a wrong one."""
    d = tmp_path_factory.mktemp("pref")
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(160):
        a, b = (int(x) for x in rng.integers(0, 50, 2))
        wrong = a + b + int(rng.choice([-2, -1, 1, 2]))
        lines.append(json.dumps({"prompt": f"{a}+{b}=", "chosen": f"{a + b}", "rejected": f"{wrong}"}))
    (d / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    prepare_preference(
        [d / "pairs.jsonl"], tokenizer=chat_tokenizer, output=d / "data", val_fraction=0.1, progress=False
    )
    return d / "data"


def test_rows_train_on_the_completion_only(pref_data):
    split = PreferenceSplit(pref_data)
    rows = PairSamples(split, 48, pad_id=2)
    row = rows.get(0)
    c_ids, c_mask, r_ids, r_mask = split.get(0)
    for side, (ids, mask) in enumerate(((c_ids, c_mask), (r_ids, r_mask))):
        n = len(ids)
        assert row["tokens"][side, :n].tolist() == ids.tolist() and (row["tokens"][side, n:] == 2).all()
        trained = row["targets"][side] != IGNORE_INDEX
        assert trained.sum() == mask[1:].sum()  # the completion's tokens, never the prompt's
        assert row["targets"][side][trained].tolist() == ids[1:][mask[1:]].tolist()
        assert row["ends"][side] == n - 1
    with pytest.raises(DataError, match=r"longer than data.seq_len \(8 tokens.*--max-len 8"):
        PairSamples(split, 8)


# -- the recipes --------------------------------------------------------------------------------
def pair_config(chat_tokenizer, data, out, **over) -> dict:
    cfg = make_tiny_config(chat_tokenizer, data, out)
    cfg["model"]["vocab_size"] = 640
    cfg["data"]["seq_len"] = 48
    cfg["train"].update({"max_steps": 4, "eval_every": 0, "eval_steps": 2, "micro_batch_size": 4})
    cfg["checkpoint"] = {"every": 2, "keep_last": 3}
    cfg["scheduler"] = {"name": "constant", "warmup_steps": 0}
    cfg["sample"] = {"prompt": ""}
    for k, v in over.items():
        sec, key = k.split("__")
        cfg.setdefault(sec, {})[key] = v
    return cfg


def _run(recipe, cfg) -> list[dict]:
    from ladle.recipes import load

    assert load(recipe).run(build_config(cfg)) == "completed"
    return [r for r in read_metrics(cfg["output_dir"]) if "loss" in r]


@pytest.fixture(scope="module")
def sft_model(chat_tokenizer, pref_data, tmp_path_factory):
    """A policy that is not the seeded init: a few steps of SFT-like training on the pairs'
    chosen side would do; pretraining a few steps on the pairs' tokens is enough here."""
    out = tmp_path_factory.mktemp("start") / "run"
    cfg = pair_config(chat_tokenizer, pref_data, out, dpo__loss="simpo", train__max_steps=3)
    _run("dpo", cfg)
    return out


@pytest.mark.parametrize("loss,first", [("sigmoid", math.log(2)), ("hinge", 1.0), ("ipo", 1 / (4 * 0.1**2))])
def test_policy_equal_to_reference_gives_the_known_first_loss(
    chat_tokenizer, pref_data, sft_model, tmp_path, loss, first
):
    cfg = pair_config(chat_tokenizer, pref_data, tmp_path / "r", dpo__loss=loss, train__max_steps=1)
    cfg["model"] = {"init_from": str(sft_model)}
    rec = _run("dpo", cfg)[0]
    assert rec["loss"] == pytest.approx(first, rel=1e-5)
    assert rec["reward_margin"] == pytest.approx(0.0, abs=1e-5) and rec["rewards_chosen"] == pytest.approx(
        0.0, abs=1e-5
    )
    assert set(DPO_METRICS) <= set(rec)  # the names the issue gives


def test_cached_and_online_references_give_the_same_run_and_resume_equals_uninterrupted(
    chat_tokenizer, pref_data, sft_model, tmp_path
):
    runs = {}
    for ref in ("cached", "online"):
        cfg = pair_config(chat_tokenizer, pref_data, tmp_path / ref, dpo__reference=ref)
        cfg["model"] = {"init_from": str(sft_model)}
        runs[ref] = _run("dpo", cfg)
    for a, b in zip(runs["cached"], runs["online"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(
            a["grad_norm"], rel=1e-4
        )
    assert (tmp_path / "cached" / "reference" / "key.json").is_file()
    assert not (tmp_path / "online" / "reference").exists()
    assert runs["cached"][-1]["loss"] < runs["cached"][0]["loss"]  # it learns

    # Stopped after step 2, then resumed: the cache is reused, the steps are the same.
    cfg = pair_config(chat_tokenizer, pref_data, tmp_path / "resumed", train__exit_at_step=2)
    cfg["model"] = {"init_from": str(sft_model)}
    from ladle.recipes import dpo

    assert dpo.run(build_config(cfg)) == "exit"
    cfg["train"].pop("exit_at_step")
    cfg["train"]["resume"] = "auto"
    resumed = _run("dpo", cfg)
    events = (tmp_path / "resumed" / "events.log").read_text()
    assert "reference log-probs: reused" in events
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(runs["cached"], resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


def test_a_cache_of_other_data_is_refused(chat_tokenizer, pref_data, sft_model, tmp_path, capsys):
    cfg = pair_config(chat_tokenizer, pref_data, tmp_path / "r", train__max_steps=1)
    cfg["model"] = {"init_from": str(sft_model)}
    _run("dpo", cfg)
    key = tmp_path / "r" / "reference" / "key.json"
    saved = json.loads(key.read_text())
    saved["key"] = "0" * 64
    saved["identity"]["data_meta_sha256"] = "other"
    key.write_text(json.dumps(saved))
    cfg["train"]["resume"] = "auto"
    cfg["train"]["max_steps"] = 2
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", "dpo", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "reference log-probs computed from other inputs" in err and "data_meta_sha256" in err


def test_lora_reference_is_the_base_with_adapters_off(chat_tokenizer, pref_data, sft_model, tmp_path):
    from ladle.config.schema import LoRAConfig
    from ladle.models.lora import adapters_disabled, apply_lora
    from ladle.ops.export import load_checkpoint_model

    base, _, _ = load_checkpoint_model(sft_model)
    adapted, _, _ = load_checkpoint_model(sft_model)
    apply_lora(adapted, LoRAConfig(rank=4, targets=["q_proj", "v_proj", "down_proj"], dora=True), seed=1)
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if "lora_B" in n or "magnitude" in n:
                p.add_(torch.randn_like(p) * 0.1)  # trained adapters: the policy is not the base now
    tokens = torch.randint(0, 600, (3, 20))
    with torch.no_grad():
        assert not torch.allclose(adapted(tokens), base(tokens), atol=1e-4)
        with adapters_disabled(adapted):
            assert torch.allclose(adapted(tokens), base(tokens), atol=1e-6)
        assert not torch.allclose(adapted(tokens), base(tokens), atol=1e-4)  # switched on again

    # and a LoRA DPO run with the online reference: the first loss is ln 2
    cfg = pair_config(
        chat_tokenizer, pref_data, tmp_path / "lora", dpo__reference="online", train__max_steps=2
    )
    cfg["model"] = {"init_from": str(sft_model)}
    cfg["lora"] = {"rank": 4}
    rec = _run("dpo", cfg)
    assert rec[0]["loss"] == pytest.approx(math.log(2), rel=1e-5)
    assert "adapters switched off" in (tmp_path / "lora" / "events.log").read_text()


def test_reward_model_trains_evaluates_and_exports_for_transformers(
    chat_tokenizer, pref_data, sft_model, tmp_path, capsys
):
    out = tmp_path / "rm"
    cfg = pair_config(chat_tokenizer, pref_data, out, train__max_steps=6, reward__center_coef=0.01)
    cfg["model"] = {"init_from": str(sft_model)}
    cfg["train"]["eval_every"] = 3
    recs = _run("reward", cfg)
    assert {"accuracy", "margin"} <= set(recs[0])
    vals = [r for r in read_metrics(out) if "val_loss" in r]
    assert vals and "val_accuracy" in vals[-1]
    assert "score head: new" in (out / "events.log").read_text()

    capsys.readouterr()
    assert main(["eval", "--task", "reward", "--model", str(out), "--data", str(pref_data)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["pairs"] == len(PreferenceSplit(pref_data, "val")) and 0.0 <= res["accuracy"] <= 1.0

    assert main(["export", "hf", str(out), str(tmp_path / "hf")]) == 0
    from transformers import AutoModelForSequenceClassification

    from ladle.ops.export import load_checkpoint_model

    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.num_labels == 1 and hf.config.pad_token_id is not None
    ours, _, _ = load_checkpoint_model(out)
    rows = PairSamples(PreferenceSplit(pref_data, "val"), 48, pad_id=hf.config.pad_token_id)
    for i in range(3):
        row = rows.get(i)
        tokens = torch.from_numpy(row["tokens"])
        with torch.no_grad():
            want = hf(input_ids=tokens).logits.squeeze(-1)  # the last token that is not padding
            got = ours(tokens).squeeze(-1).gather(1, torch.from_numpy(row["ends"])[:, None]).squeeze(1)
        assert torch.allclose(got, want, atol=1e-4)


def test_bad_input_is_refused_by_name(chat_tokenizer, pref_data, data_dir, tokenizer_dir, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    cfg = pair_config(chat_tokenizer, pref_data, tmp_path / "r", dpo__loss="kto")
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", "dpo", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "dpo.loss" in err and "'sigmoid', 'ipo', 'hinge', 'robust' or 'simpo'" in err

    cfg = pair_config(chat_tokenizer, pref_data, tmp_path / "r", dpo__loss="simpo", dpo__reference="online")
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", "dpo", "--config", str(path)]) == 2
    assert "reference-free" in capsys.readouterr().err

    cfg = make_tiny_config(tokenizer_dir, data_dir, tmp_path / "r")  # pretraining data
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", "reward", "--config", str(path)]) == 2
    assert "trains on preference data" in capsys.readouterr().err


# -- layouts ------------------------------------------------------------------------------------
PAIR_LAYOUTS = {
    # name: (recipe, processes, overrides); global batch 4 pairs x 2 steps of accumulation
    "dpo fsdp dp_shard=2": ("dpo", 2, ["parallel.dp_shard=2", "train.micro_batch_size=2"]),
    "dpo tp=2, online reference": (
        "dpo",
        2,
        ["parallel.tp=2", "parallel.dp_shard=1", "dpo.reference=online"],
    ),
    "dpo dp_shard=2 x tp=2": ("dpo", 4, ["parallel.dp_shard=2", "parallel.tp=2", "train.micro_batch_size=2"]),
    "reward tp=2": ("reward", 2, ["parallel.tp=2", "parallel.dp_shard=1"]),  # scores every position
    "reward fsdp dp_shard=2": ("reward", 2, ["parallel.dp_shard=2", "train.micro_batch_size=2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", PAIR_LAYOUTS)
def test_pair_recipes_train_like_one_process(chat_tokenizer, pref_data, sft_model, tmp_path, name):
    import subprocess
    import sys

    recipe, nproc, overrides = PAIR_LAYOUTS[name]
    cfg = pair_config(
        chat_tokenizer, pref_data, tmp_path / "one", train__grad_accum_steps=2, train__threads=1
    )
    cfg["model"] = {"init_from": str(sft_model)}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    one = _run(recipe, cfg)
    out = tmp_path / "par"
    cmd = [sys.executable, "-m", "ladle", "run", recipe, "--config", str(path), "--nproc", str(nproc)]
    r = subprocess.run([*cmd, f"output_dir={out}", *overrides], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    par = [r for r in read_metrics(out) if "loss" in r]
    assert len(par) == len(one) == 4
    for a, b in zip(one, par, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        # A reward model's gradient flows from one position per row: its norm keeps fewer digits
        # through the TP reductions (a missing or doubled reduction is off by far more).
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4 if recipe == "dpo" else 1e-3)
        metric = "reward_accuracy" if recipe == "dpo" else "accuracy"
        assert b[metric] == pytest.approx(a[metric], abs=1e-6)
    if recipe == "dpo" and "online" not in name:  # the cache computed over the ranks equals one process's
        for split in ("train", "val"):
            np.testing.assert_allclose(
                np.load(out / "reference" / f"{split}.npy"),
                np.load(tmp_path / "one" / "reference" / f"{split}.npy"),
                atol=1e-4,
            )


def test_pp_and_cp_are_refused_for_pairs(chat_tokenizer, pref_data, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(pair_config(chat_tokenizer, pref_data, tmp_path / "r")))
    assert main(
        ["validate", "--config", str(path), "--nproc", "2", "parallel.cp=2", "parallel.dp_shard=1"]
    ) in (0, 2)
    assert (
        main(["run", "dpo", "--config", str(path), "--nproc", "2", "parallel.cp=2", "parallel.dp_shard=1"])
        == 2
    )
    assert "parallel.cp=2: the preference recipes run with" in capsys.readouterr().err


REAL = {"dpo/llama-3.1-8b-lora": 1, "dpo/qwen2.5-7b-full-8dev": 8, "reward/llama-3.2-1b": 1}


@pytest.mark.parametrize("name", REAL)
def test_real_model_configs_validate_for_their_world(name, capsys):
    assert main(["validate", "--config", name, "--no-paths", "--nproc", str(REAL[name])]) == 0
    assert f"layout for {REAL[name]} processes" in capsys.readouterr().err


def test_a_damaged_cache_is_refused_not_trusted(chat_tokenizer, pref_data, sft_model, tmp_path, capsys):
    cfg = pair_config(chat_tokenizer, pref_data, tmp_path / "r", train__max_steps=1)
    cfg["model"] = {"init_from": str(sft_model)}
    _run("dpo", cfg)
    cache = tmp_path / "r" / "reference"
    (cache / "train.npy").write_bytes((cache / "train.npy").read_bytes()[:40])  # truncated
    cfg["train"].update(resume="auto", max_steps=2)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", "dpo", "--config", str(path)]) == 2
    assert "a cached file is missing or damaged" in capsys.readouterr().err
    (cache / "key.json").write_text("{not json")
    assert main(["run", "dpo", "--config", str(path)]) == 2
    assert "key.json is damaged" in capsys.readouterr().err
