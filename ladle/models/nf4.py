"""4-bit NormalFloat (NF4) weights for QLoRA (Dettmers et al., 2023), in plain PyTorch.

A weight is cut into blocks of 64 values; each block is divided by its absolute maximum and every
value replaced by the nearest of the 16 NF4 levels (the quantiles of a normal distribution,
normalised to [-1, 1]; the table of bitsandbytes and torchao), two 4-bit indices a byte. The
block maxima are quantized again ("double quantization"): in groups of 256 their mean is taken
out and the rest stored as int8 with one fp32 scale per group. Storage: 4 + 8/64 + 64/(64*256)
= 4.13 bits a weight, against 16 in bf16.

Error: a value w in a block with maximum a comes back as a * level with |a * level - w| <= a * g / 2,
g the widest gap between neighbouring levels (0.304, between -1 and -0.696), plus the error of the
block maximum's own int8 quantization (`max_error` gives the bound per element; tested).

`quantize_linears` swaps the frozen base weights of a model's linear layers for NF4 storage
(non-persistent buffers: checkpoints never hold them, the base is re-quantized from
`model.init_from` at every start). Their forward dequantizes the weight to the compute dtype
just for the matmul, and again in backward (`NF4Linear`): the full-precision weight is never
kept between the two.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)  # fmt: skip
BLOCK = 64  # values per block maximum
SCALE_BLOCK = 256  # block maxima per int8 group (double quantization)
HALF_GAP = max(b - a for a, b in zip(LEVELS[:-1], LEVELS[1:], strict=True)) / 2


class NF4Weight(nn.Module):
    """One weight matrix in NF4 (see the module docstring); `dequantize(dtype)` gives it back."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        if w.numel() % BLOCK:
            raise ValueError(f"NF4 needs a multiple of {BLOCK} values, got a {tuple(w.shape)} weight")
        self.shape, self.orig_dtype = tuple(w.shape), w.dtype
        levels = torch.tensor(LEVELS, device=w.device)
        blocks = w.detach().float().reshape(-1, BLOCK)
        absmax = blocks.abs().amax(1)  # (n_blocks,)
        q_absmax, s_scale, s_mean = _quantize_scales(absmax)
        absmax = _dequantize_scales(q_absmax, s_scale, s_mean)  # the maxima as they will be read
        x = blocks / absmax.clamp(min=torch.finfo(torch.float32).tiny)[:, None]
        idx = (x[..., None] - levels).abs().argmin(-1).to(torch.uint8).reshape(-1)  # nearest level
        self.register_buffer("packed", idx[0::2] << 4 | idx[1::2], persistent=False)
        self.register_buffer("q_absmax", q_absmax, persistent=False)
        self.register_buffer("scale_scale", s_scale, persistent=False)
        self.register_buffer("scale_mean", s_mean, persistent=False)
        self.register_buffer("levels", levels, persistent=False)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        idx = torch.stack([self.packed >> 4, self.packed & 15], dim=1).reshape(-1, BLOCK).long()
        absmax = _dequantize_scales(self.q_absmax, self.scale_scale, self.scale_mean)
        return (self.levels[idx] * absmax[:, None]).reshape(self.shape).to(dtype)

    def max_error(self) -> torch.Tensor:
        """A bound on |dequantize() - w| for each element: half the widest level gap times the
        block maximum as read, plus how far that maximum may be from the true one."""
        absmax = _dequantize_scales(self.q_absmax, self.scale_scale, self.scale_mean)
        scale_err = self.scale_scale.repeat_interleave(SCALE_BLOCK)[: absmax.numel()] / 2
        return ((HALF_GAP * absmax + scale_err)[:, None].expand(-1, BLOCK)).reshape(self.shape)

    def nbytes(self) -> int:
        return sum(
            b.numel() * b.element_size()
            for b in (self.packed, self.q_absmax, self.scale_scale, self.scale_mean)
        )


def _quantize_scales(absmax: torch.Tensor):
    n = absmax.numel()
    pad = (-n) % SCALE_BLOCK
    a = F.pad(absmax, (0, pad), value=float(absmax.mean())).reshape(-1, SCALE_BLOCK)
    mean = a.mean(1, keepdim=True)
    scale = ((a - mean).abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
    q = torch.round((a - mean) / scale).clamp(-127, 127).to(torch.int8)
    return q.reshape(-1)[:n], scale.reshape(-1), mean.reshape(-1)


def _dequantize_scales(q: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    n = q.numel()
    s = scale.repeat_interleave(SCALE_BLOCK)[:n]
    m = mean.repeat_interleave(SCALE_BLOCK)[:n]
    return q.float() * s + m


class _NF4Matmul(torch.autograd.Function):
    """y = x W^T with W dequantized in forward and again in backward, never saved."""

    @staticmethod
    def forward(ctx, x, nf4: NF4Weight):
        ctx.nf4 = nf4
        return F.linear(x, nf4.dequantize(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.nf4.dequantize(grad.dtype), None


def nf4_linear(x: torch.Tensor, nf4: NF4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    y = _NF4Matmul.apply(x, nf4)
    return y + bias.to(y.dtype) if bias is not None else y


class NF4Linear(nn.Linear):
    """A frozen nn.Linear whose weight is stored as `weight_nf4` (made by `quantize_linears`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4_linear(x, self.weight_nf4, self.bias)


def base_weight(m: nn.Linear, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The base weight of a linear layer, dequantized if it is stored in NF4."""
    if hasattr(m, "weight_nf4"):
        return m.weight_nf4.dequantize(dtype or m.weight_nf4.orig_dtype)
    return m.weight if dtype is None else m.weight.to(dtype)


@torch.no_grad()
def quantize_linears(model: nn.Module) -> tuple[int, int]:
    """Every linear layer inside the transformer blocks (attention and MLP; not the embedding or
    the output head, as QLoRA does) to NF4, frozen. Returns (NF4 bytes, bytes before)."""
    after = before = 0
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or not name.startswith("layers.") or hasattr(m, "weight_nf4"):
            continue
        w = m.weight
        before += w.numel() * w.element_size()
        m.weight_nf4 = NF4Weight(w)
        after += m.weight_nf4.nbytes()
        del m._parameters["weight"]
        if m.bias is not None:
            m.bias.requires_grad_(False)
        if type(m) is nn.Linear:  # an adapter's layer (ladle/models/lora.py) reads weight_nf4 itself
            m.__class__ = NF4Linear
    return after, before
