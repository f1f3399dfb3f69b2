"""The chunked cross-entropy against torch's own, value and gradient."""

import pytest
import torch
import torch.nn.functional as F

import ladle.train.loss as loss_mod
from ladle.train.loss import IGNORE_INDEX, cross_entropy_sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 1000])  # chunks of one row, ragged chunks, a single chunk
def test_matches_torch_cross_entropy(monkeypatch, dtype, rows):
    monkeypatch.setattr(loss_mod, "_chunk_rows", lambda vocab, device: rows)
    torch.manual_seed(0)
    logits = (torch.randn(3, 50, 300) * 4).to(dtype).requires_grad_()
    targets = torch.randint(0, 300, (3, 50))
    targets[0, :5] = IGNORE_INDEX
    targets[2, -1] = IGNORE_INDEX

    ref = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    (ref * 0.5).backward()
    ref_grad, logits.grad = logits.grad.clone(), None

    got = cross_entropy_sum(logits, targets)
    (got * 0.5).backward()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-3)
    assert logits.grad.dtype == dtype
    tol = {} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2 / 128}
    torch.testing.assert_close(logits.grad, ref_grad, **tol)
    assert (logits.grad[0, :5] == 0).all()  # ignored targets get no gradient


def test_under_autocast_and_all_ignored():
    logits = torch.randn(2, 4, 16, requires_grad=True)
    targets = torch.full((2, 4), IGNORE_INDEX)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cross_entropy_sum(logits, targets)
    loss.backward()
    assert loss.item() == 0.0 and (logits.grad == 0).all()
