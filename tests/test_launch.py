"""`ladle launch slurm`: the sbatch script, run against stand-ins for srun and scontrol."""

import os
import subprocess

import pytest
import yaml

from ladle.cli import main
from ladle.config.load import build_config


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
        "#SBATCH --requeue",
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
        "SLURM_JOB_ID": "4242",
    }
    subprocess.run(["bash", str(script)], check=True, env=env, timeout=30)
    args = (tmp_path / "srun.args").read_text().split("\n")
    i = args.index("ladle")
    assert args[i - 1] == "-m" and args[i + 1 : i + 3] == ["run", "pretrain"]
    got = dict(zip(args[i + 3 :: 2], args[i + 4 :: 2], strict=False))
    assert got["--config"] == str(cfg) and got["--nproc"] == "4" and got["--nnodes"] == "2"
    assert got["--rdzv-endpoint"] == "node-a:29500" and "--node-rank" not in got  # c10d assigns it
    assert got["--rdzv-id"] == "4242"  # the same in a requeued attempt: it resumes by itself
    assert args[-3:-1] == ["parallel.tp=2", "optim.lr=1e-4"]


def test_an_npu_job_asks_for_npus_and_sets_up_cann_and_hccl(tiny_config, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_cfg(tiny_config, tmp_path)
    script = tmp_path / "npu.sbatch"
    argv = ["launch", "slurm", "pretrain", "--config", str(cfg), "--nodes", "2", "--gpus-per-node", "8"]
    argv += ["--accelerator", "npu", "--env", "HCCL_CONNECT_TIMEOUT=600", "--output", str(script)]
    assert main(argv) == 0
    text = script.read_text()
    assert "#SBATCH --gres=npu:8" in text and "--gpus-per-node" not in text
    assert 'source "${ASCEND_TOOLKIT_HOME:-/usr/local/Ascend/ascend-toolkit/latest}/../set_env.sh"' in text
    assert "export HCCL_CONNECT_TIMEOUT=600" in text  # the user's setting wins over the template's
    assert "export HCCL_EXEC_TIMEOUT=1800" in text and "HCCL_CONNECT_TIMEOUT=1800" not in text
    with pytest.raises(SystemExit) as e:  # argparse refuses another accelerator
        main([*argv[:-6], "--accelerator", "tpu"])
    assert e.value.code == 2


def test_a_layout_that_does_not_fit_writes_no_script(tiny_config, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_cfg(tiny_config, tmp_path)
    script = tmp_path / "job.sbatch"
    argv = ["launch", "slurm", "pretrain", "--config", str(cfg), "--nodes", "2", "--gpus-per-node", "3"]
    assert main([*argv, "--output", str(script), "parallel.tp=4"]) == 2
    assert "tp=4 x pp=1 x cp=1 = 4 does not divide the world size 6" in capsys.readouterr().err
    assert not script.exists()


def test_a_requeued_job_resumes_and_a_new_job_is_refused(tiny_config, tmp_path, monkeypatch):
    """The script run as SLURM runs it, its srun a stand-in that starts the command here: killed
    after step 7, then requeued (same job id): it resumes from step 5 by itself and ends like an
    uninterrupted run; another job over the same output_dir is refused."""
    from ladle.recipes import pretrain
    from ladle.train.metrics import read_metrics

    monkeypatch.chdir(tmp_path)
    tiny_config["train"].update(max_steps=10, eval_every=0)
    tiny_config["checkpoint"]["every"] = 5
    cfg = write_cfg(tiny_config, tmp_path)
    script = tmp_path / "job.sbatch"
    out = tmp_path / "run"
    argv = ["launch", "slurm", "pretrain", "--config", str(cfg), "--nodes", "1", "--gpus-per-node", "1"]
    assert main([*argv, "--output", str(script), f"output_dir={out}"]) == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho localhost\n")
    (bin_dir / "srun").write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "localhost"}

    def job(job_id, **extra):
        return subprocess.run(
            ["bash", str(script)],
            env={**env, "SLURM_JOB_ID": job_id, **extra},
            capture_output=True,
            text=True,
            timeout=300,
        )

    first = job("4242", LADLE_FAULT="kill:7")
    assert first.returncode != 0 and "LADLE_FAULT: kill at step 7" in first.stdout
    requeued = job("4242", SLURM_RESTART_COUNT="1")
    assert requeued.returncode == 0, requeued.stdout[-3000:] + requeued.stderr[-3000:]
    events = (out / "events.log").read_text()
    assert "restarted attempt: job 4242 (--rdzv-id) started again; resuming from step_00000005" in events
    other = job("5151")
    assert other.returncode == 2 and f"output_dir {out} already holds checkpoints" in other.stderr

    full = tmp_path / "full"
    pretrain.run(build_config(tiny_config, [f"output_dir={full}"]))
    loss = lambda d: {r["step"]: r["loss"] for r in read_metrics(d) if "loss" in r}  # noqa: E731
    assert loss(out) == loss(full)


def test_restart_evidence(tmp_path, monkeypatch):
    """Which attempts count as restarts of the job recorded in the run card."""
    import json

    from ladle.checkpoint.resume import restart_reason

    for var in ("TORCHELASTIC_RESTART_COUNT", "LADLE_JOB_ID", "SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "run_card.json").write_text(json.dumps({"job": {"id": "77", "attempt": 0}}))
    assert restart_reason(tmp_path) is None  # a plain new run
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert "torchrun restarted the workers of this job (2 restarts so far)" in restart_reason(tmp_path)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert restart_reason(tmp_path) is None  # a second run inside one allocation: a new job
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert restart_reason(tmp_path) == "SLURM requeued job 77 (restart 1)"
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    assert restart_reason(tmp_path) is None  # another job
    monkeypatch.setenv("LADLE_JOB_ID", "77")
    assert restart_reason(tmp_path) == "job 77 (--rdzv-id) started again"
    (tmp_path / "run_card.json").write_text("{damaged")
    assert restart_reason(tmp_path) is None


def test_a_sigterm_to_the_launcher_reaches_every_rank(tiny_config, tmp_path):
    # A scheduler signals the process it started: `ladle run`, which runs torchrun's agent. The
    # agent passes SIGTERM on, each rank finishes its step and saves, and the launcher exits 143.
    import signal
    import sys
    import time

    tiny_config["train"].update(max_steps=100_000, eval_every=0)
    tiny_config["checkpoint"]["every"] = 0
    cfg = write_cfg(tiny_config, tmp_path)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "ladle", "run", "pretrain", "--config", str(cfg), "--nproc", "2"]
    p = subprocess.Popen(
        [*cmd, f"output_dir={out}", "parallel.dp_shard=2", "train.micro_batch_size=1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    deadline = time.time() + 120
    for line in p.stdout:  # wait for the second step, then signal the launcher alone
        seen.append(line)
        if line.startswith("step      2 ") or time.time() > deadline:
            break
    p.send_signal(signal.SIGTERM)
    rest, _ = p.communicate(timeout=120)
    text = "".join(seen) + rest
    assert p.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert "SIGTERM received; the workers were sent it and have ended" in text
    step = int((out / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert step >= 2 and f"stopped at step {step} (SIGTERM); checkpoint saved" in text
