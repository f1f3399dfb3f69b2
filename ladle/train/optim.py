"""AdamW with sensible parameter groups (or Muon: ladle/train/muon.py), and the learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn

from ladle import device as dev
from ladle.config import OptimConfig, SchedulerConfig
from ladle.train.muon import Muon, muon_param_groups


def param_groups(model: nn.Module, weight_decay: float, decay_all: bool = False) -> list[dict]:
    """Weight decay on matrices only: norms, biases and embeddings (tied output heads included)
    are not decayed, unless `decay_all`."""
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    seen = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if decay_all or (p.ndim >= 2 and id(p) not in embedding_params):
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device: torch.device, precision_mode: str = "fp32"
) -> torch.optim.Optimizer:
    """`precision_mode` (resolved): Muon's Newton-Schulz dtype under `optim.muon_ns_dtype: auto`."""
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if dev.fused_adamw_available(device) else "foreach"
    kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    groups = param_groups(model, cfg.weight_decay, cfg.decay_norms_biases_embeddings)
    if cfg.name == "muon":
        return Muon(
            muon_param_groups(model, groups, cfg.weight_decay),
            lr=cfg.lr,
            momentum=cfg.muon_momentum,
            nesterov=cfg.muon_nesterov,
            ns_steps=cfg.muon_ns_steps,
            ns_dtype=muon_ns_dtype(cfg, precision_mode),
            adjust_lr=cfg.muon_adjust_lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            **kwargs,
        )
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kwargs)


def muon_ns_dtype(cfg: OptimConfig, precision_mode: str) -> str:
    """`auto`: bfloat16 where the run computes in bf16 (Moonlight's), else float32."""
    if cfg.muon_ns_dtype != "auto":
        return cfg.muon_ns_dtype
    return "bfloat16" if precision_mode in ("bf16", "bf16-mixed") else "float32"


def lr_multiplier(step: int, cfg: SchedulerConfig, max_steps: int) -> float:
    """The lr of optimizer step `step` (0-based) as a fraction of optim.lr.

    Warmup is linear from 1/warmup to 1, so the first step already learns. After it:
    cosine and linear go to min_lr_ratio at max_steps; constant stays at 1; WSD
    (warmup-stable-decay) holds 1, then decays linearly to min_lr_ratio over the last
    `decay_ratio` of the post-warmup steps.
    """
    w = cfg.warmup_steps
    if step < w:
        return (step + 1) / w
    if cfg.name == "constant":
        return 1.0
    lo = cfg.min_lr_ratio
    span = max(1, max_steps - w)
    progress = min(1.0, (step - w) / span)
    if cfg.name == "cosine":
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.name == "linear":
        return 1 - (1 - lo) * progress
    if cfg.name == "wsd":
        decay_steps = max(1, round(cfg.decay_ratio * span))
        decay_start = max_steps - decay_steps
        if step < decay_start:
            return 1.0
        return 1 - (1 - lo) * min(1.0, (step - decay_start) / decay_steps)
    raise ValueError(f"unknown schedule {cfg.name}")


def build_scheduler(opt: torch.optim.Optimizer, cfg: SchedulerConfig, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, cfg, max_steps))
