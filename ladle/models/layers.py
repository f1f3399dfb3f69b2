"""The layers every decoder here shares: RMSNorm, rotary position embeddings (Llama-3.1 scaling,
YaRN, GLM's interleaved pairs, partial rotary), SwiGLU's MLP and scaled dot-product attention
with its CPU fast paths. ladle/models/llama.py, mla.py and moe.py build on them; HF's module
names and RoPE layout, so checkpoints load unpermuted.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ladle.config.schema import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the scale, exactly as HF does (bit-compatible in
        # bf16). F.rms_norm is one fused kernel (3-4x faster fwd+bwd on CPU than the five ops);
        # for fp32 input it computes the very same thing including the scale.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(dtype)


def rope_inv_freq(cfg: ModelConfig, device=None) -> torch.Tensor:
    """(head_size/2,) fp32 inverse frequencies; Llama-3.1 scaling as transformers'
    `_compute_llama3_parameters`, YaRN as its `_compute_yarn_parameters`."""
    d = cfg.rotary_dim  # the head size, or the rotated part of it (partial rotary, GLM)
    s = cfg.rope_scaling
    if s is not None and s.type == "yarn":
        return yarn_inv_freq(d, cfg.rope_theta, s, device)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    if s is None:
        return inv_freq
    low_freq_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_freq_wavelen = s.original_max_seq_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed down by `factor`, short ones kept, the band between
    # interpolated smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_inv_freq(d: int, base: float, s, device=None) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the original context are
    interpolated (divided by `factor`), those that turn more than `beta_fast` times are kept, the
    band between ramps linearly from one to the other."""

    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns that often
        return d * math.log(s.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, d, 2, device=device).float() / d)
    ramp = ((torch.arange(d // 2, device=device).float() - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolation), 0: divided by factor
    return (1.0 / (s.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (1 for DeepSeek-V3, whose
    mscale and mscale_all_dim are equal), 1 otherwise."""
    s = cfg.rope_scaling
    if s is None or s.type != "yarn":
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor
    if s.mscale and s.mscale_all_dim:
        return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    return yarn_mscale(s.factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.attention_factor = rope_attention_factor(cfg)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Angles in fp32 even under autocast: bf16 positions * freqs lose whole radians at long range.
        with torch.autocast(positions.device.type, enabled=False):
            freqs = positions[..., None].float() * self.inv_freq.float()  # (B, T, R/2)
            if self.cfg.rope_interleaved:  # GLM: the pairs (0, 1), (2, 3), ... share a frequency
                emb = freqs.repeat_interleave(2, dim=-1)
            else:
                emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, R), HF's rotate_half layout
            cos, sin = emb.cos(), emb.sin()
            if self.attention_factor != 1.0:
                cos, sin = cos * self.attention_factor, sin * self.attention_factor
            return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """GLM's interleaved rotation: (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    # x (B, H, T, D); cos/sin (B, T, R) -> broadcast over heads; R < D: the rest passes through
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, R)
    rotate = rotate_pairs if interleaved else rotate_half
    R = cos.shape[-1]
    if R == x.shape[-1]:
        return x * cos + rotate(x) * sin
    x_rot, x_pass = x[..., :R], x[..., R:]
    return torch.cat((x_rot * cos + rotate(x_rot) * sin, x_pass), dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


def sdpa(q, k, v, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention when mask is None, else the boolean mask; k/v may have fewer heads (GQA)."""
    gqa = k.shape[1] != q.shape[1]
    B, H, T, D = q.shape
    if q.device.type == "cpu" and T == 1 and gqa and mask is not None:
        # A decode step: one query row per head. The H / K query heads that share a kv head go in
        # as that many rows of one head, so the CPU kernel reads each cached K/V block once for
        # all of them (several times faster in bf16, docs/performance.md). The same sums in
        # another blocking: equal to the GQA call up to rounding (tested). The mask (B, 1, 1, S)
        # covers every row.
        K = k.shape[1]
        y = F.scaled_dot_product_attention(q.reshape(B, K, H // K, D), k, v, attn_mask=mask)
        return y.view(B, H, 1, D)
    if q.device.type == "cpu" and T == k.shape[2] and T % 2 == 0 and T >= 128:
        # On CPU, SDPA's flash kernel computes every key for a causal block of rows (causal costs
        # as much as full attention here), so the first half of the queries, which see only the
        # first half of the keys, runs as its own call: 3/4 of the work, ~20% less fwd+bwd time
        # at T = 512. Accelerator kernels skip masked blocks themselves.
        h = T // 2
        if mask is None:
            m1, m2 = None, torch.ones(h, T, dtype=torch.bool, device=q.device).tril(h)
        else:
            m1, m2 = mask[..., :h, :h], mask[..., h:, :]
        y1 = F.scaled_dot_product_attention(
            q[:, :, :h], k[:, :, :h], v[:, :, :h], attn_mask=m1, is_causal=m1 is None, enable_gqa=gqa
        )
        y2 = F.scaled_dot_product_attention(q[:, :, h:], k, v, attn_mask=m2, enable_gqa=gqa)
        return torch.cat([y1, y2], dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)


def pick(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """x (B, T, ...) at one position per row, at (B,): (B, 1, ...)."""
    return x[torch.arange(x.shape[0], device=x.device), at][:, None]


def to_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """A norm's fp32 output cast once to the autocast dtype. Autocast would cast it again for
    every projection that reads it (q, k, v; gate, up) and cast each gradient back: ~10% of a
    bench-30m step on CPU. Forward values are the same; the branch gradients are summed in the
    compute dtype, as with bf16 weights."""
    if torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x
