"""`ladle bench comm` and `ladle bench data`: figures by nccl-tests' definitions, read back."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ladle.cli import main


@pytest.mark.slow
def test_bench_comm_reports_every_collective_with_bus_bandwidth(tmp_path):
    out = tmp_path / "comm.json"
    cmd = [
        sys.executable,
        "-m",
        "ladle",
        "bench",
        "comm",
        "--nproc",
        "2",
        "--min-bytes",
        "1K",
        "--max-bytes",
        "64K",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--output",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "busbw GB/s" in proc.stdout
    report = json.loads(out.read_text())
    assert report["ranks"] == 2 and report["backend"] == "gloo"
    rows = report["rows"]
    assert {r["op"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    assert sorted({r["bytes"] for r in rows}) == [1024, 4096, 16384, 65536]
    for r in rows:
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        factor = 2 * (2 - 1) / 2 if r["op"] == "all_reduce" else (2 - 1) / 2
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)


def test_bench_comm_on_one_process(capsys):
    assert main(["bench", "comm", "--max-bytes", "4K", "--iters", "2", "--warmup", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ranks"] == 1 and len(report["rows"]) == 4 * 2
    assert all(r["busbw_gbps"] == 0 for r in report["rows"])  # one rank moves nothing


@pytest.mark.parametrize(
    "args, message",
    [
        (["--min-bytes", "1G", "--max-bytes", "1K"], "--min-bytes 1073741824 is more than --max-bytes 1024"),
        (["--max-bytes", "lots"], "--max-bytes 'lots' is not a size"),
        (["--ops", "broadcast"], "--ops broadcast: the collectives are all_reduce"),
    ],
)
def test_bench_comm_refuses_bad_input(capsys, args, message):
    assert main(["bench", "comm", *args]) == 2
    assert message in capsys.readouterr().err


def test_bench_data_measures_the_loader_against_a_run(tiny_config, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config))
    assert main(["bench", "data", "--config", str(cfg), "--steps", "5", "--step-s", "0.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    t = tiny_config["train"]
    assert (
        out["tokens_per_step"]
        == t["micro_batch_size"] * t["grad_accum_steps"] * tiny_config["data"]["seq_len"]
    )
    assert out["tokens_per_s"] > 0 and out["need_tokens_per_s"] == pytest.approx(out["tokens_per_step"] / 0.5)
    assert out["headroom"] == pytest.approx(out["tokens_per_s"] / out["need_tokens_per_s"])
    assert main(["bench", "data", "--config", str(cfg), "--steps", "2", "--run", str(tmp_path)]) == 2
    assert f"--run {tmp_path}: no metrics.jsonl there" in capsys.readouterr().err


def test_bench_data_refuses_a_recipe_without_a_loader(tiny_config, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config))
    assert main(["bench", "data", "--config", str(cfg), "--recipe", "grpo"]) == 2
    assert "recipe grpo makes its batches by generation" in capsys.readouterr().err
    assert not Path(tiny_config["output_dir"]).exists()
