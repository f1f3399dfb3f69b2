"""The checkpoint folder as files: which checkpoint is whole, which one a run resumes from, the
manifest that says so, and the readers of a checkpoint's config and trainer state. No process
group here: these run in `ladle checkpoint verify`, in the parent of torchrun and in any reader;
the collective side (saving, sharing out the checksums, loading) is ladle/checkpoint/dcp.py.

Layout of `checkpoints/step_00000100/`:

    .metadata, __*_*.distcp   the named stateful parts (DCP: each rank writes its own shards):
                              the policy's `model.*` and `optim.*`, other trained models'
                              under their names (`value_model.model.*`)
    trainer_state.json        step, tokens, data position, scheduler, loss scaler, config hash
    rng/rank_00000.safetensors the RNG state of every rank
    config.yaml               the resolved config of the run that wrote it
    manifest.json             every file above with its size and sha256, written last

A folder is whole when its manifest reads and every file it names has its size and sha256
(`verify`). Resuming takes the newest whole checkpoint (`find_newest`), whatever `latest` says,
and names every newer one it skipped and why; a folder without a manifest is never resumed from.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import yaml

from ladle.checkpoint import safe_dcp
from ladle.errors import CheckpointError

STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "ladle-checkpoint/1"
ALTERED = "its sha256 differs from the manifest's (the file was altered or damaged)"
NO_MANIFEST = "missing: its save never finished, or a ladle from before manifests wrote it"
POLICY = "policy"  # the trained model of a run: its state is the checkpoint's `model` and `optim`
_STEP_DIR = re.compile(r"step_(\d{8})")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.fullmatch(path.name).group(1))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The folder `checkpoints/latest` names, when it is one (whole or not: see `find_newest`)."""
    name = _read_latest(Path(run_dir) / "checkpoints")
    path = Path(run_dir) / "checkpoints" / name if name and _STEP_DIR.fullmatch(name) else None
    return path if path is not None and path.is_dir() else None


def _read_latest(root: Path) -> str | None:
    try:
        with open(root / "latest", "rb") as f:
            return f.read(256).decode("utf-8", "replace").strip()
    except OSError:
        return None


def read_config(ckpt: str | Path) -> dict:
    """The run config a checkpoint was written with (config.yaml), as a dict: the one reader of it."""
    f = Path(ckpt) / CONFIG_FILE
    if not f.is_file():
        raise CheckpointError(f"checkpoint {ckpt} has no config.yaml; it was not written by ladle")
    try:
        cfg = yaml.safe_load(f.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f} is not valid YAML ({e}): the checkpoint is damaged") from e
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise CheckpointError(f"{f} holds no run config with a model section: the checkpoint is damaged")
    return cfg


def read_trainer_state(path: str | Path) -> dict:
    f = Path(path) / STATE_FILE
    if not f.is_file():
        raise CheckpointError(
            f"{path} is not a complete ladle checkpoint (no {STATE_FILE}); point train.resume at a "
            "checkpoints/step_XXXXXXXX folder, or use train.resume=auto"
        )
    try:
        state = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f} is not valid JSON ({e}): the checkpoint is damaged") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{f} holds no trainer state object: the checkpoint is damaged")
    return state


# -- the manifest: every file of a checkpoint with its size and sha256 ------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _writer(name: str) -> int:
    """The rank that wrote a checkpoint file (DCP names a rank's shards __RANK_N.distcp): it
    hashes the file on save, and ranks share the verification the same way on load."""
    m = re.match(r"__(\d+)_|rng/rank_(\d+)\.", name)
    return int(next(g for g in m.groups() if g is not None)) if m else 0


def _entry(f: Path) -> dict:
    return {"bytes": f.stat().st_size, "sha256": _sha256(f)}


def _read_manifest(path: Path) -> tuple[dict | None, str | None]:
    """(the manifest's files, None) or (None, what is wrong with it)."""
    f = path / MANIFEST
    if not f.is_file():
        return None, NO_MANIFEST
    try:
        m = json.loads(f.read_text())
        files = m["files"]
        assert m["format"] == MANIFEST_FORMAT and isinstance(files, dict)
        for name, e in files.items():
            p = PurePosixPath(name)
            assert not p.is_absolute() and ".." not in p.parts, f"a file outside the folder: {name!r}"
            assert isinstance(e["bytes"], int) and isinstance(e["sha256"], str), f"a bad entry for {name!r}"
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, AssertionError) as e:
        return None, f"unreadable ({type(e).__name__}: {e}); it is damaged"
    missing = {safe_dcp.METADATA, STATE_FILE, CONFIG_FILE} - set(files)
    if missing:
        return None, f"names no {', '.join(sorted(missing))}; it is damaged"
    return files, None


def _check_files(path: Path, files: dict, share: tuple[int, int] | None) -> dict[str, str]:
    problems = {}
    for name, e in sorted(files.items()):
        f = path / name
        if not f.is_file():
            problems[name] = "missing"
        elif (size := f.stat().st_size) != e["bytes"]:
            problems[name] = (
                f"{size:,} bytes where the manifest says {e['bytes']:,} (truncated or overwritten)"
            )
        elif share is not None and _writer(name) % share[1] == share[0] and _sha256(f) != e["sha256"]:
            problems[name] = ALTERED
    return problems


def verify(path: str | Path, share: tuple[int, int] | None = (0, 1), *, read: bool = True) -> dict[str, str]:
    """What is wrong with a checkpoint folder, by file ({} when it is whole): the manifest must
    read, every file it names must be there with its size and, for this (rank, world) share of
    the files (all by default; None: none), its sha256, and (read) the DCP part must read
    without running anything (`safe_dcp.check`: the metadata and the optimizer's plain entries)."""
    path = Path(path)
    files, problem = _read_manifest(path)
    if files is None:
        return {MANIFEST: problem}
    problems = _check_files(path, files, share)
    return problems or (safe_dcp.check(path) if read else {})


def describe(problems: dict[str, str]) -> str:
    return "; ".join(f"{name}: {why}" for name, why in sorted(problems.items()))


# -- the folder: which checkpoint to resume from ------------------------------------------------
@dataclass
class Found:
    """What `find_newest` saw in a run's checkpoints folder."""

    path: Path | None = None  # the newest whole checkpoint
    skipped: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # newer, not whole
    latest_problem: str | None = None  # what is wrong with `checkpoints/latest`
    partial: list[Path] = field(default_factory=list)  # saves cut short (.step_*.tmp)
    any: bool = False  # the folder holds checkpoints (or a `latest`) at all


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """The run's checkpoint folders, newest first."""
    root = Path(run_dir) / "checkpoints"
    dirs = [p for p in root.glob("step_*") if _STEP_DIR.fullmatch(p.name) and p.is_dir()]
    return sorted(dirs, key=_step_of, reverse=True)


def find_newest(run_dir: str | Path, check=verify) -> Found:
    """The newest whole checkpoint of a run (checked newest first with `check`), and what was
    wrong with the newer ones and with `latest`."""
    root = Path(run_dir) / "checkpoints"
    dirs = checkpoint_dirs(run_dir)
    found = Found(partial=sorted(root.glob(".step_*.tmp")), any=bool(dirs) or (root / "latest").exists())
    for d in dirs:
        problems = check(d)
        if not problems:
            found.path = d
            break
        found.skipped.append((d.name, problems))
    name = _read_latest(root)
    if (root / "latest").exists() and (
        not name or not _STEP_DIR.fullmatch(name) or not (root / name).is_dir()
    ):
        found.latest_problem = f"checkpoints/latest names {name!r}, which is no checkpoint folder here"
    elif name and found.path is not None and name != found.path.name:
        found.latest_problem = (
            f"checkpoints/latest names {name}, but {found.path.name} is the newest whole one"
        )
    return found


def check_report(path: str | Path) -> dict:
    """`ladle checkpoint verify`: every checkpoint of a run directory (or the one folder given),
    checked in full; which one `train.resume=auto` would continue from; notes on `latest` and on
    saves cut short. `whole` is true when every checkpoint is."""
    p = Path(path)
    if (p / "checkpoints").is_dir():
        dirs, run = checkpoint_dirs(p), p
    elif is_checkpoint(p):
        dirs, run = [p], None
    else:
        raise CheckpointError(f"{path} is neither a checkpoint folder nor a run directory with checkpoints/")
    results = {d: verify(d) for d in dirs}
    checkpoints = []
    for d in dirs:
        files = _read_manifest(d)[0] or {}
        entry = {"path": str(d), "whole": not results[d], "problems": results[d]}
        checkpoints.append({**entry, "files": len(files), "bytes": sum(e["bytes"] for e in files.values())})
    notes = []
    if run is not None:
        found = find_newest(run, check=results.__getitem__)
        notes += [found.latest_problem] if found.latest_problem else []
        notes += [f"{t}: a save that was cut short; the next resume removes it" for t in found.partial]
        resume = found.path.name if found.path else "nowhere: no checkpoint is whole"
        notes.append(f"train.resume=auto continues from {resume}" if dirs else f"{run} holds no checkpoints")
    return {"checkpoints": checkpoints, "notes": notes, "whole": all(c["whole"] for c in checkpoints)}


def is_checkpoint(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and any((p / n).exists() for n in (MANIFEST, STATE_FILE, safe_dcp.METADATA))
