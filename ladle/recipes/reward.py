"""A reward model: the decoder with a scalar head (`model.head: score`) trained on preference
pairs (`ladle data prepare --task preference`) with the Bradley-Terry loss, from an SFT or HF
checkpoint (`model.init_from`; a causal LM's head is replaced by a new score head). Its score of
a sequence is the head's output at the sequence's last token, as transformers'
`...ForSequenceClassification` computes it; `ladle export hf` writes that layout.
"""

from __future__ import annotations

from ladle.config import LadleConfig
from ladle.errors import ConfigError
from ladle.preference.losses import RewardLoss, pad_multiple
from ladle.recipes.base import Setup, Training
from ladle.recipes.dpo import PairRecipe


class Reward(PairRecipe):
    name = "reward"

    def check_layout(self, cfg: LadleConfig, layout) -> None:
        super().check_layout(cfg, layout)
        if cfg.lora is not None:
            raise ConfigError(
                "lora: reward models train in full for now (the new score head needs it); remove lora"
            )

    def config(self, cfg: LadleConfig) -> LadleConfig:
        """The policy's config with a score head."""
        if cfg.model.head == "score":
            return cfg
        return LadleConfig.model_validate(
            {**cfg.model_dump(), "model": {**cfg.model.model_dump(exclude_unset=True), "head": "score"}}
        )

    def setup(self, s: Setup) -> Training:
        tp = s.par.layout.tp  # sequence parallelism splits the positions: score them all there
        return Training(self.samples, RewardLoss(s.cfg.reward, pad_multiple(tp), last_only=tp == 1))


RECIPE = Reward()
run = RECIPE.run
