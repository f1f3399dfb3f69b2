"""`ladle run` (one process, or torchrun's agent in this process for several) and `ladle launch
slurm` (the sbatch script for a multi-node run)."""

from __future__ import annotations

import os
import sys


def cmd_run(args) -> int:
    from ladle.config.load import load_config
    from ladle.recipes import load

    recipe = load(args.recipe)
    if args.no_memory_check:  # an override, so that torchrun's processes get it too
        args.overrides = [*args.overrides, "device.memory_check=false"]
    cfg = load_config(args.config, args.overrides)
    if args.rdzv_id:  # the job's id in every attempt: a restarted one resumes by itself
        os.environ["LADLE_JOB_ID"] = args.rdzv_id
    if args.nproc > 1 or args.nnodes > 1:
        from ladle.checkpoint.resume import parent_resume_check
        from ladle.launch.checks import check

        # Fail here, once, before torchrun starts N processes: the layout, the paths, a start
        # over another run's checkpoints, a resume with none whole. Nothing is written.
        checked = check(cfg, recipe, world=args.nproc * args.nnodes).cfg
        parent_resume_check(checked)
        return _torchrun(args)
    status = recipe.run(cfg)
    return 0 if status in ("completed", "exit", "SIGTERM", "SIGINT") else 1


# Set once this process has run torchrun's agent: it has written nothing itself, so `python -m
# ladle` ends it without the interpreter's teardown (most of a second with torch loaded).
launched = False


def _torchrun(args) -> int:
    """torchrun's agent, in this process: it has torch imported already, so the workers start a
    second or so sooner than under a `python -m torch.distributed.run` of its own. The agent
    forwards a SIGTERM or SIGINT sent here to the workers."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    argv = [
        f"--nproc-per-node={args.nproc}",
        f"--nnodes={args.nnodes}",
        f"--node-rank={args.node_rank}",
        f"--max-restarts={args.max_restarts}",
    ]
    if args.rdzv_endpoint:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}"]
        argv += [f"--rdzv-id={args.rdzv_id}"] if args.rdzv_id else []
    else:
        argv += ["--standalone"]
    argv += ["-m", "ladle", "run", args.recipe, "--config", args.config, *args.overrides]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Each attempt's workers get a TCP store of their own. The store torchrun's agent shares with
    # them by default outlives an attempt, and the gloo addresses of the killed one left in it
    # made a restarted attempt connect to dead ranks (connectFullMesh: connection refused).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    global launched
    launched = True
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr)  # torchrun's summary: each failed rank's exit code
        return 1
    except SignalException as e:  # the agent passed the signal on to the workers, then stopped
        print(
            f"ladle run: {e.sigval.name} received; the workers were sent it and have ended", file=sys.stderr
        )
        return 128 + int(e.sigval)
    return 0


def cmd_launch_slurm(args) -> int:
    from ladle.config.load import load_config
    from ladle.launch.checks import check
    from ladle.launch.slurm import write_sbatch
    from ladle.recipes import load

    recipe = load(args.recipe)
    cfg = load_config(args.config, args.overrides)
    lay = check(cfg, recipe, world=args.nodes * args.gpus_per_node, paths=not args.no_paths).layout
    path = write_sbatch(
        recipe=args.recipe,
        config=args.config,
        overrides=args.overrides,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        out=args.output,
        time=args.time,
        partition=args.partition,
        account=args.account,
        job_name=args.job_name,
        cpus_per_task=args.cpus_per_task,
        port=args.port,
        max_restarts=args.max_restarts,
        env=args.env,
        force=args.force,
        accelerator=args.accelerator,
    )
    print(
        f"{path}: {args.nodes} nodes x {args.gpus_per_node} processes, layout {lay.describe()}; submit with: sbatch {path}"
    )
    return 0


def _run_parser(sub, recipes) -> None:
    s = sub.add_parser("run", help="run a recipe")
    s.add_argument("recipe", help=", ".join(recipes))
    s.add_argument("--config", required=True)
    s.add_argument("--nproc", type=int, default=1, help="processes on this machine (starts torchrun)")
    s.add_argument("--nnodes", type=int, default=1)
    s.add_argument("--node-rank", type=int, default=0)
    s.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous")
    s.add_argument(
        "--rdzv-id",
        default=None,
        help="the job's id, the same on every node and in every attempt: an attempt started again "
        "with it (a requeue, a replaced node) resumes the run by itself",
    )
    s.add_argument(
        "--max-restarts", type=int, default=0, help="torchrun restarts a failed job this often; each resumes"
    )
    s.add_argument(
        "--no-memory-check",
        action="store_true",
        help="start even when the planner says the layout will not fit the device (device.memory_check=false)",
    )
    s.add_argument("overrides", nargs="*", metavar="key.path=value")
    s.set_defaults(fn=cmd_run)


def _launch_parser(sub, recipes) -> None:
    s = sub.add_parser("launch", help="write a cluster job script for a run")
    lsub = s.add_subparsers(dest="launch_command", required=True, metavar="SCHEDULER")
    sl = lsub.add_parser(
        "slurm", help="an sbatch script: one torchrun per node, c10d rendezvous on the first"
    )
    sl.add_argument("recipe", help=", ".join(recipes))
    sl.add_argument("--config", required=True)
    sl.add_argument("--nodes", type=int, required=True)
    sl.add_argument(
        "--gpus-per-node", type=int, required=True, help="processes per node (one per accelerator)"
    )
    sl.add_argument("--output", default="ladle.sbatch", help="the script to write")
    sl.add_argument("--time", default="24:00:00")
    sl.add_argument("--partition", default=None)
    sl.add_argument("--account", default=None)
    sl.add_argument("--job-name", default="ladle")
    sl.add_argument("--cpus-per-task", type=int, default=None, help="default: 8 per process")
    sl.add_argument("--port", type=int, default=29500, help="rendezvous port on the first node")
    sl.add_argument("--max-restarts", type=int, default=0)
    sl.add_argument("--env", action="append", metavar="NAME=VALUE", help="repeatable; exported in the job")
    sl.add_argument(
        "--accelerator",
        choices=["gpu", "npu"],
        default="gpu",
        help="npu: asks for --gres=npu:N, sources CANN's set_env.sh and exports the HCCL settings of "
        "docs/ascend.md (each overridable with --env)",
    )
    sl.add_argument(
        "--no-paths", action="store_true", help="skip the tokenizer and data checks (paths of the cluster)"
    )
    sl.add_argument("--force", action="store_true")
    sl.add_argument("overrides", nargs="*", metavar="key.path=value")
    sl.set_defaults(fn=cmd_launch_slurm)


COMMANDS = {  # command -> the function that adds its sub-parser
    "run": _run_parser,
    "launch": _launch_parser,
}
