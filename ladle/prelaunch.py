"""Everything decided and checked before a run starts, in one place: `ladle validate`, the parent
of a multi-process `ladle run` (before torchrun starts N processes) and every training process
call it, so each refusal comes before anything is written.

- `model.init_from`: the model shape comes from the Hugging Face folder or ladle checkpoint it
  names (`resolve_config`);
- the tokenizer and the prepared data: they exist, agree with each other and the model, and hold
  the kind of data the recipe declares (`DATA_TASK` in its module);
- the parallel layout for the world size (`check_layout`, ladle/parallel/mesh.py);
- the resume decision: a fresh start, or which checkpoint (`resolve_resume`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

from pydantic import ValidationError

from ladle.config.load import config_hash, format_validation_error
from ladle.config.schema import LadleConfig, ModelConfig
from ladle.errors import CheckpointError, ConfigError, DataError
from ladle.models.hf import is_hf_folder, read_hf_config
from ladle.train import loggers
from ladle.train.checkpoint import (
    Found,
    checkpoint_dirs,
    describe,
    find_newest,
    is_checkpoint,
    read_config,
    read_trainer_state,
    resolve_checkpoint,
    verify,
)


@dataclass
class Checked:
    """What the checks found: the config with init_from resolved, the layout (when a world size
    was given), the tokenizer and the data folder's meta.json (when paths were checked)."""

    cfg: LadleConfig
    layout: object = None  # ladle.parallel.mesh.Layout
    tokenizer: object = None  # ladle.tokenizer.Tokenizer
    meta: dict | None = None

    def __getitem__(self, key):  # found["tokenizer"], found["meta"]
        return getattr(self, key)


def check(cfg: LadleConfig, recipe: str | None = None, world: int = 0, paths: bool = True) -> Checked:
    """The config as every process will see it: `init_from` resolved, tokenizer and data checked
    against each other, the model and the recipe's data task (unless paths=False: they exist only
    on the cluster), and the parallel layout for `world` processes (when given)."""
    from ladle.parallel.mesh import check_layout

    found = Checked(cfg)
    loggers.check(cfg)
    if paths:
        check_output_dir(cfg)
        found.cfg = cfg = resolve_config(cfg)
        found.tokenizer = check_tokenizer(cfg)
        found.meta = check_data(cfg, found.tokenizer)
    module = None
    if recipe is not None:
        from ladle.recipes import load

        module = load(recipe)
    if paths and module is not None:
        check_data_task(cfg, recipe, found.meta)
        check_paths = getattr(module, "check_paths", None)  # the other models a recipe reads
        if check_paths:
            check_paths(cfg)
    if world:
        placement = getattr(module, "placement", None)  # (groups of ranks, what they hold) or None
        found.layout = check_layout(cfg, world, *((placement and placement(cfg)) or ()))
        layout_check = getattr(module, "check_layout", None)
        if layout_check:  # what a recipe cannot run on (the pair recipes: pp, cp)
            layout_check(cfg, found.layout)
        if cfg.device.memory_check:
            check_memory(cfg, recipe or "pretrain", found.layout)
    return found


def check_memory(cfg: LadleConfig, recipe: str, layout) -> None:
    """The planner's peak against the device's memory (ladle/plan): refused with the figures and
    the remedies when it does not fit; nothing to check on a CPU unless device.memory is set."""
    from ladle.device import pick_device
    from ladle.plan import check_fits

    check_fits(cfg, recipe, layout, pick_device(cfg.train.device))


def data_task(recipe: str) -> str:
    """The data a recipe trains on (meta.json's "task"; pretraining data has none), which the
    recipe module declares as DATA_TASK."""
    from ladle.recipes import load

    return load(recipe).DATA_TASK


def check_data_task(cfg: LadleConfig, recipe: str, meta: dict) -> None:
    want, task = data_task(recipe), meta.get("task", "pretrain")
    if task != want:
        how = (
            "`ladle data prepare` (no --task)"
            if want == "pretrain"
            else f"`ladle data prepare --task {want}`"
        )
        raise DataError(
            f"data.path {cfg.data.path} holds {task} data, but recipe {recipe} trains on {want} data; "
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
    from ladle.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.tokenizer.path)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the vocabulary of the tokenizer at "
            f"{cfg.tokenizer.path} ({tok.vocab_size} tokens); set model.vocab_size to at least "
            f"{tok.vocab_size} (a multiple of 64 runs fastest: {-(-tok.vocab_size // 64) * 64})"
        )
    return tok


def check_data(cfg: LadleConfig, tok) -> dict:
    """The prepared data exists, was made with this tokenizer, and fits the model."""
    from ladle.data.folder import check_files
    from ladle.data.prepare import load_meta

    meta = load_meta(cfg.data.path)
    check_files(cfg.data.path, meta, checksums=cfg.data.verify == "checksums")
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


# -- model.init_from ---------------------------------------------------------------------------
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


# -- the resume decision -----------------------------------------------------------------------
@dataclass
class Resume:
    """The decision `resolve_resume` takes: where from, why, and what it saw on the way."""

    path: Path | None  # the checkpoint to resume from; None: a fresh start
    restart: str | None = None  # why this is a restarted attempt, when it is one
    found: Found | None = None  # the checkpoints folder as `find_newest` saw it
    changed: tuple[str, ...] = ()  # what differs from the checkpoint's data (train.allow_data_change)

    @property
    def step(self) -> int:
        return int(read_trainer_state(self.path)["step"]) if self.path else 0


def resolve_resume(cfg: LadleConfig, restart: str | None = None, check=verify) -> Resume:
    """Where a run starts: a fresh start, or the checkpoint to resume. Refuses to start over a
    run's checkpoints unless asked to resume (or a restarted attempt), to resume a checkpoint of
    another model shape, and to resume when no checkpoint of the run is whole; never starts over
    there. `check(path)` -> problems by file ({} when whole); `verify` by default."""
    out = Path(cfg.output_dir)
    mode = "auto" if restart else cfg.train.resume
    if mode == "never":
        dirs = checkpoint_dirs(out)
        if dirs or (out / "checkpoints" / "latest").exists():
            newest = dirs[0].name if dirs else "none whole"
            try:
                theirs = read_trainer_state(dirs[0]).get("config_hash", "?")
            except (CheckpointError, IndexError):
                theirs = "?"
            same = (
                "this same config" if theirs == config_hash(cfg) else f"another config (hash {theirs[:12]})"
            )
            raise ConfigError(
                f"output_dir {out} already holds checkpoints of a run with {same} (newest: {newest}); "
                "set train.resume=auto to continue it, or choose another output_dir"
            )
        if (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size:
            raise ConfigError(
                f"output_dir {out} already holds a run's metrics.jsonl; set train.resume=auto to continue "
                "it (from its last checkpoint, or afresh if it has none), or choose another output_dir"
            )
        return Resume(None)
    found = None
    if mode == "auto":
        found = find_newest(out, check)
        if found.path is None and found.any:
            why = "; ".join(f"{name}: {describe(p)}" for name, p in found.skipped) or found.latest_problem
            raise CheckpointError(
                f"output_dir {out} holds checkpoints, but none is whole ({why}). ladle does not start "
                "over a run's checkpoints: repair or move them away, or choose another output_dir"
            )
        path = found.path
    else:
        path = Path(mode)
        problems = check(path) if path.is_dir() else {str(path): "no such checkpoint folder"}
        if problems:
            raise CheckpointError(
                f"cannot resume from {path}: {describe(problems)}; resume from another checkpoint "
                f"(`ladle checkpoint verify {out}` lists the whole ones) or use train.resume=auto"
            )
    if path is None:
        return Resume(None, restart, found)
    read_trainer_state(path)  # raises when not a complete checkpoint
    theirs = read_config(path)
    mine = cfg.model.model_dump(mode="json")
    old = theirs.get("model", {})
    diff = [f"model.{k} ({old.get(k)!r} there, {v!r} here)" for k, v in mine.items() if old.get(k) != v]
    if diff:
        raise CheckpointError(
            f"cannot resume from {path}: its model differs in {'; '.join(diff)}; "
            "resume with the model it was trained with, or start a new output_dir"
        )
    changed = data_changes(cfg, read_trainer_state(path).get("data_identity"))
    if changed and not cfg.train.allow_data_change:
        raise DataError(
            f"cannot resume from {path}: {'; '.join(changed)} since it was saved. The data order continues "
            "by sample count, so other data means other samples: restore them, or set "
            "train.allow_data_change=true to resume anyway, or start a new output_dir"
        )
    return Resume(path, restart, found, tuple(changed))


def data_identity(cfg: LadleConfig, tokenizer=None) -> dict:
    """What a run trains on, kept in each checkpoint: the tokenizer's sha256 and the data
    folder's fingerprint (its files' sizes and checksums, as meta.json records them).
    `tokenizer`: the one `check` loaded (else it is loaded here)."""
    from ladle.data.folder import fingerprint
    from ladle.tokenizer import load_tokenizer

    tok = tokenizer or load_tokenizer(cfg.tokenizer.path)
    return {"tokenizer": tok.hash, "data": fingerprint(cfg.data.path)}


def data_changes(cfg: LadleConfig, theirs: dict | None) -> list[str]:
    """What differs from a checkpoint's `data_identity` (none recorded: nothing to compare)."""
    if not theirs:
        return []
    mine = data_identity(cfg)
    where = {
        "tokenizer": f"the tokenizer at tokenizer.path {cfg.tokenizer.path}",
        "data": f"the data at data.path {cfg.data.path}",
    }
    return [
        f"{where[k]} changed (sha256 {theirs[k][:12]} at the checkpoint, {mine[k][:12]} now)"
        for k in ("tokenizer", "data")
        if theirs.get(k) and theirs[k] != mine[k]
    ]


def parent_resume_check(cfg: LadleConfig) -> Resume:
    """The resume decision as the parent of a multi-process run takes it, before the workers
    start: the checkpoints' sizes only (the workers share out the checksums)."""
    from ladle.train.run import restart_reason

    return resolve_resume(cfg, restart_reason(cfg.output_dir), check=partial(verify, share=None))


def worker_resume(cfg: LadleConfig, device) -> Resume:
    """The resume decision in the training processes, which all take the same one: a restart on
    one rank is one on all (a replaced node's own attempt count starts at 0), and the ranks share
    out the checksums of the checkpoints they consider."""
    from ladle import distributed as dist
    from ladle.train.checkpoint import verify_on_all_ranks
    from ladle.train.run import restart_reason

    restart = restart_reason(cfg.output_dir)
    if dist.any_rank(restart is not None, device):
        restart = restart or "another rank's attempt is a restart of this job"
    return resolve_resume(cfg, restart, check=verify_on_all_ranks)
