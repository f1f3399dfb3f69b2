"""Pretraining: next-token prediction on packed, document-aware sequences of prepared data."""

from __future__ import annotations

from ladle.config import LadleConfig
from ladle.data.loader import PackedSamples
from ladle.data.prepare import open_split
from ladle.recipes import base
from ladle.train.loss import Loss

DATA_TASK = "pretrain"  # `ladle data prepare` without --task


def packed_samples(cfg: LadleConfig, split: str, found: dict) -> PackedSamples:
    """Pretraining rows: `seq_len + 1` consecutive tokens of the split's token stream."""
    return PackedSamples(open_split(cfg.data.path, split), cfg.data.seq_len, split, cfg.data.document_mask)


def run(cfg: LadleConfig, loss: Loss | None = None) -> str:
    """Trains a causal LM (or, with `loss`, another objective on the same rows)."""
    return base.run(cfg, "pretrain", packed_samples, loss)
