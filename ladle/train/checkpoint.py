"""Checkpoints of the whole training state, through torch.distributed.checkpoint (DCP).

Layout of `checkpoints/step_00000100/`:

    .metadata, __*_*.distcp   model and optimizer (DCP: each rank writes its own shards)
    trainer_state.json        step, tokens, data position, scheduler, loss scaler, config hash
    rng/rank_00000.safetensors the RNG state of every rank
    config.yaml               the resolved config of the run that wrote it

Nothing is pickled: DCP tensors, JSON and safetensors only. A checkpoint is written under a
temporary name (`.step_00000100.tmp`), renamed when every rank has finished, and only then is
`checkpoints/latest` (a text file with the folder name) replaced, atomically. Old checkpoints are
removed only after a newer one is complete, so a crash or a full disk at any moment leaves the
previous checkpoint whole and `latest` pointing to it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ladle import distributed as dist
from ladle.config import CheckpointConfig
from ladle.errors import CheckpointError

STATE_FILE = "trainer_state.json"
# Frozen parameters (the base of an adapter run) are not saved: they come from model.init_from.
TRAINABLE = StateDictOptions(ignore_frozen_params=True)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    ckpt_root = Path(run_dir) / "checkpoints"
    latest = ckpt_root / "latest"
    if not latest.is_file():
        return None
    path = ckpt_root / latest.read_text().strip()
    return path if (path / STATE_FILE).is_file() else None


def read_trainer_state(path: str | Path) -> dict:
    f = Path(path) / STATE_FILE
    if not f.is_file():
        raise CheckpointError(
            f"{path} is not a complete ladle checkpoint (no {STATE_FILE}); point train.resume at a "
            "checkpoints/step_XXXXXXXX folder, or use train.resume=auto"
        )
    return json.loads(f.read_text())


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
    def save(
        self, step: int, model, optimizer, extra: dict, config_yaml: str, *, blocking: bool = False
    ) -> None:
        self.wait()  # at most one save in flight
        final = self.root / step_dir_name(step)
        tmp = self.root / f".{final.name}.tmp"
        t0 = time.perf_counter()
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        msd, osd = get_state_dict(model, optimizer, options=TRAINABLE)
        state = {"model": msd, "optim": osd}
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
        dist.barrier()
        if dist.is_main():
            try:
                _write_json(tmp / STATE_FILE, extra)
                (tmp / "config.yaml").write_text(config_yaml)
                if final.exists():  # the same step saved again (e.g. SIGTERM right after a save)
                    shutil.rmtree(final)
                os.replace(tmp, final)
                latest_tmp = self.root / "latest.tmp"
                latest_tmp.write_text(final.name + "\n")
                os.replace(latest_tmp, self.root / "latest")
            except OSError as e:
                self._abort(tmp, extra.get("step"), e)
            self._prune(keep=final)
        dist.barrier()

    def _prune(self, keep: Path) -> None:
        done = sorted(p for p in self.root.glob("step_*") if (p / STATE_FILE).is_file())
        for old in done[: max(0, len(done) - self.cfg.keep_last)]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)

    # -- loading ---------------------------------------------------------------------------
    def load(self, path: str | Path, model, optimizer) -> dict:
        """Fills model and optimizer in place from `path`; returns the trainer state dict."""
        path = Path(path)
        extra = read_trainer_state(path)
        msd, osd = get_state_dict(model, optimizer, options=TRAINABLE)
        state = {"model": msd, "optim": osd}
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as e:
            raise CheckpointError(f"could not load the checkpoint {path}: {e}") from e
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            # Not strict: the frozen base is not in the state (TRAINABLE). Every key that is was
            # found in the checkpoint, or dcp.load above would have failed.
            options=StateDictOptions(strict=False, ignore_frozen_params=True),
        )
        rng = path / "rng" / f"rank_{dist.rank():05d}.safetensors"
        if rng.is_file():
            _set_rng_state(load_file(str(rng)), self.device)
        else:
            self.log(f"{path} has no RNG state for rank {dist.rank()} (different world size); RNG reseeded")
        return extra


def load_model_weights(path: str | Path, model, *, base_only: bool = False) -> None:
    """Only the model part of a training checkpoint, into a plain or laid-out model (DCP reshards
    the saved layout into this one): for init_from, generate, eval and export. An adapter run's
    checkpoint holds only the adapters: then the base must already be in `model`, and only its
    trainable parameters are read. base_only: read a full checkpoint into the base of an adapted
    model (its adapters left as they are)."""
    adapters = bool(read_trainer_state(path).get("adapters_only"))
    msd = get_model_state_dict(model, options=TRAINABLE if adapters else None)
    if base_only:
        msd = {k: v for k, v in msd.items() if ".lora_" not in k}
    try:
        with warnings.catch_warnings():  # one process reading any layout's shards is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": msd}, checkpoint_id=str(path))
    except Exception as e:
        raise CheckpointError(f"could not load model weights from the checkpoint {path}: {e}") from e
    # Not strict when part of the model is deliberately left out; dcp.load has found every key asked.
    strict = not (adapters or base_only)
    set_model_state_dict(model, msd, options=StateDictOptions(strict=strict, ignore_frozen_params=adapters))
