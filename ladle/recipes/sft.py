"""Supervised finetuning: next-token prediction on chats, trained on the tokens their loss mask
marks (the assistant turns by default), from data prepared with `ladle data prepare --task sft`.

The loop, layouts, checkpoints and metrics are every recipe's (ladle/recipes/base.py); only
the rows differ: chats packed into `data.seq_len` (or one per row, padded), their untrained
targets ignored. Start from a Hugging Face folder or a ladle checkpoint with `model.init_from`.
"""

from __future__ import annotations

from ladle.config import LadleConfig
from ladle.data.packing import SFTSamples
from ladle.data.sft import SFTSplit
from ladle.recipes.base import Recipe


class SFT(Recipe):
    name = "sft"
    data_task = "sft"  # `ladle data prepare --task sft`

    def samples(self, cfg: LadleConfig, split: str, found) -> SFTSamples:
        tok = found["tokenizer"]
        return SFTSamples(
            SFTSplit(cfg.data.path, split),
            cfg.data.seq_len,
            packing=cfg.data.packing,
            seed=cfg.seed,
            pad_id=tok.pad_id if tok.pad_id is not None else 0,
            name=split,
        )


RECIPE = SFT()
run = RECIPE.run
