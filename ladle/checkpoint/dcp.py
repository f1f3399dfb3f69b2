"""Checkpoints of the whole training state through torch.distributed.checkpoint (DCP), on every
rank: saving named stateful parts, the manifest written collectively, the checksums shared out
over the ranks on load, and the readers of weights. The folder itself (what is whole, which one a
run resumes from) is ladle/checkpoint/catalogue.py.

Nothing is pickled: DCP tensors, JSON and safetensors only, and DCP's own pickled `.metadata` is
read by an unpickler that runs nothing (ladle/checkpoint/safe_dcp.py). A checkpoint is written under a
temporary name (`.step_00000100.tmp`); its manifest is written when every rank's files are on
disk, then the folder is renamed, and only then is `checkpoints/latest` (a text file with the
folder name) replaced, atomically. Old checkpoints are removed only after a newer one is whole.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from ladle import distributed as dist
from ladle import faults
from ladle.checkpoint import safe_dcp
from ladle.checkpoint.catalogue import (
    ALTERED,
    CONFIG_FILE,
    MANIFEST,
    MANIFEST_FORMAT,
    NO_MANIFEST,
    POLICY,
    STATE_FILE,
    _check_files,
    _entry,
    _read_manifest,
    checkpoint_dirs,
    describe,
    find_newest,
    is_checkpoint,
    latest_checkpoint,
    read_config,
    read_trainer_state,
    step_dir_name,
    verify,
)
from ladle.config import CheckpointConfig
from ladle.errors import CheckpointError

# Frozen parameters (the base of an adapter run) are not saved: they come from model.init_from.
TRAINABLE = StateDictOptions(ignore_frozen_params=True)


def _write_manifest(tmp: Path, step: int) -> None:
    """Collective: each rank hashes the files it wrote (its DCP shards, its RNG state) into a part
    file; rank 0 merges the parts, adds the rest (the metadata, trainer state, config, any file
    no rank claimed) and writes `manifest.json`, the last file of the checkpoint."""
    rank = dist.rank()
    mine = [*tmp.glob(f"__{rank}_*.distcp"), tmp / "rng" / f"rank_{rank:05d}.safetensors"]
    _write_json(
        tmp / f".manifest.rank_{rank:05d}.json", {f.relative_to(tmp).as_posix(): _entry(f) for f in mine}
    )
    dist.barrier()
    if dist.is_main():
        files = {}
        for part in sorted(tmp.glob(".manifest.rank_*.json")):
            files.update(json.loads(part.read_text()))
            part.unlink()
        for f in sorted(tmp.rglob("*")):
            if f.is_file() and f.relative_to(tmp).as_posix() not in files:
                files[f.relative_to(tmp).as_posix()] = _entry(f)
        _write_json(tmp / MANIFEST, {"format": MANIFEST_FORMAT, "step": step, "files": files})


def verify_on_all_ranks(path: str | Path) -> dict[str, str]:
    """`verify` with the checksums shared out over the ranks of the process group (collective)."""
    rank, world = dist.rank(), dist.world_size()
    if world == 1:
        return verify(path)
    path = Path(path)
    files, problem = _read_manifest(path)  # the same file, so the same answer, on every rank
    if files is None:
        return {MANIFEST: problem}
    problems = _check_files(path, files, (rank, world))
    names = sorted(files)
    bad = torch.tensor([n in problems for n in names], dtype=torch.int64, device=dist.collective_device())
    for name, flag in zip(names, dist.all_reduce_max(bad).tolist(), strict=True):
        if flag and name not in problems:  # a checksum another rank computed
            problems[name] = ALTERED
    if problems:
        return problems
    # The pickles are read once, on rank 0 (a large job's metadata is large), and rank 0 names them.
    content = safe_dcp.check(path) if rank == 0 else {}
    if dist.any_rank(bool(content), dist.collective_device()):
        return content or {safe_dcp.METADATA: "refused by rank 0's check, which events.log names"}
    return {}


def _legacy_ok(check):
    """`check`, but a checkpoint from before manifests passes, with a warning: readers of weights
    still take them; resuming does not."""

    def checked(d: Path) -> dict[str, str]:
        problems = check(d)
        if problems == {MANIFEST: NO_MANIFEST} and (d / STATE_FILE).is_file():
            if dist.is_main():
                print(
                    f"warning: {d} has no {MANIFEST} (an older ladle wrote it): read unverified",
                    file=sys.stderr,
                )
            return {}
        return problems

    return checked


def resolve_checkpoint(path: str | Path, check=verify_on_all_ranks) -> Path:
    """The checkpoint folder a reader of weights (init_from, export, generate, eval) takes: the
    folder itself when whole, or a run directory's (or its `checkpoints/latest` file's) newest
    whole one, naming on stderr the newer ones it skipped. Refuses a damaged folder, naming its
    files. `check` is collective (the ranks share out the checksums) unless replaced."""
    p = Path(path)
    if p.is_file() and p.name == "latest":
        p = p.parent.parent
    check = _legacy_ok(check)
    if is_checkpoint(p):
        problems = check(p)
        if problems:
            raise CheckpointError(
                f"the checkpoint {p} is damaged: {describe(problems)}. Use another checkpoint of the run "
                "(`ladle checkpoint verify RUN_DIR` lists the whole ones)"
            )
        return p
    if (p / "checkpoints").is_dir():
        found = find_newest(p, check)
        if found.path is None:
            why = "; ".join(f"{n}: {describe(pr)}" for n, pr in found.skipped) or "it holds none"
            raise CheckpointError(f"the run directory {p} has no whole checkpoint ({why})")
        if dist.is_main():
            for name, problems in found.skipped:
                print(f"warning: skipped {name}, it is damaged: {describe(problems)}", file=sys.stderr)
            if found.latest_problem:
                print(f"warning: {found.latest_problem}", file=sys.stderr)
        return found.path
    raise CheckpointError(
        f"{path} is not a ladle checkpoint (no {STATE_FILE}) nor a run directory with checkpoints/"
    )


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type != "cpu" and torch.accelerator.is_available():
        state["accelerator"] = torch.get_device_module(device.type).get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "accelerator" in state and device.type != "cpu":
        torch.get_device_module(device.type).set_rng_state(state["accelerator"], device)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


class Checkpointer:
    """Saves and loads the training state of (model, optimizer) plus a JSON-able `extra` dict."""

    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig, device: torch.device, log=print):
        self.root = Path(run_dir) / "checkpoints"
        self.cfg = cfg
        self.device = device
        self.log = log
        self._pending = None  # (future, tmp, final, extra, config_yaml, started)
        self.last_stall_s = 0.0

    # -- saving ----------------------------------------------------------------------------
    def save(self, step: int, parts: dict, extra: dict, config_yaml: str, *, blocking: bool = False) -> None:
        """Saves the named stateful `parts` (`state_dict()` -> what DCP saves; the trained policy
        is `POLICY`), the JSON-able `extra` and the run's config as step `step`."""
        self.wait()  # at most one save in flight
        final = self.root / step_dir_name(step)
        tmp = self.root / f".{final.name}.tmp"
        t0 = time.perf_counter()
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        state = dcp_state(parts)
        try:
            (tmp / "rng").mkdir(exist_ok=True)
            save_file(_rng_state(self.device), str(tmp / "rng" / f"rank_{dist.rank():05d}.safetensors"))
            if self.cfg.async_save and not blocking:
                future = dcp.async_save(state, checkpoint_id=str(tmp))
                self._pending = (future, tmp, final, extra, config_yaml, t0)
                self.last_stall_s = time.perf_counter() - t0
                return
            dcp.save(state, checkpoint_id=str(tmp))
        except Exception as e:
            self._abort(tmp, step, e)
        self.last_stall_s = time.perf_counter() - t0
        self._finish(tmp, final, extra, config_yaml)

    def poll(self) -> None:
        """Finishes an async save whose writing has completed (called once a step)."""
        if self._pending is not None and dist.any_rank(not self._pending[0].done(), self.device) is False:
            self.wait()

    def wait(self) -> None:
        if self._pending is None:
            return
        future, tmp, final, extra, config_yaml, t0 = self._pending
        self._pending = None
        try:
            future.result()
        except Exception as e:
            self._abort(tmp, extra.get("step"), e)
        self._finish(tmp, final, extra, config_yaml)
        self.log(f"async checkpoint {final.name} complete ({time.perf_counter() - t0:.1f}s after it started)")

    def _abort(self, tmp: Path, step, err: Exception) -> None:
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        prev = latest_checkpoint(self.root.parent)
        kept = (
            f"the previous checkpoint {prev.name} is intact and `latest` still points to it"
            if prev
            else "no earlier checkpoint exists"
        )
        raise CheckpointError(
            f"saving the checkpoint of step {step} to {self.root} failed: {err}; {kept}. "
            "Free disk space (or set checkpoint.keep_last lower) and resume with train.resume=auto"
        ) from err

    def _finish(self, tmp: Path, final: Path, extra: dict, config_yaml: str) -> None:
        dist.barrier()  # every rank's DCP shards and RNG state are on disk
        faults.at("save", extra["step"])
        try:
            if dist.is_main():
                _write_json(tmp / STATE_FILE, extra)
                (tmp / CONFIG_FILE).write_text(config_yaml)
            dist.barrier()
            _write_manifest(tmp, extra["step"])  # collective; the manifest is the last file
            if dist.is_main():
                if final.exists():  # the same step saved again (e.g. SIGTERM right after a save)
                    shutil.rmtree(final)
                os.replace(tmp, final)
                latest_tmp = self.root / "latest.tmp"
                latest_tmp.write_text(final.name + "\n")
                os.replace(latest_tmp, self.root / "latest")
        except OSError as e:
            self._abort(tmp, extra.get("step"), e)
        if dist.is_main():
            self._prune(keep=final)
        dist.barrier()

    def _prune(self, keep: Path) -> None:
        """Removes whole checkpoints beyond the newest `keep_last` whole ones, and only when the
        one just written is the newest checkpoint and whole: while a newer one is damaged (a resume
        skipped it), nothing is removed. Damaged ones are never removed (a resume names them)."""
        dirs = checkpoint_dirs(self.root.parent)
        if not dirs or dirs[0] != keep or verify(keep, share=None, read=False):
            return
        whole = [d for d in dirs if not verify(d, share=None, read=False)]
        for old in whole[self.cfg.keep_last :]:
            shutil.rmtree(old, ignore_errors=True)

    # -- loading ---------------------------------------------------------------------------
    def load(self, path: str | Path, parts: dict) -> dict:
        """Fills the named stateful `parts` in place from `path` (already verified: `find_newest`);
        returns the trainer state dict. DCP reshards the saved layout into this one."""
        path = Path(path)
        extra = read_trainer_state(path)
        state = dcp_state(parts)
        _read_dcp(state, path)
        for name, part in parts.items():
            part.load_state_dict(state if name == POLICY else state[name])
        rng = path / "rng" / f"rank_{dist.rank():05d}.safetensors"
        if rng.is_file():
            _set_rng_state(load_file(str(rng)), self.device)
        else:
            self.log(f"{path} has no RNG state for rank {dist.rank()} (different world size); RNG reseeded")
        return extra


def dcp_state(parts: dict) -> dict:
    """The DCP state of named stateful parts. The policy's keys sit at the top (`model.*`,
    `optim.*`), as in checkpoints of one model, so those and weight readers (export, init_from)
    work unchanged; every other part's sit under its name (`value_model.model.*`)."""
    state = {}
    for name, part in parts.items():
        if name == POLICY:
            state.update(part.state_dict())
        else:
            state[name] = part.state_dict()
    return state


def _read_dcp(state: dict, path: Path) -> None:
    with warnings.catch_warnings():  # one process reading any layout's shards is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        safe_dcp.load(state, path)


def load_model_weights(path: str | Path, model, *, base_only: bool = False) -> None:
    """Only the model part of a training checkpoint, into a plain or laid-out model (DCP reshards
    the saved layout into this one): for init_from, generate, eval and export. An adapter run's
    checkpoint holds only the adapters: then the base must already be in `model`, and only its
    trainable parameters are read. base_only: read a full checkpoint into the base of an adapted
    model (its adapters left as they are). `path` comes from `resolve_checkpoint`, which checked it."""
    adapters = bool(read_trainer_state(path).get("adapters_only"))
    msd = get_model_state_dict(model, options=TRAINABLE if adapters else None)
    if base_only:
        msd = {k: v for k, v in msd.items() if ".lora_" not in k}
    # A reward model started from a causal LM's checkpoint: its score head keeps its init.
    fresh_head = "score.weight" in msd and read_config(path)["model"].get("head", "lm") != "score"
    if fresh_head:
        msd = {k: v for k, v in msd.items() if not k.startswith("score.")}
    _read_dcp({"model": msd}, Path(path))
    # Not strict when part of the model is deliberately left out; the read has found every key asked.
    strict = not (adapters or base_only or fresh_head)
    set_model_state_dict(model, msd, options=StateDictOptions(strict=strict, ignore_frozen_params=adapters))
