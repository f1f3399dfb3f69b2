"""Routing replay for MoE RL (R3): the routing recorded while sampling is the router's own choice
at every token the model read, replaying it makes the training forward route each token to the
sampler's experts (whatever its own router now prefers), `routing_agreement` by hand, and GRPO on
a tiny MoE policy with `grpo.routing_replay`."""

from __future__ import annotations

import pytest
import torch

from ladle.config.schema import ModelConfig, MoEConfig
from ladle.models.generation import sample
from ladle.models.llama import build_model
from ladle.models.moe import MoE, choices
from ladle.rl.algorithms import routing_agreement


def moe_model(seed=0, scoring="softmax"):
    torch.manual_seed(seed)
    extra = {"scoring": "sigmoid", "n_group": 1, "topk_group": 1} if scoring == "sigmoid" else {}
    cfg = ModelConfig(
        vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64,
        family="qwen3_moe",
        moe=MoEConfig(n_experts=6, top_k=2, ffn_dim=24, **extra),
    )  # fmt: skip
    return build_model(cfg).eval()


def test_routing_agreement_by_hand():
    own = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [0, 2]], [[1, 3], [3, 1]]])  # (N=3, L=2, k=2)
    rec = torch.tensor([[[[1, 0], [2, 4]], [[4, 5], [2, 0]], [[-1, -1], [-1, -1]]]])  # (1, 3, 2, 2)
    agree, n = routing_agreement(own, rec)
    # token 0: layer 0 alike as sets, layer 1 not; token 1: both alike; token 2: not recorded
    assert (int(agree), int(n)) == (3, 4)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_sampled_routing_is_the_routers_choice_at_every_token_read(scoring):
    model = moe_model(scoring=scoring)
    prompts = [[5, 6, 7, 8], [9, 10], [5, 6, 7, 8]]  # two rows share a prompt (one prefill)
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    got = sample(
        model, prompts, max_new_tokens=6, temperature=1.0, row_generators=gens, routing=True, prepack=False
    )
    for p, new, rt in zip(prompts, got.tokens, got.routing, strict=True):
        seq = torch.tensor([p + new[:-1]])
        with torch.no_grad():
            model(seq)
        want = choices(model)[: seq.shape[1]]  # (T, L, k) of a plain forward on what was read
        assert rt.shape == want.shape and rt.dtype == torch.int16
        assert (rt.long().sort(-1).values == want.sort(-1).values).all()


def test_replay_routes_every_token_to_the_samplers_experts():
    sampler, trainer = moe_model(0), moe_model(0)
    with torch.no_grad():  # the trainer's routers have moved (an update, other numerics)
        for m in trainer.modules():
            if isinstance(m, MoE):
                m.gate.weight.add_(torch.randn_like(m.gate.weight))
    tokens = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        sampler(tokens)
    recorded = choices(sampler).view(2, 10, 2, 2).to(torch.int16)
    recorded[1, 7:] = -1  # positions without a record: the router's own choice
    trainer(tokens)
    own = choices(trainer)
    agree, n = routing_agreement(own, recorded)
    assert 0 < int(agree) < int(n)  # it would route some tokens elsewhere
    logits = trainer(tokens, routing=recorded)
    layers = sorted((m for m in trainer.modules() if isinstance(m, MoE)), key=lambda m: m.ordinal)
    used = torch.stack([m.used for m in layers], 1).view(2, 10, 2, 2)
    assert (used[recorded >= 0] == recorded[recorded >= 0].long()).all()  # the sampler's experts
    assert (used[1, 7:] == own.view(2, 10, 2, 2)[1, 7:]).all()  # and its own where none was recorded
    assert (choices(trainer) == own).all()  # its own choice is still what it reports
    # the routers still learn: the gate gets a gradient through the replayed experts' weights
    logits.sum().backward()
    assert all(m.gate.weight.grad.abs().sum() > 0 for m in layers)
    # replaying the trainer's own choice changes nothing
    with torch.no_grad():
        same = trainer(tokens, routing=own.view(2, 10, 2, 2).to(torch.int16))
        plain = trainer(tokens)
    assert torch.allclose(same, plain, atol=1e-6) and not torch.allclose(logits.detach(), plain, atol=1e-3)


def test_grpo_on_a_moe_policy_replays_its_samplers_routing(chat_tokenizer, prompt_data, tmp_path, capsys):
    import yaml
    from test_grpo import grpo_config

    from ladle.cli import main
    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    def config(out, **grpo):
        cfg = grpo_config(chat_tokenizer, prompt_data, tmp_path / out, num_iterations=2, **grpo)
        cfg["model"].update(family="qwen3_moe", moe={"n_experts": 4, "top_k": 2, "ffn_dim": 32})
        return cfg

    assert load("grpo").run(build_config(config("plain"))) == "completed"
    assert load("grpo").run(build_config(config("replay", routing_replay=True))) == "completed"
    plain, replay = ([r for r in read_metrics(tmp_path / n) if "loss" in r] for n in ("plain", "replay"))
    for recs in (plain, replay):  # logged either way; fp32: the first update routes as it sampled
        assert all(0 <= r["routing_agreement"] <= 1 for r in recs)
        assert recs[0]["routing_agreement"] == pytest.approx(1.0)
    # the first step's batch is the same; replaying the sampler's routing is then the same forward
    assert replay[0]["loss"] == pytest.approx(plain[0]["loss"], abs=1e-6)
    # refused by name: a dense policy
    path = tmp_path / "c.yaml"
    cfg = grpo_config(chat_tokenizer, prompt_data, tmp_path / "never", routing_replay=True)
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", "grpo", "--config", str(path)]) == 2
    assert (
        "grpo.routing_replay: replays the experts an MoE policy's tokens went to; this model has no MoE layers"
        in (capsys.readouterr().err)
    )
