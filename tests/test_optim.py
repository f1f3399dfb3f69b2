"""Schedules against their formulas, and the weight-decay parameter groups."""

import math

import pytest
import torch

from ladle.config import ModelConfig, OptimConfig, SchedulerConfig
from ladle.models.llama import build_model
from ladle.train.optim import build_optimizer, lr_multiplier, param_groups


def sched(name, **kw):
    return SchedulerConfig(name=name, **kw)


def test_warmup_is_linear_and_starts_above_zero():
    c = sched("cosine", warmup_steps=4, min_lr_ratio=0.0)
    assert [lr_multiplier(s, c, 100) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("step", [4, 10, 37, 99])
def test_cosine_and_linear_follow_their_formulas(step):
    w, total, lo = 4, 100, 0.1
    p = (step - w) / (total - w)
    cos = lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * p))
    assert lr_multiplier(step, sched("cosine", warmup_steps=w, min_lr_ratio=lo), total) == pytest.approx(cos)
    lin = 1 - (1 - lo) * p
    assert lr_multiplier(step, sched("linear", warmup_steps=w, min_lr_ratio=lo), total) == pytest.approx(lin)
    assert lr_multiplier(step, sched("constant", warmup_steps=w), total) == 1.0


def test_wsd_holds_then_decays_over_its_fraction():
    c = sched("wsd", warmup_steps=10, min_lr_ratio=0.0, decay_ratio=0.2)  # decay over the last 18 steps
    assert lr_multiplier(50, c, 100) == 1.0 and lr_multiplier(81, c, 100) == 1.0
    assert lr_multiplier(82, c, 100) == pytest.approx(1.0)
    assert lr_multiplier(91, c, 100) == pytest.approx(1 - 9 / 18)
    assert lr_multiplier(100, c, 100) == pytest.approx(0.0)


def test_no_weight_decay_on_norms_biases_and_embeddings():
    cfg = ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, ffn_dim=32, max_seq_len=16, qkv_bias=True)
    model = build_model(cfg)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    nd = {names[id(p)] for p in no_decay["params"]}
    d = {names[id(p)] for p in decay["params"]}
    assert "embed_tokens.weight" in nd and "norm.weight" in nd and "layers.0.self_attn.q_proj.bias" in nd
    assert "layers.0.self_attn.q_proj.weight" in d and "lm_head.weight" in d
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1
    assert len(d) + len(nd) == len(list(model.parameters()))
    everything = param_groups(model, 0.1, decay_all=True)
    assert len(everything) == 1 and len(everything[0]["params"]) == len(list(model.parameters()))


def test_optimizer_implementation_choice():
    model = torch.nn.Linear(4, 4)
    fused = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    assert fused.defaults["fused"] is True
    loop = build_optimizer(model, OptimConfig(implementation="for-loop"), torch.device("cpu"))
    assert loop.defaults["foreach"] is False and not loop.defaults["fused"]
