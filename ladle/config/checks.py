"""Checks of a config against the file system: the tokenizer and prepared data it names.

Run before any process is spawned or any file is written, so a bad path fails in a second.
"""

from __future__ import annotations

from ladle.config.schema import LadleConfig
from ladle.errors import ConfigError, DataError


def check_tokenizer(cfg: LadleConfig):
    from ladle.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.tokenizer.path)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the vocabulary of the tokenizer at "
            f"{cfg.tokenizer.path} ({tok.vocab_size} tokens); set model.vocab_size to at least "
            f"{tok.vocab_size} (a multiple of 64 runs fastest: {-(-tok.vocab_size // 64) * 64})"
        )
    return tok


def check_pretrain_data(cfg: LadleConfig, tok) -> dict:
    """The prepared data exists, was made with this tokenizer, and fits the model."""
    from ladle.data.prepare import load_meta

    meta = load_meta(cfg.data.path)
    theirs = meta.get("tokenizer_hash")
    if theirs and theirs != tok.hash:
        raise DataError(
            f"data.path {cfg.data.path} was prepared with a different tokenizer "
            f"({meta.get('tokenizer_path')}, sha256 {theirs[:12]}) than tokenizer.path {cfg.tokenizer.path} "
            f"(sha256 {tok.hash[:12]}); point tokenizer.path at the tokenizer the data was prepared with, "
            f"or run `ladle data prepare --tokenizer {cfg.tokenizer.path} ...` again"
        )
    if int(meta.get("vocab_size", 0)) > cfg.model.vocab_size:
        raise ConfigError(
            f"data.path {cfg.data.path} holds token ids up to {meta['vocab_size'] - 1}, beyond "
            f"model.vocab_size ({cfg.model.vocab_size}); raise model.vocab_size"
        )
    return meta


# The data each recipe trains on (meta.json "task"; pretraining data has none).
RECIPE_DATA = {"pretrain": "pretrain", "sft": "sft"}


def check_all(cfg: LadleConfig, recipe: str | None = None) -> dict:
    """Everything `ladle validate` and `ladle run` check beyond the schema; returns what they found.
    With `recipe`, the data must also be the kind that recipe trains on."""
    tok = check_tokenizer(cfg)
    meta = check_pretrain_data(cfg, tok)
    task = meta.get("task", "pretrain")
    if recipe in RECIPE_DATA and task != RECIPE_DATA[recipe]:
        how = "`ladle data prepare --task sft`" if recipe == "sft" else "`ladle data prepare` (no --task)"
        raise DataError(
            f"data.path {cfg.data.path} holds {task} data, but recipe {recipe} trains on {RECIPE_DATA[recipe]} "
            f"data; prepare it with {how}, or use `ladle run {task}`"
        )
    return {"tokenizer": tok, "meta": meta}
