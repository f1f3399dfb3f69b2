"""Checkpoints that can be trusted: the manifest, damaged checkpoints skipped (and named) on
resume, a run that never starts over its own checkpoints, loading that runs nothing from a
crafted checkpoint, a kill in the middle of a save, and `ladle checkpoint verify`."""

import ast
import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

import ladle
from ladle.checkpoint import safe_dcp
from ladle.checkpoint.catalogue import checkpoint_dirs, latest_checkpoint, verify
from ladle.checkpoint.dcp import Checkpointer
from ladle.cli import main
from ladle.config.load import build_config
from ladle.errors import CheckpointError
from ladle.recipes import pretrain
from ladle.train.metrics import read_metrics

STEPS = 12


def losses(run_dir):
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(run_dir) if "loss" in r}


def config(tiny_config, out, **train) -> dict:
    d = json.loads(json.dumps(tiny_config))
    d["output_dir"] = str(out)
    d["train"].update(max_steps=STEPS, eval_every=0, eval_steps=0, **train)
    d["checkpoint"] = {"every": 4, "keep_last": 3}
    d["sample"]["max_new_tokens"] = 0
    return d


def run(cfg_dict, *overrides):
    return pretrain.run(build_config(cfg_dict, list(overrides)))


@pytest.fixture
def uninterrupted(tiny_config, tmp_path):
    out = tmp_path / "full"
    assert run(config(tiny_config, out)) == "completed"
    return losses(out)


@pytest.fixture
def stopped(tiny_config, tmp_path):
    """A run stopped after step 8 with whole checkpoints at steps 4 and 8, and its config file."""
    out = tmp_path / "run"
    cfg = config(tiny_config, out)
    assert run(cfg, "train.exit_at_step=8") == "exit"
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(cfg))
    return out, f


def ckpt(out, step):
    return out / "checkpoints" / f"step_{step:08d}"


def resume_cli(cfg_file, *extra):
    return main(["run", "pretrain", "--config", str(cfg_file), "train.resume=auto", *extra])


def events(out):
    return (out / "events.log").read_text()


def snapshot(folder: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def rewrite_manifest(folder: Path) -> None:
    """What a forger does: a manifest that matches the files as they are now."""
    m = json.loads((folder / "manifest.json").read_text())
    m["files"] = {
        n: {
            "bytes": (folder / n).stat().st_size,
            "sha256": hashlib.sha256((folder / n).read_bytes()).hexdigest(),
        }
        for n in m["files"]
    }
    (folder / "manifest.json").write_text(json.dumps(m))


MARKER = "ladle-test-pwned"


class Payload:
    """A pickle that, unpickled by an unguarded reader, creates a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def craft_metadata(folder: Path, marker: Path) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    rewrite_manifest(folder)


def craft_optimizer_entry(folder: Path, marker: Path) -> None:
    """The checkpoint re-saved by DCP with the optimizer's lr replaced by the payload."""
    md = safe_dcp.read_metadata(folder)
    state = {
        k: torch.zeros(v.size, dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata) else 0.0
        for k, v in md.state_dict_metadata.items()
    }
    state["optim.param_groups.0.lr"] = Payload(marker)
    for f in folder.glob("__*.distcp"):
        f.unlink()
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    rewrite_manifest(folder)


# -- the manifest ---------------------------------------------------------------------------------
def test_manifest_names_every_file_with_its_size_and_sha256(stopped, capsys):
    out, _ = stopped
    folder = ckpt(out, 8)
    files = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} - {"manifest.json"}
    m = json.loads((folder / "manifest.json").read_text())
    assert m["step"] == 8 and set(m["files"]) == files
    assert {".metadata", "trainer_state.json", "config.yaml", "rng/rank_00000.safetensors"} <= files
    for name, e in m["files"].items():
        data = (folder / name).read_bytes()
        assert e == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert main(["checkpoint", "verify", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"{folder}: whole (5 files" in text and "train.resume=auto continues from step_00000008" in text


# -- damaged checkpoints: resume falls back to the newest whole one, and says so ------------------
def test_a_damaged_latest_resumes_from_the_newest_whole_checkpoint(stopped, uninterrupted, capsys):
    out, cfg_file = stopped
    before = read_metrics(out)
    (out / "checkpoints" / "latest").write_text("oops\n")  # the stray word
    assert resume_cli(cfg_file) == 0
    log = events(out)
    assert (
        "checkpoints/latest names 'oops', which is no checkpoint folder here; resuming from step_00000008"
        in log
    )
    assert f"resumed from {ckpt(out, 8)} at step 8" in log and "training from step 8 to 12" in log
    assert "latest names 'oops'" in capsys.readouterr().out  # on the console too
    assert read_metrics(out)[: len(before)] == before  # the first run's records kept
    assert losses(out) == uninterrupted


def truncate(folder, marker):
    f = folder / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:1000])


def delete_rng(folder, marker):
    (folder / "rng" / "rank_00000.safetensors").unlink()


def flip_a_byte(folder, marker):  # the same size: only the checksum sees it
    f = folder / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def forge_manifest(folder, marker):
    m = json.loads((folder / "manifest.json").read_text())
    m["files"]["trainer_state.json"]["sha256"] = "0" * 64
    (folder / "manifest.json").write_text(json.dumps(m))


def drop_manifest(folder, marker):
    (folder / "manifest.json").unlink()


DAMAGE = {
    "truncated file": (truncate, "__0_0.distcp: 1,000 bytes where the manifest says"),
    "missing file": (delete_rng, "rng/rank_00000.safetensors: missing"),
    "altered file": (flip_a_byte, "__0_0.distcp: its sha256 differs from the manifest's"),
    "manifest that does not match": (forge_manifest, "trainer_state.json: its sha256 differs"),
    "no manifest": (drop_manifest, "manifest.json: missing: its save never finished"),
    "crafted .metadata": (craft_metadata, ".metadata: is not DCP checkpoint metadata"),
    "crafted optimizer entry": (
        craft_optimizer_entry,
        "__0_0.distcp: its entry 'optim.param_groups.0.lr' is not plain data",
    ),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_skipped_and_named(stopped, uninterrupted, tmp_path, damage):
    out, cfg_file = stopped
    how, message = DAMAGE[damage]
    marker = tmp_path / MARKER
    how(ckpt(out, 8), marker)
    assert resume_cli(cfg_file) == 0
    log = events(out)
    assert f"checkpoint step_00000008 skipped, it is not whole: {message}" in log
    assert "resuming from step_00000004" in log and f"resumed from {ckpt(out, 4)} at step 4" in log
    assert losses(out) == uninterrupted  # steps 5-8 trained again, exactly as before
    assert not marker.exists()


def test_no_whole_checkpoint_stops_with_exit_2_and_touches_nothing(stopped, tmp_path, capsys):
    out, cfg_file = stopped
    truncate(ckpt(out, 4), None)
    craft_metadata(ckpt(out, 8), tmp_path / MARKER)
    before = snapshot(out)
    assert resume_cli(cfg_file) == 2
    err = capsys.readouterr().err
    assert (
        f"output_dir {out} holds checkpoints, but none is whole (step_00000008: .metadata: is not DCP" in err
    )
    assert "step_00000004: __0_0.distcp: 1,000 bytes where the manifest says" in err
    assert "does not start over a run's checkpoints" in err
    assert snapshot(out) == before and not (tmp_path / MARKER).exists()
    # the same before torchrun would start several processes
    assert main(["run", "pretrain", "--config", str(cfg_file), "--nproc", "2", "train.resume=auto"]) == 2
    assert "none is whole" in capsys.readouterr().err
    assert snapshot(out) == before


def test_a_fresh_start_over_damaged_checkpoints_is_still_refused(stopped, capsys):
    out, cfg_file = stopped
    for step in (4, 8):
        truncate(ckpt(out, step), None)
    (out / "checkpoints" / "latest").write_text("garbage")
    before = snapshot(out)
    assert main(["run", "pretrain", "--config", str(cfg_file)]) == 2
    assert f"output_dir {out} already holds checkpoints" in capsys.readouterr().err
    assert snapshot(out) == before


def test_an_explicit_damaged_checkpoint_is_refused_by_name(stopped, capsys):
    out, cfg_file = stopped
    truncate(ckpt(out, 8), None)
    assert main(["run", "pretrain", "--config", str(cfg_file), f"train.resume={ckpt(out, 8)}"]) == 2
    assert f"cannot resume from {ckpt(out, 8)}: __0_0.distcp: 1,000 bytes" in capsys.readouterr().err


# -- loading runs nothing from a crafted checkpoint -----------------------------------------------
@pytest.mark.parametrize("command", ["export", "generate", "eval", "init_from"])
def test_a_crafted_metadata_is_refused_and_runs_nothing(stopped, data_dir, tmp_path, capsys, command):
    out, cfg_file = stopped
    folder = ckpt(out, 8)
    marker = tmp_path / MARKER
    craft_metadata(folder, marker)
    argv = {
        "export": ["export", "hf", str(folder), str(tmp_path / "hf")],
        "generate": ["generate", "--model", str(folder), "--prompt", "def "],
        "eval": ["eval", "--model", str(folder), "--data", str(data_dir)],
        "init_from": ["run", "pretrain", "--config", str(cfg_file), f"model.init_from={folder}"]
        + [f"output_dir={tmp_path / 'hf'}"],
    }[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{folder}/.metadata" in err or f"{folder} is damaged: .metadata" in err
    assert "is not DCP checkpoint metadata" in err and "refused without running anything" in err
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_the_loader_itself_refuses_what_the_manifest_would_not_catch(stopped, tmp_path):
    # Behind the manifest: the reader every load goes through refuses the payloads too.
    out, _ = stopped
    marker = tmp_path / MARKER
    craft_metadata(ckpt(out, 8), marker)
    craft_optimizer_entry(ckpt(out, 4), marker)
    state = {"x": torch.zeros(1)}
    with pytest.raises(CheckpointError, match=r"\.metadata is not DCP checkpoint metadata.*posix\.system"):
        safe_dcp.load(state, ckpt(out, 8))
    state = {"optim.param_groups.0.lr": 0.0}
    with pytest.raises(CheckpointError, match=r"entry 'optim.param_groups.0.lr' is not plain data"):
        safe_dcp.load(state, ckpt(out, 4))
    assert not marker.exists()


def _pickle_op(s: str) -> bytes:
    return b"\x8c" + bytes([len(s)]) + s.encode()


def test_the_metadata_unpickler_admits_dcps_classes_only(stopped, tmp_path):
    out, _ = stopped
    assert isinstance(safe_dcp.read_metadata(ckpt(out, 8)), Metadata)  # a real one reads
    # BUILD onto a class would set an attribute of DCP's Metadata class in this process
    attack = b"\x80\x04" + _pickle_op("torch.distributed.checkpoint.metadata") + _pickle_op("Metadata")
    attack += b"\x93N}" + _pickle_op("planted") + b"K\x01s\x86b."
    for name, data in {
        "class": attack,
        "eval": pickle.dumps(eval),
        "garbage": b"\x00not a pickle",
        "not metadata": pickle.dumps({"a": 1}),
    }.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / ".metadata").write_bytes(data)
        with pytest.raises(CheckpointError, match="refused"):
            safe_dcp.read_metadata(folder)
    assert not hasattr(Metadata, "planted")


# -- a kill in the middle of a save ---------------------------------------------------------------
@pytest.mark.slow
def test_a_kill_between_checkpoint_files_resumes_from_the_previous(tiny_config, uninterrupted, tmp_path):
    out = tmp_path / "run"
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump(config(tiny_config, out)))
    cmd = [sys.executable, "-m", "ladle", "run", "pretrain", "--config", str(cfg_file)]
    r = subprocess.run(
        cmd, env={**os.environ, "LADLE_FAULT": "kill-save:8"}, capture_output=True, timeout=300
    )
    assert r.returncode == -9, r.stdout.decode()[-2000:] + r.stderr.decode()[-2000:]
    half = out / "checkpoints" / ".step_00000008.tmp"
    assert (half / "__0_0.distcp").is_file() and not (half / "manifest.json").exists()
    assert latest_checkpoint(out).name == "step_00000004"
    assert resume_cli(cfg_file) == 0
    log = events(out)
    assert (
        "removed .step_00000008.tmp, a save that was cut short (no manifest); resuming from step_00000004"
        in log
    )
    assert not half.exists() and losses(out) == uninterrupted


# -- pruning ------------------------------------------------------------------------------------
def test_pruning_keeps_every_whole_checkpoint_while_the_newest_is_damaged(tiny_config, tmp_path):
    import shutil

    out = tmp_path / "run"
    cfg = config(tiny_config, out)
    assert run(cfg) == "completed"  # whole checkpoints 4, 8, 12
    shutil.copytree(ckpt(out, 12), tmp_path / "whole12")
    truncate(ckpt(out, 12), None)
    pruner = Checkpointer(out, build_config(cfg, ["checkpoint.keep_last=1"]).checkpoint, torch.device("cpu"))
    pruner._prune(keep=ckpt(out, 8))  # as after a resume from 8 that saved step 8 again
    assert [d.name for d in checkpoint_dirs(out)] == ["step_00000012", "step_00000008", "step_00000004"]
    shutil.rmtree(ckpt(out, 12))
    shutil.copytree(tmp_path / "whole12", ckpt(out, 12))
    pruner._prune(keep=ckpt(out, 12))  # the newest is whole: keep_last=1 keeps it alone
    assert [d.name for d in checkpoint_dirs(out)] == ["step_00000012"]


# -- ladle checkpoint verify ----------------------------------------------------------------------
def test_checkpoint_verify_names_the_damage(stopped, tmp_path, capsys):
    out, _ = stopped
    flip_a_byte(ckpt(out, 8), None)
    assert main(["checkpoint", "verify", str(out)]) == 2
    text = capsys.readouterr().out
    assert f"{ckpt(out, 8)}: DAMAGED\n  __0_0.distcp: its sha256 differs" in text
    assert f"{ckpt(out, 4)}: whole" in text and "train.resume=auto continues from step_00000004" in text
    assert main(["checkpoint", "verify", str(ckpt(out, 4)), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["whole"] and report["checkpoints"][0]["files"] == 5
    assert main(["checkpoint", "verify", str(tmp_path)]) == 2
    assert "neither a checkpoint folder nor a run directory" in capsys.readouterr().err
    assert verify(ckpt(out, 4)) == {}


# -- no reader that unpickles comes back ---------------------------------------------------------
def unsafe_loads(source: str, path: str = "<src>") -> list[str]:
    """Calls in `source` that can unpickle code: pickle's loaders and Unpicklers (but a restricted
    one, with its own find_class), torch.load without weights_only=True, DCP loads without a
    storage reader of our own, DCP's FileSystemReader (it unpickles), numpy with allow_pickle,
    yaml.load."""
    found = []
    tree = ast.parse(source)
    restricted = {
        n.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef)
        and any(f.name == "find_class" for f in n.body if isinstance(f, ast.FunctionDef))
    }

    def kw(call, name):
        return next((k.value for k in call.keywords if k.arg == name), None)

    for n in ast.walk(tree):
        where = f"{path}:{getattr(n, 'lineno', 0)}"
        if isinstance(n, ast.Attribute) and n.attr == "FileSystemReader":
            bases = [b for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for b in c.bases]
            if n not in bases:
                found.append(f"{where} DCP's FileSystemReader")
        if isinstance(n, ast.ClassDef) and n.name not in restricted:
            if any("Unpickler" in ast.unparse(b) for b in n.bases):
                found.append(f"{where} an Unpickler without find_class")
        if not isinstance(n, ast.Call):
            continue
        func = ast.unparse(n.func)
        if func in (
            "pickle.load",
            "pickle.loads",
            "pickle.Unpickler",
            "pickle._Unpickler",
            "dill.load",
            "dill.loads",
        ):
            found.append(f"{where} {func}")
        elif func == "torch.load":
            w = kw(n, "weights_only")
            if not (isinstance(w, ast.Constant) and w.value is True):
                found.append(f"{where} torch.load without weights_only=True")
        elif func in ("dcp.load", "dcp.load_state_dict", "torch.distributed.checkpoint.load"):
            if kw(n, "storage_reader") is None or kw(n, "planner") is None:
                found.append(f"{where} {func} with DCP's default reader or planner")
        elif func in ("np.load", "numpy.load"):
            a = kw(n, "allow_pickle")
            if isinstance(a, ast.Constant) and a.value:
                found.append(f"{where} {func} with allow_pickle")
        elif func == "yaml.load":
            found.append(f"{where} yaml.load")
    return found


def test_no_reader_in_the_package_unpickles_code():
    package = Path(ladle.__file__).parent
    found = [f for p in sorted(package.rglob("*.py")) for f in unsafe_loads(p.read_text(), str(p))]
    assert found == []


@pytest.mark.parametrize(
    "source",
    [
        "import pickle\npickle.load(f)",
        "import torch\ntorch.load(f)",
        "import torch\ntorch.load(f, weights_only=False)",
        "import torch.distributed.checkpoint as dcp\ndcp.load(state, checkpoint_id=p)",
        "import torch.distributed.checkpoint as dcp\ndcp.FileSystemReader(p).read_metadata()",
        "import pickle\nclass U(pickle.Unpickler):\n    pass",
        "import numpy as np\nnp.load(f, allow_pickle=True)",
        "import yaml\nyaml.load(text)",
    ],
)
def test_the_scan_finds_each_unsafe_reader(source):
    assert unsafe_loads(source)
