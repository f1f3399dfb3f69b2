"""`model.init_from`: the model shape of the Hugging Face folder or ladle checkpoint a run starts
from, merged with the config (`resolve_config`). The pre-launch checks, the RL roles (a reward or
value model's own shape) and `ladle plan` ask it; the weights themselves are read by
ladle/train/builder.py.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from pydantic import ValidationError

from ladle.checkpoint.catalogue import is_checkpoint, read_config, verify
from ladle.checkpoint.dcp import resolve_checkpoint
from ladle.config.load import format_validation_error
from ladle.config.schema import LadleConfig, ModelConfig
from ladle.errors import CheckpointError, ConfigError
from ladle.models.hf import is_hf_folder, read_hf_config

# Fields a run may set differently from the checkpoint it starts from.
FREE_WITH_INIT_FROM = ("init_from", "init_std", "max_seq_len", "head")
MOE_FREE_WITH_INIT_FROM = ("aux_loss_weight", "z_loss_weight", "dispatch")


def read_init_config(path) -> ModelConfig:
    """The model shape of what `model.init_from` names: a Hugging Face folder's config.json, or
    the model section of a ladle checkpoint (or run directory, its latest checkpoint)."""
    if is_hf_folder(path) or not Path(path).is_dir():
        return read_hf_config(path)
    if not (is_checkpoint(path) or (Path(path) / "checkpoints").is_dir()):
        raise CheckpointError(
            f"{path}: no config.json and no ladle checkpoint; model.init_from takes a Hugging Face model "
            "folder, a ladle checkpoint or a run directory"
        )
    ckpt = resolve_checkpoint(path, check=partial(verify, share=None))  # the shape only: sizes
    model = {k: v for k, v in read_config(ckpt)["model"].items() if k != "init_from"}
    return ModelConfig.model_validate(model)


def resolve_init_from(cfg: ModelConfig) -> ModelConfig:
    """With `init_from`, the model shape is the checkpoint's: fields the config leaves out are
    filled from its config.json, and a field the config sets differently is an error (a run
    never silently trains another shape than the weights it loads). max_seq_len and init_std
    stay the config's."""
    if not cfg.init_from:
        return cfg
    hf = read_init_config(cfg.init_from)

    def differs(f: str) -> bool:
        if f == "head_dim":  # an explicit head_dim equal to dim / n_heads is the same shape
            return cfg.head_size != hf.head_size
        if f == "n_kv_heads":
            return cfg.kv_heads != hf.kv_heads
        return getattr(cfg, f) != getattr(hf, f)

    conflicts = [
        f"model.{f}={getattr(cfg, f)!r} (config.json: {getattr(hf, f)!r})"
        for f in sorted(cfg.model_fields_set)
        if f not in (*FREE_WITH_INIT_FROM, "moe") and differs(f)
    ]
    moe = hf.moe
    if cfg.moe is not None and hf.moe is not None:  # the experts' shape is the checkpoint's,
        conflicts += [  # the training options (loss weights, dispatch) are the run's
            f"model.moe.{f}={getattr(cfg.moe, f)!r} (config.json: {getattr(hf.moe, f)!r})"
            for f in sorted(cfg.moe.model_fields_set)
            if f not in MOE_FREE_WITH_INIT_FROM and getattr(cfg.moe, f) != getattr(hf.moe, f)
        ]
        moe = hf.moe.model_copy(
            update={f: getattr(cfg.moe, f) for f in MOE_FREE_WITH_INIT_FROM if f in cfg.moe.model_fields_set}
        )
    elif "moe" in cfg.model_fields_set and (cfg.moe is None) != (hf.moe is None):
        conflicts.append(f"model.moe={cfg.moe!r} (config.json: {hf.moe!r})")
    if conflicts:
        raise ConfigError(
            f"model.init_from={cfg.init_from} disagrees with the config: {', '.join(conflicts)}; "
            "remove those keys from the model section (the checkpoint defines the shape) or fix them"
        )
    keep = {f: getattr(cfg, f) for f in FREE_WITH_INIT_FROM if f in cfg.model_fields_set}
    return ModelConfig(**{**hf.model_dump(), **keep, "moe": moe})


def resolve_config(cfg: LadleConfig) -> LadleConfig:
    """The run config with `model.init_from` resolved (see resolve_init_from), checked again as a
    whole (e.g. data.seq_len against the filled max_seq_len). Recipes and `ladle validate` call it."""
    if not cfg.model.init_from:
        return cfg
    model = resolve_init_from(cfg.model)
    try:
        return LadleConfig.model_validate({**cfg.model_dump(), "model": model.model_dump()})
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, f"model.init_from={cfg.model.init_from}")) from None
