"""On-policy distillation (`ladle run distill`): the divergences against trl's generalised JSD
(GKD) and a hand computation, zero (and no gradient) when the student is the teacher, the
recipe on the tiny model moving toward its teacher, and a teacher of another tokenizer refused."""

from __future__ import annotations

import math

import pytest
import torch

from ladle.rl.algorithms import divergence
from ladle.rl.losses import DistillLoss
from ladle.train.loss import IGNORE_INDEX


def test_divergences_by_hand():
    s, t = (
        torch.tensor([[0.0, math.log(3.0)]]),
        torch.tensor([[0.0, 0.0]]),
    )  # p_s = (1/4, 3/4), p_t = (1/2, 1/2)
    ps, pt = [0.25, 0.75], [0.5, 0.5]
    rev = sum(a * math.log(a / b) for a, b in zip(ps, pt, strict=True))
    fwd = sum(b * math.log(b / a) for a, b in zip(ps, pt, strict=True))
    beta = 0.3
    pm = [beta * b + (1 - beta) * a for a, b in zip(ps, pt, strict=True)]
    jsd = beta * sum(b * math.log(b / m) for b, m in zip(pt, pm, strict=True)) + (1 - beta) * sum(
        a * math.log(a / m) for a, m in zip(ps, pm, strict=True)
    )
    assert divergence(s, t, "reverse_kl").item() == pytest.approx(rev, abs=1e-6)
    assert divergence(s, t, "forward_kl").item() == pytest.approx(fwd, abs=1e-6)
    assert divergence(s, t, "jsd", beta).item() == pytest.approx(jsd, abs=1e-6)
    with pytest.raises(ValueError, match="distill.loss 'kl': choose one of reverse_kl, forward_kl, jsd"):
        divergence(s, t, "kl")


@pytest.mark.parametrize("kind, beta", [("forward_kl", 0.0), ("reverse_kl", 1.0), ("jsd", 0.3), ("jsd", 0.5)])
def test_divergences_equal_trls_generalized_jsd(kind, beta):
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    torch.manual_seed(0)
    s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :2] = IGNORE_INDEX
    mask = labels != IGNORE_INDEX
    want = GKDTrainer.generalized_jsd_loss(s, t, labels, beta=beta, temperature=0.7, reduction="sum")
    got = divergence(s[mask] / 0.7, t[mask] / 0.7, kind, beta if kind == "jsd" else 0.5).sum()
    assert got.item() == pytest.approx(want.item(), rel=1e-5)


def tiny(seed: int):
    from ladle.config.schema import ModelConfig
    from ladle.models.llama import build_model

    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
    return build_model(cfg)


@pytest.mark.parametrize("kind", ["reverse_kl", "forward_kl", "jsd"])
def test_the_loss_is_zero_without_gradient_when_the_student_is_the_teacher(kind):
    model, other = tiny(0), tiny(1)
    tokens = torch.randint(0, 64, (3, 12))
    targets = torch.full_like(tokens, IGNORE_INDEX)
    targets[:, 5:11] = tokens[:, 6:12]
    batch = {"tokens": tokens, "targets": targets, "lengths": torch.tensor([12, 12, 12])}
    same = DistillLoss(model, kind=kind)(model, batch)
    same.sum.backward()
    assert same.sum.item() == pytest.approx(0.0, abs=1e-6) and int(same.count) == 18
    assert float(same.metrics["teacher_kl"]) == pytest.approx(0.0, abs=1e-6)
    assert max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None) < 1e-6
    model.zero_grad()
    apart = DistillLoss(other, kind=kind)(model, batch)
    apart.sum.backward()
    assert apart.sum.item() > 1e-3 and float(apart.metrics["teacher_kl"]) > 1e-3
    assert max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None) > 1e-4


def test_a_reward_joins_as_reinforce_on_the_sampled_tokens():
    model = tiny(0)
    tokens = torch.randint(0, 64, (2, 8))
    targets = torch.full_like(tokens, IGNORE_INDEX)
    targets[:, 3:7] = tokens[:, 4:8]
    batch = {
        "tokens": tokens,
        "targets": targets,
        "lengths": torch.tensor([8, 8]),
        "advantages": torch.tensor([1.0, -0.5]),
    }
    out = DistillLoss(model, reward_weight=2.0)(model, batch)  # the teacher is the student: KL 0
    from ladle.train.loss import token_logps

    mask = targets != IGNORE_INDEX
    with torch.no_grad():
        lp = token_logps(model(tokens)[mask], targets[mask]).view(2, 4)
    want = -2.0 * (lp[0].sum() * 1.0 + lp[1].sum() * -0.5)
    assert out.sum.item() == pytest.approx(want.item(), rel=1e-5)


# -- the recipe ------------------------------------------------------------------------------------
def distill_config(chat_tokenizer, prompt_data, tmp_path, teacher, **distill) -> dict:
    from test_grpo import grpo_config

    cfg = grpo_config(chat_tokenizer, prompt_data, tmp_path / "run")
    del cfg["grpo"]
    cfg["distill"] = {"teacher": str(teacher), "num_samples": 2, "max_response_len": 8, **distill}
    cfg["optim"]["lr"] = 3e-2
    cfg["train"]["max_steps"] = 30
    return cfg


@pytest.fixture(scope="module")
def teacher(chat_tokenizer, tmp_path_factory):
    """A tiny model of the test tokenizer, saved as a Hugging Face folder: wider than the student."""
    from ladle.config.schema import ModelConfig
    from ladle.data.tokenizer import load_tokenizer
    from ladle.models.hf import save_hf
    from ladle.models.llama import build_model

    torch.manual_seed(5)
    cfg = ModelConfig(vocab_size=640, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=64)
    model = build_model(cfg)
    with torch.no_grad():  # a peaked teacher: far from the student's near-uniform start
        model.norm.weight.mul_(10)  # the logits 10 times larger
    tok = load_tokenizer(chat_tokenizer)
    out = tmp_path_factory.mktemp("teacher") / "hf"
    save_hf(model.state_dict(), cfg, out, tokenizer_dir=chat_tokenizer, eos_id=tok.eos_id, pad_id=tok.pad_id)
    return out


def test_distill_moves_the_student_toward_its_teacher(chat_tokenizer, prompt_data, tmp_path, teacher):
    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    cfg = distill_config(chat_tokenizer, prompt_data, tmp_path, teacher)
    assert load("distill").run(build_config(cfg)) == "completed"
    recs = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(recs) == 30
    kl = [r["teacher_kl"] for r in recs]
    # the student's own samples, scored ever closer to the teacher's distribution
    assert kl[0] > 0.5 and sum(kl[-5:]) < 0.9 * sum(kl[:5]), kl
    assert all(r["rollout_logprob_diff"] < 1e-4 for r in recs)  # fp32: the sampler's log-probs
    assert all("reward_mean" in r for r in recs)  # the rewards logged though not trained on
    events = (tmp_path / "run" / "events.log").read_text()
    assert "teacher: " + str(teacher) + " (48 wide, 2 layers; the same tokenizer)" in events


def test_a_teacher_of_another_tokenizer_or_none_is_refused(
    chat_tokenizer, prompt_data, tmp_path, teacher, capsys
):
    import json
    import shutil

    import yaml

    from ladle.cli import main

    other = tmp_path / "other"
    shutil.copytree(teacher, other)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids
    (other / "tokenizer.json").write_text(json.dumps(tj))
    path = tmp_path / "c.yaml"

    def refused(message: str, **kw) -> None:
        cfg = distill_config(chat_tokenizer, prompt_data, tmp_path, **kw)
        cfg["output_dir"] = str(tmp_path / "never")
        path.write_text(yaml.safe_dump(cfg))
        assert main(["run", "distill", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert message in err, err

    refused(f"distill.teacher={other}: its tokenizer ({other}) differs from the student's", teacher=other)
    refused("is id", teacher=other)
    refused("distill.teacher: name the teacher", teacher="")
    refused(f"distill.teacher={tmp_path / 'gone'}", teacher=tmp_path / "gone")
    refused("distill.reward_weight=1.0 compares each reward with its prompt group's mean", teacher=teacher,
            num_samples=1, reward_weight=1.0)  # fmt: skip
    assert not (tmp_path / "never").exists()
