"""The mixture-of-experts MLP against transformers' Mixtral and Qwen3-MoE blocks on the same
weights (fp32, 1e-5), its two dispatch paths against each other, its router losses against
transformers' load_balancing_loss_func and the ST-MoE formula, and a training run's metrics."""

import pytest
import torch

from ladle.config.schema import ModelConfig, MoEConfig
from ladle.models import moe as moe_mod
from ladle.models.moe import MoE, pad_groups
from ladle.train.loss import router_losses


def _cfg(family="qwen3_moe", n=6, k=2, ffn=24, norm=True, dispatch="auto", **moe):
    return ModelConfig(
        dim=32,
        n_heads=4,
        family=family,
        moe=MoEConfig(n_experts=n, top_k=k, ffn_dim=ffn, norm_topk_prob=norm, dispatch=dispatch, **moe),
    )


def _hf_block(family, norm):
    import transformers as tf
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    if family == "mixtral":
        c = tf.MixtralConfig(hidden_size=32, intermediate_size=24, num_local_experts=6, num_experts_per_tok=2)
        block = MixtralSparseMoeBlock(c)
    else:
        c = tf.Qwen3MoeConfig(
            hidden_size=32,
            moe_intermediate_size=24,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=norm,
        )
        block = Qwen3MoeSparseMoeBlock(c)
    c._experts_implementation = "eager"
    torch.manual_seed(0)
    for p in block.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    return block


def _copy_from_hf(ours: MoE, block) -> None:
    f = ours.experts.gate_proj.shape[1]
    with torch.no_grad():
        ours.gate.weight.copy_(block.gate.weight)
        ours.experts.gate_proj.copy_(block.experts.gate_up_proj[:, :f])
        ours.experts.up_proj.copy_(block.experts.gate_up_proj[:, f:])
        ours.experts.down_proj.copy_(block.experts.down_proj)


@pytest.mark.parametrize("dispatch", ["grouped_mm", "loop"])
@pytest.mark.parametrize("family,norm", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)])
def test_block_equals_transformers(family, norm, dispatch):
    block = _hf_block(family, norm)
    ours = MoE(_cfg(family, norm=norm, dispatch=dispatch))
    _copy_from_hf(ours, block)
    x = torch.randn(3, 11, 32)
    with torch.no_grad():
        y, (aux, z, counts) = ours(x)
        ref = block(x)
        logits = block.gate(x.view(-1, 32))[0]
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    picks = torch.topk(logits, 2, dim=-1).indices
    assert counts.tolist() == torch.bincount(picks.flatten(), minlength=6).tolist()
    assert int(counts.sum()) == 3 * 11 * 2  # dropless: every (token, expert) pair computed


def test_dispatch_paths_agree_in_values_and_gradients():
    torch.manual_seed(1)
    grouped, loop = MoE(_cfg(dispatch="grouped_mm")), MoE(_cfg(dispatch="loop"))
    for p in grouped.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    loop.load_state_dict(grouped.state_dict())
    x = torch.randn(2, 9, 32)
    outs = []
    for m in (grouped, loop):
        xi = x.clone().requires_grad_()
        y, (aux, z, _) = m(xi)
        ((y * torch.arange(32.0)).sum() + aux + z).backward()
        outs.append((y, xi.grad, [p.grad for p in m.parameters()]))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-5)
    for a, b in zip(outs[0][2], outs[1][2], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_an_expert_without_tokens_gets_a_zero_gradient():
    m = MoE(_cfg(n=4, k=1, dispatch="grouped_mm"))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.3)
        m.gate.weight[3] = 100.0 * m.gate.weight[3].sign()
    x = -torch.randn(1, 8, 32).abs() * m.gate.weight[3].sign()  # a very negative logit for expert 3
    y, (_, _, counts) = m(x)
    assert counts[3] == 0
    y.sum().backward()
    assert m.experts.down_proj.grad[3].abs().sum() == 0 and m.experts.down_proj.grad[:3].abs().sum() > 0


def test_padded_groups_give_the_same_result(monkeypatch):
    # CUDA pads each expert's rows to a multiple of 16 for the grouped GEMM; the same code on CPU.
    torch.manual_seed(2)
    m = MoE(_cfg(dispatch="grouped_mm"))
    for p in m.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        plain, _ = m(x)
        monkeypatch.setattr(moe_mod, "group_align", lambda device, grouped: 16)
        padded, _ = m(x)
    torch.testing.assert_close(padded, plain, atol=1e-6, rtol=1e-6)

    token, counts = torch.tensor([4, 0, 2, 1, 3]), torch.tensor([2, 0, 3])
    rows, pc = pad_groups(token, counts, 4, pad_index=9)
    assert pc.tolist() == [4, 0, 4]
    assert rows.tolist() == [4, 0, 9, 9, 2, 1, 3, 9]


def test_router_losses_equal_transformers_and_st_moe():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    torch.manual_seed(3)
    m = MoE(_cfg(n=6, k=2, aux_loss_weight=0.25, z_loss_weight=0.5))
    for p in m.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    x = torch.randn(4, 8, 32)
    _, stats = m(x)
    logits = m.gate(x.view(-1, 32))
    ref_aux = load_balancing_loss_func((logits,), num_experts=6, top_k=2)
    torch.testing.assert_close(stats[0], ref_aux)
    torch.testing.assert_close(stats[1], (torch.logsumexp(logits, -1) ** 2).mean())
    # Weighted and averaged over layers.
    two = [stats, (stats[0] * 3, stats[1] * 3, stats[2])]
    expected = 0.25 * 2 * stats[0] + 0.5 * 2 * stats[1]
    torch.testing.assert_close(
        router_losses(two, _cfg(aux_loss_weight=0.25, z_loss_weight=0.5).moe), expected
    )
    # Perfect balance: the loss is top_k.
    even = torch.zeros(60, 6)
    assert float(load_balancing_loss_func((even,), 6, 2)) == pytest.approx(2.0)


def test_aux_loss_gradient_reaches_the_router():
    torch.manual_seed(4)
    m = MoE(_cfg())
    x = torch.randn(2, 8, 32)
    _, (aux, _, _) = m(x)
    aux.backward()
    assert m.gate.weight.grad.abs().sum() > 0
    assert m.experts.gate_proj.grad is None  # the aux loss only moves the router


def test_moe_config_checks():
    with pytest.raises(ValueError, match=r"top_k \(5\) must not exceed n_experts \(4\)"):
        MoEConfig(n_experts=4, top_k=5, ffn_dim=8)
    with pytest.raises(ValueError, match="add a model.moe section"):
        ModelConfig(family="mixtral")
    with pytest.raises(ValueError, match="model.moe needs n_experts and ffn_dim"):
        ModelConfig(family="mixtral", moe=MoEConfig(top_k=2))
    with pytest.raises(ValueError, match="use family mixtral or qwen3_moe"):
        ModelConfig(moe=MoEConfig(n_experts=4, ffn_dim=8))
