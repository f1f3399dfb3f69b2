"""Config: the pydantic schema, YAML loading with dotted overrides, and the config hash."""

from ladle.config.schema import (
    CheckpointConfig,
    DataConfig,
    LadleConfig,
    ModelConfig,
    OptimConfig,
    PrecisionConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "LadleConfig",
    "ModelConfig",
    "OptimConfig",
    "PrecisionConfig",
    "SchedulerConfig",
    "TokenizerConfig",
    "TrainConfig",
]
