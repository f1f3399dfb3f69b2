"""`ladle launch slurm`: an sbatch script for the same job `ladle run` would start.

Slurm starts one task per node (`srun --ntasks-per-node=1`); each runs `ladle run --nproc G
--nnodes N --rdzv-endpoint <first node>:PORT`, whose torchrun starts the G processes of that node
and meets the others at the c10d rendezvous on the first node. The config and the layout are
checked for N x G processes before the script is written, so a job that cannot start is never
queued.

The job may be requeued (`--requeue`: a failed node, a pre-emption). Every attempt passes the
SLURM job id as `--rdzv-id`, which the run card records: a requeued attempt finds its own job
there and resumes from the newest whole checkpoint, whatever `train.resume` says, while a new
job over the same output_dir is still refused.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from ladle.errors import LadleError

# The HCCL settings an Ascend job starts with (`--accelerator npu`; `--env` overrides each):
# connecting many ranks takes longer than HCCL's default 120 s, and a collective's execution
# timeout must stay above ladle's dist.timeout_s (600 s by default) so that ladle's names it.
HCCL_DEFAULTS = {"HCCL_CONNECT_TIMEOUT": "1800", "HCCL_EXEC_TIMEOUT": "1800"}
ASCEND_ENV = 'source "${ASCEND_TOOLKIT_HOME:-/usr/local/Ascend/ascend-toolkit/latest}/../set_env.sh"'

TEMPLATE = """#!/bin/bash
# Written by `ladle launch slurm`; submit with: sbatch {script}
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
{gpus_line}#SBATCH --cpus-per-task={cpus}
#SBATCH --time={time}
#SBATCH --output={log_dir}/%x-%j.out
#SBATCH --requeue
#SBATCH --open-mode=append
{extra}
set -euo pipefail
cd {workdir}

# The first node of the allocation hosts torchrun's c10d rendezvous.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{threads}}}
{env}
# One task per node; the c10d rendezvous gives each node its rank (no --node-rank needed).
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \\
  {ladle} run {recipe} --config {config} \\
  --nproc {gpus} --nnodes {nodes} \\
  --rdzv-endpoint "$head_node:{port}" --rdzv-id "$SLURM_JOB_ID" --max-restarts {max_restarts} \\
  {overrides}
"""


def write_sbatch(
    *,
    recipe: str,
    config: str,
    overrides: list[str],
    nodes: int,
    gpus_per_node: int,
    out: str,
    time: str = "24:00:00",
    partition: str | None = None,
    account: str | None = None,
    job_name: str = "ladle",
    cpus_per_task: int | None = None,
    port: int = 29500,
    max_restarts: int = 0,
    env: list[str] | None = None,
    force: bool = False,
    accelerator: str = "gpu",
) -> Path:
    """`accelerator`: gpu (`--gpus-per-node`) or npu (`--gres=npu:N`, CANN's environment sourced,
    the HCCL_DEFAULTS exported before the user's `env`)."""
    if nodes < 1 or gpus_per_node < 1:
        raise LadleError("--nodes and --gpus-per-node must be at least 1")
    for kv in env or []:
        if "=" not in kv:
            raise LadleError(f"--env {kv!r}: expected NAME=VALUE")
    path = Path(out)
    if path.exists() and not force:
        raise LadleError(f"{path} exists; pass --force to overwrite it")
    if accelerator not in ("gpu", "npu"):
        raise LadleError(f"--accelerator {accelerator!r}: choose gpu or npu")
    extra = "".join(f"#SBATCH --{k}={v}\n" for k, v in (("partition", partition), ("account", account)) if v)
    exports = dict(kv.split("=", 1) for kv in env or [])
    if accelerator == "npu":
        exports = {**HCCL_DEFAULTS, **exports}
    cpus = cpus_per_task or 8 * gpus_per_node
    log_dir = Path.cwd() / "slurm-logs"  # must exist when the job starts
    text = TEMPLATE.format(
        script=shlex.quote(str(path)),
        job_name=job_name,
        nodes=nodes,
        gpus_line=(
            f"#SBATCH --gpus-per-node={gpus_per_node}\n"
            if accelerator == "gpu"
            else f"#SBATCH --gres=npu:{gpus_per_node}\n"
        ),
        cpus=cpus,
        time=time,
        log_dir=shlex.quote(str(log_dir)),
        extra=extra.rstrip("\n"),
        workdir=shlex.quote(os.getcwd()),
        threads=max(1, cpus // gpus_per_node),
        env="\n".join(
            ([ASCEND_ENV] if accelerator == "npu" else [])
            + [f"export {k}={shlex.quote(v)}" for k, v in exports.items()]
        ),
        ladle=f"{shlex.quote(sys.executable)} -m ladle",  # this environment's ladle on every node
        recipe=recipe,
        config=shlex.quote(str(Path(config).resolve()) if Path(config).exists() else config),
        gpus=gpus_per_node,
        port=port,
        max_restarts=max_restarts,
        overrides=" ".join(shlex.quote(o) for o in overrides),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(0o755)
    os.replace(tmp, path)
    return path
