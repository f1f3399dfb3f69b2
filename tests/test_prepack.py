"""ladle/models/prepack.py: CPU linears on oneDNN-packed weights, for generation."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ladle.config.schema import ModelConfig
from ladle.models.generation import generate
from ladle.models.llama import build_model
from ladle.models.prepack import prepacked

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")


def tiny(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    base = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, init_std=0.2)
    return build_model(ModelConfig(**{**base, **kw})).to(dtype).eval()


def no_plain_linear(*args, **kwargs):
    raise AssertionError("F.linear called: a linear was not packed")


@pytest.mark.parametrize("tied", [False, True])
def test_packed_forward_equals_plain_and_is_undone(tied, monkeypatch):
    model = tiny(tie_embeddings=tied, qkv_bias=True)  # biases too
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    tokens = torch.randint(0, 97, (3, 9))
    with torch.inference_mode():
        plain = model(tokens)
        with prepacked(model, batch=3):
            monkeypatch.setattr(F, "linear", no_plain_linear)  # every linear and the head packed
            packed = model(tokens)
            monkeypatch.undo()
        torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)
        assert not any("forward" in vars(m) for m in model.modules())  # the class forwards again
        monkeypatch.setattr(F, "linear", no_plain_linear)
        with pytest.raises(AssertionError, match="not packed"):
            model(tokens)


def test_lora_bases_and_adapters_are_packed(monkeypatch):
    from ladle.config.schema import LoRAConfig
    from ladle.models.lora import apply_lora

    model = tiny()
    apply_lora(model, LoRAConfig(targets=["q_proj", "v_proj", "down_proj"], rank=4, dora=True), seed=0)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "lora_B"):
                m.lora_B.weight.normal_(0, 0.3)  # adapters that change the output
    model.eval()
    tokens = torch.randint(0, 97, (2, 6))
    with torch.inference_mode():
        plain = model(tokens)
        with prepacked(model):
            monkeypatch.setattr(F, "linear", no_plain_linear)  # bases, adapters and the rest packed
            packed = model(tokens)
            monkeypatch.undo()
        assert not any("base" in vars(m) or "forward" in vars(m) for m in model.modules())
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no bf16 oneDNN on this CPU")
def test_packed_bf16_close_to_plain():
    model = tiny(torch.bfloat16)
    model.init_buffers()
    tokens = torch.randint(0, 97, (2, 7))
    with torch.inference_mode():
        plain = model(tokens)
        with prepacked(model):
            packed = model(tokens)
    assert packed.dtype == torch.bfloat16
    torch.testing.assert_close(packed.float(), plain.float(), atol=2e-2, rtol=2e-2)


def test_changed_or_replaced_weights_are_packed_again():
    model = tiny()
    tokens = torch.randint(0, 97, (2, 5))
    new_up = nn.Parameter(torch.randn(64, 32))
    with torch.inference_mode(), prepacked(model):
        model(tokens)  # packs
        model.lm_head.weight.mul_(2)  # in place: the version counter moves
        model.layers[0].mlp.up_proj.weight = new_up  # a new object
        model.layers[1].mlp.up_proj.weight = nn.Parameter(torch.randn(64, 32))  # an inference tensor
        packed = model(tokens)
    with torch.inference_mode():
        torch.testing.assert_close(packed, model(tokens), atol=1e-5, rtol=1e-5)


def test_grad_mode_uses_the_plain_op_and_contexts_nest():
    model = tiny()
    tokens = torch.randint(0, 97, (2, 5))
    model(tokens).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with prepacked(model):
        with prepacked(model):  # the inner context packs nothing and undoes nothing
            pass
        assert "forward" in vars(model.lm_head)
        model(tokens).sum().backward()  # gradients wanted: F.linear, whose backward exists
    for p, g in zip(model.parameters(), ref, strict=True):
        torch.testing.assert_close(p.grad, g)
    assert "forward" not in vars(model.lm_head)


def test_generate_prepack_off_gives_same_tokens():
    model = tiny()
    prompts = [[5, 17, 3, 88, 41, 2, 60], [9, 30, 72]]
    assert generate(model, prompts, max_new_tokens=10) == generate(
        model, prompts, max_new_tokens=10, prepack=False
    )
