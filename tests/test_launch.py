"""`ladle launch slurm`: the sbatch script, run against stand-ins for srun and scontrol."""

import os
import subprocess

import yaml

from ladle.cli import main


def write_cfg(tiny_config, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(tiny_config))
    return f


def test_sbatch_script_starts_one_torchrun_per_node(tiny_config, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_cfg(tiny_config, tmp_path)
    script = tmp_path / "job.sbatch"
    argv = ["launch", "slurm", "pretrain", "--config", str(cfg), "--nodes", "2", "--gpus-per-node", "4"]
    argv += [
        "--output",
        str(script),
        "--partition",
        "gpu",
        "--env",
        "NCCL_DEBUG=WARN",
        "parallel.tp=2",
        "optim.lr=1e-4",
    ]
    assert main(argv) == 0
    assert "layout dp_shard=4, tp=2 (FSDP2)" in capsys.readouterr().out
    text = script.read_text()
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu",
        "export NCCL_DEBUG=WARN",
    ]:
        assert line in text, line
    assert (tmp_path / "slurm-logs").is_dir()

    # Run it with stand-ins: scontrol names the nodes, srun records what it would start.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'node-a\\nnode-b\\n'\n")
    (bin_dir / "srun").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/srun.args\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_NODEID": "1",
    }
    subprocess.run(["bash", str(script)], check=True, env=env, timeout=30)
    args = (tmp_path / "srun.args").read_text().split("\n")
    i = args.index("ladle")
    assert args[i - 1] == "-m" and args[i + 1 : i + 3] == ["run", "pretrain"]
    got = dict(zip(args[i + 3 :: 2], args[i + 4 :: 2], strict=False))
    assert got["--config"] == str(cfg) and got["--nproc"] == "4" and got["--nnodes"] == "2"
    assert got["--rdzv-endpoint"] == "node-a:29500" and "--node-rank" not in got  # c10d assigns it
    assert args[-3:-1] == ["parallel.tp=2", "optim.lr=1e-4"]


def test_a_layout_that_does_not_fit_writes_no_script(tiny_config, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_cfg(tiny_config, tmp_path)
    script = tmp_path / "job.sbatch"
    argv = ["launch", "slurm", "pretrain", "--config", str(cfg), "--nodes", "2", "--gpus-per-node", "3"]
    assert main([*argv, "--output", str(script), "parallel.tp=4"]) == 2
    assert "tp=4 x pp=1 x cp=1 = 4 does not divide the world size 6" in capsys.readouterr().err
    assert not script.exists()
