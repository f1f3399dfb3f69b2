"""Everything checked before a run starts, in one place: `ladle validate`, the parent of a
multi-process `ladle run` (before torchrun starts N processes), `ladle launch slurm` and every
training process call `check`, so each refusal comes before anything is written.

- `model.init_from`: the model shape comes from the Hugging Face folder or ladle checkpoint it
  names (ladle/checkpoint/init_from.py);
- the tokenizer and the prepared data: they exist, agree with each other and the model, and hold
  the kind of data the recipe declares (its `data_task`);
- `eval.harness`: lm-eval is installed, the tasks exist, their local data files too;
- the parallel layout for the world size (`check_layout`, ladle/parallel/mesh.py), what the recipe
  cannot run on, and whether the layout fits in the device's memory (ladle/plan);
- the resume decision is ladle/checkpoint/resume.py's, taken after these checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ladle.checkpoint.init_from import resolve_config
from ladle.config.schema import LadleConfig
from ladle.data.folder import check_files, load_meta
from ladle.data.tokenizer import load_tokenizer
from ladle.device import pick_device
from ladle.errors import ConfigError, DataError
from ladle.parallel.mesh import check_layout
from ladle.plan import check_fits
from ladle.train import loggers


class RecipeChecks(Protocol):
    """What the checks ask of a recipe (ladle/recipes/base.py `Recipe` has each)."""

    name: str
    data_task: str  # the `ladle data prepare --task` its data comes from
    mixes: bool  # it reads a mixture of folders (data.mix)

    def check_layout(self, cfg: LadleConfig, layout) -> None: ...  # what it cannot run on

    def check_paths(self, cfg: LadleConfig) -> None: ...  # the other models it reads

    def placement(self, cfg: LadleConfig) -> tuple[int, str] | None: ...  # a separated placement's groups


@dataclass
class Checked:
    """What the checks found: the config with init_from resolved, the layout (when a world size
    was given), the tokenizer, the data folder's meta.json and `eval.harness`'s task index (when
    paths were checked)."""

    cfg: LadleConfig
    layout: object = None  # ladle.parallel.mesh.Layout
    tokenizer: object = None  # ladle.data.tokenizer.Tokenizer
    meta: dict | None = None
    harness_tasks: object = None  # lm_eval.tasks.TaskManager

    def __getitem__(self, key):  # found["tokenizer"], found["meta"]
        return getattr(self, key)


def check(
    cfg: LadleConfig, recipe: RecipeChecks | None = None, world: int = 0, paths: bool = True
) -> Checked:
    """The config as every process will see it: `init_from` resolved, tokenizer and data checked
    against each other, the model and the recipe's data task (unless paths=False: they exist only
    on the cluster), and the parallel layout for `world` processes (when given)."""
    found = Checked(cfg)
    loggers.check(cfg)
    if paths:
        check_output_dir(cfg)
        found.cfg = cfg = resolve_config(cfg)
        found.tokenizer = check_tokenizer(cfg)
        found.meta = check_data(cfg, found.tokenizer)
    if cfg.data.mix is not None and recipe is not None and not recipe.mixes:
        raise ConfigError(
            f"data.mix: `ladle run {recipe.name}` reads one prepared folder; set data.path instead "
            "(mixtures are `ladle run pretrain`'s)"
        )
    if paths and recipe is not None:
        check_data_task(cfg, recipe, found.meta)
        recipe.check_paths(cfg)  # the other models a recipe reads
    if paths and cfg.eval.harness:
        found.harness_tasks = check_harness(cfg, recipe)
    if world:
        placement = recipe.placement(cfg) if recipe is not None else None
        found.layout = check_layout(cfg, world, *(placement or ()))
        if recipe is not None:  # what a recipe cannot run on (the pair recipes: pp, cp)
            recipe.check_layout(cfg, found.layout)
        if cfg.device.memory_check:
            check_memory(cfg, recipe.name if recipe is not None else "pretrain", found.layout)
    return found


def check_harness(cfg: LadleConfig, recipe: RecipeChecks | None):
    """eval.harness can run: a language model on one copy of the weights, lm-eval installed, the
    tasks known and their data files there (a typo fails here, not after hours of training).
    Returns lm-eval's task index, which the run's evaluations use."""
    from ladle.ops.harness import checked_tasks

    if cfg.model.head != "lm":
        raise ConfigError("eval.harness scores a language model; a reward model (head: score) has no LM head")
    if cfg.parallel.pp > 1:
        raise ConfigError(
            "eval.harness: not with pipeline parallelism yet (parallel.pp > 1); set eval.harness: []"
        )
    if recipe is not None and recipe.placement(cfg) is not None:
        raise ConfigError("eval.harness: not with a separated placement yet; set eval.harness: []")
    return checked_tasks(
        cfg.eval.harness,
        cfg.eval.harness_include_path,
        what="eval.harness",
        field="eval.harness",
        include_field="eval.harness_include_path",
    )


def check_memory(cfg: LadleConfig, recipe: str, layout) -> None:
    """The planner's peak against the device's memory (ladle/plan): refused with the figures and
    the remedies when it does not fit; nothing to check on a CPU unless device.memory is set."""
    check_fits(cfg, recipe, layout, pick_device(cfg.train.device))


def check_data_task(cfg: LadleConfig, recipe: RecipeChecks, meta: dict) -> None:
    """The data is the kind the recipe trains on (meta.json's "task"; pretraining data has none);
    of a mixture, every source's."""
    metas = meta["sources"] if cfg.data.mix is not None else {"data.path": (cfg.data.path, meta)}
    for key, (path, m) in metas.items():
        _check_task(key, path, recipe, m)


def _check_task(key: str, path: str, recipe: RecipeChecks, meta: dict) -> None:
    want, task = recipe.data_task, meta.get("task", "pretrain")
    if task != want:
        how = (
            "`ladle data prepare` (no --task)"
            if want == "pretrain"
            else f"`ladle data prepare --task {want}`"
        )
        raise DataError(
            f"{key} {path} holds {task} data, but recipe {recipe.name} trains on {want} data; "
            f"prepare it with {how}" + (f", or use `ladle run {task}`" if task in ("pretrain", "sft") else "")
        )


def check_output_dir(cfg: LadleConfig) -> None:
    """output_dir is a folder (or will be) and lies outside the run's data and tokenizer: a run
    never writes its checkpoints among them. (A starting model's folder is the resume check's:
    a run directory there holds checkpoints.)"""
    out = Path(cfg.output_dir).resolve()
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"output_dir {cfg.output_dir} exists and is not a folder; choose another output_dir"
        )
    for key, value in (
        ("data.path", cfg.data.path),
        *((f"data.mix source {m.name}'s path", m.path) for m in cfg.data.mix or ()),
        ("tokenizer.path", cfg.tokenizer.path),
    ):
        if not value:
            continue
        inp = Path(value).resolve()
        if out == inp or inp in out.parents:
            raise ConfigError(
                f"output_dir {cfg.output_dir} is {'' if out == inp else 'inside '}{key} {value}: the run would "
                "write among its inputs; choose an output_dir elsewhere"
            )


# -- tokenizer and data ------------------------------------------------------------------------
def check_tokenizer(cfg: LadleConfig):
    tok = load_tokenizer(cfg.tokenizer.path)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the vocabulary of the tokenizer at "
            f"{cfg.tokenizer.path} ({tok.vocab_size} tokens); set model.vocab_size to at least "
            f"{tok.vocab_size} (a multiple of 64 runs fastest: {-(-tok.vocab_size // 64) * 64})"
        )
    return tok


def check_data(cfg: LadleConfig, tok) -> dict:
    """The prepared data exists, was made with this tokenizer, and fits the model. Of a mixture,
    every source's folder (one tokenizer across them): {"sources": {key: (path, meta.json)}}."""
    if cfg.data.mix is None:
        return _check_folder(cfg, "data.path", cfg.data.path, tok)
    sources = {}
    for m in cfg.data.mix:
        key = f"data.mix source {m.name}:"
        sources[key] = (m.path, _check_folder(cfg, key, m.path, tok))
    return {"sources": sources}


def _check_folder(cfg: LadleConfig, key: str, path: str, tok) -> dict:
    try:
        meta = load_meta(path)
        check_files(path, meta, checksums=cfg.data.verify == "checksums")
    except DataError as e:  # a mixture's: which source
        raise DataError(f"{key} {e}" if cfg.data.mix else str(e)) from e
    theirs = meta.get("tokenizer_hash")
    if theirs and theirs != tok.hash:
        raise DataError(
            f"{key} {path} was prepared with a different tokenizer "
            f"({meta.get('tokenizer_path')}, sha256 {theirs[:12]}) than tokenizer.path {cfg.tokenizer.path} "
            f"(sha256 {tok.hash[:12]}); point tokenizer.path at the tokenizer the data was prepared with, "
            f"or run `ladle data prepare --tokenizer {cfg.tokenizer.path} ...` again"
            + (" (a mixture's sources must share one tokenizer)" if cfg.data.mix else "")
        )
    if int(meta.get("vocab_size", 0)) > cfg.model.vocab_size:
        raise ConfigError(
            f"{key} {path} holds token ids up to {meta['vocab_size'] - 1}, beyond "
            f"model.vocab_size ({cfg.model.vocab_size}); raise model.vocab_size"
        )
    return meta
