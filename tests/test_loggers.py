"""TensorBoard and W&B (offline) loggers: what they hold, read back, equals metrics.jsonl."""

import json
import struct
from pathlib import Path

import pytest
import yaml

from ladle.cli import main
from ladle.train.metrics import read_metrics


def wandb_history(run_file: Path) -> list[dict]:
    """The history records of a W&B run file (a LevelDB-style log of protobuf Records after a
    7-byte ':W&B' header, in 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last part of one
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                out.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                )
    return out


@pytest.mark.slow
def test_tensorboard_and_wandb_hold_the_metrics_of_metrics_jsonl(tiny_config, tmp_path):
    tiny_config["loggers"] = {"tensorboard": True, "wandb": True, "wandb_project": "ladle-test"}
    tiny_config["train"].update(max_steps=6, eval_every=3)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config))
    assert main(["run", "pretrain", "--config", str(cfg)]) == 0
    out = Path(tiny_config["output_dir"])
    records = read_metrics(out)
    want = {}  # (name, step) -> value, as metrics.jsonl holds them
    for r in records:
        for k, v in r.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                want[(k, r["step"])] = float(v)
    assert ("loss", 6) in want and ("val_loss", 3) in want

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tb = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    assert tb.keys() == want.keys()
    assert all(tb[k] == pytest.approx(want[k], rel=1e-6) for k in want)  # stored as fp32

    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    got = {}
    for h in wandb_history(run_file):
        step = h["_step"]
        got.update({(k, step): float(v) for k, v in h.items() if not k.startswith("_")})
    assert got == want


def test_a_logger_whose_package_is_missing_is_refused(tiny_config, tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    tiny_config["loggers"] = {"wandb": True}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config))
    assert main(["run", "pretrain", "--config", str(cfg)]) == 2
    assert "loggers.wandb=true needs the wandb package: pip install 'ladle[wandb]'" in capsys.readouterr().err
    assert not Path(tiny_config["output_dir"]).exists()
