"""Pretraining: next-token prediction on packed, document-aware sequences of prepared data."""

from __future__ import annotations

from ladle.config import LadleConfig
from ladle.data.loader import PackedSamples
from ladle.data.prepare import open_split
from ladle.recipes.base import Recipe


class Pretrain(Recipe):
    """A causal LM (the causal-LM loss, or another objective passed to `run`)."""

    name = "pretrain"
    data_task = "pretrain"  # `ladle data prepare` without --task

    def samples(self, cfg: LadleConfig, split: str, found) -> PackedSamples:
        """Pretraining rows: `seq_len + 1` consecutive tokens of the split's token stream."""
        return PackedSamples(
            open_split(cfg.data.path, split), cfg.data.seq_len, split, cfg.data.document_mask
        )


RECIPE = Pretrain()
run = RECIPE.run
