"""Multi-head latent attention (DeepSeek-V2/V3), as transformers' `DeepseekV3Attention` computes it.

Per token: a latent of `kv_lora_rank` values (`kv_a_proj_with_mqa`, then `kv_a_layernorm`) from
which `kv_b_proj` makes every head's key part without RoPE (`qk_nope_head_dim`) and its value
(`v_head_dim`), plus one small key part with RoPE (`qk_rope_head_dim`) shared by all heads.
Queries come through a low-rank projection of their own (`q_a_proj`, `q_a_layernorm`,
`q_b_proj`; or one `q_proj` without `q_lora_rank`), each head a part without and a part with
RoPE. Scores scale by 1 / sqrt(nope + rope), SDPA's default for that query size, times YaRN's
mscale^2 where the RoPE scaling says so (DeepSeek-V3's long context).

The KV cache stores what the architecture needs: the normalised latent and the roped shared key
part (kv_lora_rank + qk_rope_head_dim values a token and layer, against 2 x heads x head size
for the expanded keys and values); each step expands the cached latents through `kv_b_proj`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ladle.config.schema import ModelConfig
from ladle.models.layers import RMSNorm, apply_rope, sdpa, yarn_mscale


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None = None):
        super().__init__()
        m = cfg.mla
        H = cfg.n_heads
        self.window = window
        self.interleaved = cfg.rope_interleaved
        self.nope, self.rope, self.v_dim, self.kv_rank = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.kv_lora_rank,
        )
        q_dim = H * (self.nope + self.rope)
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.dim, q_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.dim, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg.norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.dim, m.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, cfg.norm_eps)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, cfg.dim, bias=False)
        # The key part every head shares passes here: tensor parallel sums its gradient over the
        # ranks' heads at this point (ladle/parallel/tp.py); otherwise it does nothing.
        self.shared_key = nn.Identity()
        self.low_rank_q = m.q_lora_rank is not None
        # YaRN's mscale_all_dim sharpens the softmax by mscale^2 (transformers' yarn_apply_mscale),
        # applied to the queries so that every attention path keeps SDPA's default scale.
        s = cfg.rope_scaling
        self.q_scale = 1.0
        if s is not None and s.type == "yarn" and s.mscale_all_dim:
            self.q_scale = yarn_mscale(s.factor, s.mscale_all_dim) ** 2

    def forward(self, x, cos, sin, mask=None, cache=None, layer: int = 0, at=None):
        if at is not None:
            raise ValueError("MLA: `at` (one position per row) is not supported; score every position")
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.low_rank_q else self.q_proj(x)
        q = q.view(B, T, -1, self.nope + self.rope).transpose(1, 2)  # (B, H, T, nope + rope)
        q_pass, q_rot = q.split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent).unsqueeze(1)  # (B, 1, T, kv_rank)
        k_rot = self.shared_key(k_rot.unsqueeze(1))  # (B, 1, T, rope): one key part for every head
        q_rot = apply_rope(q_rot, cos, sin, self.interleaved)
        k_rot = apply_rope(k_rot, cos, sin, self.interleaved)
        if cache is not None:  # the compressed latent and the roped key part are what is cached
            k_rot, latent = cache.update(layer, k_rot, latent)
            k_rot, latent = k_rot.to(q.dtype), latent.to(q.dtype)
        S = latent.shape[2]
        kv = self.kv_b_proj(latent.squeeze(1)).view(B, S, -1, self.nope + self.v_dim).transpose(1, 2)
        k_pass, v = kv.split([self.nope, self.v_dim], dim=-1)  # (B, H, S, nope), (B, H, S, v)
        H = k_pass.shape[1]
        k = torch.cat([k_pass, k_rot.expand(-1, H, -1, -1)], dim=-1)
        q = torch.cat([q_pass, q_rot], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        y = self.attend(q, k, v, mask)  # (B, H, T, v)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def attend(self, q, k, v, mask) -> torch.Tensor:
        """The attention itself, over the expanded heads; eager under train.compile, as
        `Attention.attend` (ladle/parallel/compile.py). Values narrower than the queries are
        zero-padded to their width: SDPA's flash kernels take one head size for q, k and v (else
        the CPU falls back to the math path, which keeps the (T, T) scores: twice the time in
        fp32 at V3's proportions), and the padded output columns are zeros, sliced off."""
        pad = q.shape[-1] - v.shape[-1]
        if pad > 0:
            v = torch.nn.functional.pad(v, (0, pad))
        if mask is not None and not isinstance(mask, torch.Tensor):  # PackedMask or the caller's
            y = mask.attend(q, k, v)
        else:
            y = sdpa(q, k, v, mask)
        return y[..., : y.shape[-1] - pad] if pad > 0 else y
