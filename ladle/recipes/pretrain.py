"""Pretraining: next-token prediction on packed, document-aware sequences of prepared data, from
one folder (`data.path`) or a weighted mixture of several (`data.mix`, ladle/data/mix.py)."""

from __future__ import annotations

from ladle.config import LadleConfig
from ladle.data.loader import PackedSamples
from ladle.data.mix import MixedSamples
from ladle.data.prepare import open_split
from ladle.errors import DataError
from ladle.recipes.base import Recipe, Setup, Training
from ladle.train.loss import MixLoss


class Pretrain(Recipe):
    """A causal LM (the causal-LM loss, or another objective passed to `run`)."""

    name = "pretrain"
    data_task = "pretrain"  # `ladle data prepare` without --task
    mixes = True  # reads data.mix

    def samples(self, cfg: LadleConfig, split: str, found) -> PackedSamples | MixedSamples:
        """Pretraining rows: `seq_len + 1` consecutive tokens of the split's token stream (of
        each source of a mixture)."""
        d = cfg.data
        if d.mix is None:
            return PackedSamples(open_split(d.path, split), d.seq_len, split, d.document_mask)
        sources = []
        for s in d.mix:
            try:
                sources.append(PackedSamples(open_split(s.path, split), d.seq_len, split, d.document_mask))
            except DataError as e:
                raise DataError(f"data.mix source {s.name} ({s.path}): {e}") from e
        return MixedSamples(sources, [s.name for s in d.mix], [s.path for s in d.mix], split)

    def setup(self, s: Setup) -> Training:
        mix = s.cfg.data.mix
        return Training(self.samples, MixLoss([m.name for m in mix], s.cfg.model.moe) if mix else None)


RECIPE = Pretrain()
run = RECIPE.run
