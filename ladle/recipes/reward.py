"""A reward model: the decoder with a scalar head (`model.head: score`) trained on preference
pairs (`ladle data prepare --task preference`) with the Bradley-Terry loss, from an SFT or HF
checkpoint (`model.init_from`; a causal LM's head is replaced by a new score head). Its score of
a sequence is the head's output at the sequence's last token, as transformers'
`...ForSequenceClassification` computes it; `ladle export hf` writes that layout.
"""

from __future__ import annotations

from ladle.config import LadleConfig
from ladle.errors import ConfigError
from ladle.recipes import base
from ladle.recipes.dpo import check_layout as pair_layout
from ladle.recipes.dpo import pair_samples
from ladle.train.preference import RewardLoss, pad_multiple

DATA_TASK = "preference"


def check_layout(cfg: LadleConfig, layout) -> None:
    pair_layout(cfg, layout)
    if cfg.lora is not None:
        raise ConfigError(
            "lora: reward models train in full for now (the new score head needs it); remove lora"
        )


def with_score_head(cfg: LadleConfig) -> LadleConfig:
    if cfg.model.head == "score":
        return cfg
    return LadleConfig.model_validate(
        {**cfg.model_dump(), "model": {**cfg.model.model_dump(exclude_unset=True), "head": "score"}}
    )


def setup(s: base.Setup):
    tp = s.par.layout.tp  # sequence parallelism splits the positions: score them all there
    return base.Plan(pair_samples, RewardLoss(s.cfg.reward, pad_multiple(tp), last_only=tp == 1))


def run(cfg: LadleConfig) -> str:
    return base.run(with_score_head(cfg), "reward", None, setup=setup)
