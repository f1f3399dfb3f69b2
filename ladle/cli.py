"""The `ladle` command: parse, validate, call into the package. User errors exit 2, no traceback."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from ladle.errors import ConfigError, LadleError


# -- config commands ---------------------------------------------------------------------------
def cmd_ls(args) -> int:
    from ladle.config.load import bundled_configs, model_presets
    from ladle.recipes import RECIPES

    print("recipes:")
    for name in RECIPES:
        print(f"  {name}")
    print("configs:")
    for name in bundled_configs():
        print(f"  {name}")
    print("models (model.preset):")
    for name in model_presets():
        print(f"  {name}")
    return 0


def cmd_cp(args) -> int:
    from ladle.config.load import resolve_config_path

    src = resolve_config_path(args.config)
    dest = Path(args.dest)
    if dest.is_dir():
        dest = dest / src.name
    if dest.exists() and not args.force:
        raise LadleError(f"{dest} exists; pass --force to overwrite it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    print(f"copied {src} -> {dest}")
    return 0


def cmd_validate(args) -> int:
    from ladle.config.load import config_hash, load_config, to_yaml
    from ladle.prelaunch import check

    cfg = load_config(args.config, args.overrides)
    found = check(cfg, args.recipe, world=args.nproc, paths=not args.no_paths)
    cfg, lay = found.cfg, found.layout
    if lay is not None:
        print(f"# layout for {args.nproc} processes: {lay.describe()}", file=sys.stderr)
    sys.stdout.write(to_yaml(cfg))
    print(f"# config hash: {config_hash(cfg)}", file=sys.stderr)
    return 0


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
        from ladle.prelaunch import check, parent_resume_check

        # Fail here, once, before torchrun starts N processes: the layout, the paths, a start
        # over another run's checkpoints, a resume with none whole. Nothing is written.
        checked = check(cfg, args.recipe, world=args.nproc * args.nnodes).cfg
        parent_resume_check(checked)
        return _torchrun(args)
    status = recipe.run(cfg)
    return 0 if status in ("completed", "exit", "SIGTERM", "SIGINT") else 1


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


# Set once this process has run torchrun's agent: it has written nothing itself, so `python -m
# ladle` ends it without the interpreter's teardown (most of a second with torch loaded).
launched = False


def cmd_plan(args) -> int:
    from ladle.config.load import load_config
    from ladle.plan import Target, parse_size, plan
    from ladle.prelaunch import resolve_config
    from ladle.recipes import RECIPES

    cfg = load_config(args.config, args.overrides)
    init = cfg.model.init_from
    if init and not Path(init).exists() and cfg.model.preset:  # planning before the download
        print(
            f"# model.init_from {init} is not here: planned with model.preset {cfg.model.preset}",
            file=sys.stderr,
        )
    elif init:
        cfg = resolve_config(cfg)
    recipe = args.recipe or next((r for r in RECIPES if r in Path(args.config).stem.split("-")), "pretrain")
    if args.devices < 1:
        raise ConfigError(f"--devices {args.devices}: at least 1")
    per_node = args.devices_per_node or min(args.devices, 8)
    target = Target(
        devices=args.devices,
        memory=parse_size(args.device_memory, "--device-memory"),
        per_node=per_node,
        intra_bw=args.intra_bw,
        inter_bw=args.inter_bw,
        peak_tflops=args.peak_tflops,
        mfu=args.mfu,
        margin=args.margin,
        cpu=args.cpu,
    )
    report = plan(cfg, recipe, target)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        print(report.text(limit=args.limit))
    return 0


def cmd_bench_comm(args) -> int:
    from ladle import bench

    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        tail = [
            f"--min-bytes={args.min_bytes}",
            f"--max-bytes={args.max_bytes}",
            f"--factor={args.factor}",
            f"--iters={args.iters}",
            f"--warmup={args.warmup}",
            f"--device={args.device}",
        ]
        tail += [f"--ops={o}" for o in args.ops or []] + (["--json"] if args.json else [])
        tail += [f"--output={args.output}"] if args.output else []
        return bench.main_comm_launch(args, tail)
    return bench.run_comm(args)


def cmd_bench_data(args) -> int:
    from ladle import bench

    return bench.run_data(args)


def cmd_report(args) -> int:
    from ladle.report import report

    print(f"wrote {report(args.run, args.output)}")
    return 0


def cmd_compare(args) -> int:
    from ladle.report import compare

    text, page = compare(args.runs, args.output)
    print(text)
    print(f"\nwrote {page}")
    return 0


def cmd_launch_slurm(args) -> int:
    from ladle.config.load import load_config
    from ladle.launch import write_sbatch
    from ladle.prelaunch import check
    from ladle.recipes import load

    load(args.recipe)
    cfg = load_config(args.config, args.overrides)
    lay = check(cfg, args.recipe, world=args.nodes * args.gpus_per_node, paths=not args.no_paths).layout
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


# -- data and tokenizer ------------------------------------------------------------------------
def cmd_tokenizer_train(args) -> int:
    from ladle.tokenizer import load_tokenizer, train_tokenizer

    out = train_tokenizer(
        args.input, vocab_size=args.vocab_size, output=args.output, glob=args.glob, exclude=args.exclude
    )
    tok = load_tokenizer(out)
    print(f"tokenizer with {tok.vocab_size} tokens written to {out} (sha256 {tok.hash[:12]})")
    return 0


def cmd_data_prepare(args) -> int:
    from ladle.data.prepare import prepare

    if args.task == "sft":
        from ladle.data.sft import prepare_sft

        if args.format in ("text", "jsonl", "parquet"):
            raise LadleError(
                f"--format {args.format} is a file format; for --task sft name the record shape "
                "(messages, sharegpt, alpaca) or leave it auto (files: jsonl or parquet)"
            )
        mask = "all" if args.train_on_prompt else "last_turn" if args.last_turn_only else args.mask
        prepare_sft(
            args.input,
            tokenizer=args.tokenizer,
            output=args.output,
            fmt=args.format,
            template=args.template,
            mask=mask,
            max_len=args.max_len,
            overlong=args.overlong,
            glob=args.glob,
            exclude=args.exclude,
            val_fraction=args.val_fraction,
            seed=args.seed,
            strict=args.strict,
        )
        return 0
    if args.task == "preference":
        from ladle.data.preference import prepare_preference

        if args.format != "auto":
            raise LadleError(
                f"--format {args.format}: --task preference tells each record's shape from its fields "
                "(prompt/chosen/rejected strings or message lists, or HH-RLHF turns); leave --format out"
            )
        prepare_preference(
            args.input,
            tokenizer=args.tokenizer,
            output=args.output,
            template=args.template,
            max_len=args.max_len,
            overlong=args.overlong,
            glob=args.glob,
            exclude=args.exclude,
            val_fraction=args.val_fraction,
            seed=args.seed,
            strict=args.strict,
        )
        return 0
    if args.task == "prompts":
        from ladle.data.prompts import prepare_prompts

        if args.format != "auto":
            raise LadleError(
                f"--format {args.format}: --task prompts reads records with a 'prompt'; leave --format out"
            )
        prepare_prompts(
            args.input,
            tokenizer=args.tokenizer,
            output=args.output,
            template=args.template,
            max_prompt_len=args.max_prompt_len,
            glob=args.glob,
            exclude=args.exclude,
            val_fraction=args.val_fraction,
            seed=args.seed,
            strict=args.strict,
        )
        return 0
    if args.format in ("messages", "sharegpt", "alpaca"):
        raise LadleError(f"--format {args.format} is an SFT record shape; add --task sft")
    prepare(
        args.input,
        tokenizer=args.tokenizer,
        output=args.output,
        glob=args.glob,
        exclude=args.exclude,
        fmt=args.format,
        text_field=args.text_field,
        workers=args.workers,
        val_fraction=args.val_fraction,
        strict=args.strict,
        seed=args.seed,
    )
    return 0


def cmd_data_synth(args) -> int:
    from ladle.data.synthetic import write_task

    info = write_task(
        args.task,
        args.output,
        train=args.train,
        val=args.val,
        seed=args.seed,
        max_digits=args.max_digits,
        max_words=args.max_words,
        pairs=args.pairs,
        prompts=args.prompts,
    )
    what = "preference pairs" if args.pairs else "prompts with answers" if args.prompts else "chats"
    print(f"{info['task']}: {info['train']} train and {info['val']} held-out {what} in {info['path']}")
    return 0


def cmd_data_inspect(args) -> int:
    from ladle.data.inspect import format_inspect, inspect_data

    report = inspect_data(args.dir, samples=args.samples, tokenizer=args.tokenizer)
    print(json.dumps(report, indent=2, default=str) if args.json else format_inspect(report))
    return 0


def cmd_data_show(args) -> int:
    from ladle.data.inspect import format_show, show_data

    report = show_data(args.dir, args.index, split=args.split, tokenizer=args.tokenizer)
    print(json.dumps(report, indent=2, ensure_ascii=False) if args.json else format_show(report))
    return 0


# -- models ------------------------------------------------------------------------------------
def cmd_export_hf(args) -> int:
    from ladle.train.export import export_hf

    out = export_hf(args.checkpoint, args.out, dtype=args.dtype, max_shard_gb=args.max_shard_gb)
    print(f"Hugging Face folder written to {out}")
    return 0


def cmd_export_peft(args) -> int:
    from ladle.train.export import export_peft

    out = export_peft(args.checkpoint, args.out)
    print(f"PEFT adapter written to {out}")
    return 0


def cmd_doctor(args) -> int:
    from ladle.doctor import FAIL, as_json, format_checks, run_checks

    checks = run_checks(args.output_dir, gemm=not args.no_gemm)
    print(json.dumps(as_json(checks), indent=2) if args.json else format_checks(checks))
    return 1 if any(c.status == FAIL for c in checks) else 0


def cmd_rank_table(args) -> int:
    from ladle import ranktable

    if args.check:
        problems = ranktable.check(ranktable.load(args.check))
        if problems:
            raise LadleError(f"{args.check}: " + "; ".join(problems))
        table = ranktable.load(args.check)
        ranks = sum(len(s["device"]) for s in table["server_list"])
        print(f"{args.check}: valid, {table['server_count']} servers, {ranks} ranks")
        return 0
    if args.hccn:
        import socket

        server = args.server_id or socket.gethostbyname(socket.gethostname())
        servers, ips = [server], {server: ranktable.local_device_ips(args.devices_per_node)}
    elif args.hosts and args.device_ips:
        servers, ips = ranktable.read_hosts(args.hosts), ranktable.read_device_ips(args.device_ips)
    else:
        raise LadleError("give --hosts FILE and --device-ips FILE, or --hccn (this node), or --check FILE")
    text = json.dumps(ranktable.build(servers, ips, args.devices_per_node), indent=2) + "\n"
    if args.output:
        tmp = Path(f"{args.output}.tmp")
        tmp.write_text(text)
        os.replace(tmp, args.output)
        print(
            f"wrote {args.output}: {len(servers)} servers, {len(servers) * args.devices_per_node} ranks",
            file=sys.stderr,
        )
    else:
        print(text, end="")
    return 0


def cmd_checkpoint_verify(args) -> int:
    from ladle.train.checkpoint import check_report

    report = check_report(args.path)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for c in report["checkpoints"]:
            state = f"whole ({c['files']} files, {c['bytes'] / 2**20:,.1f} MiB)" if c["whole"] else "DAMAGED"
            print(f"{c['path']}: {state}")
            for name, why in c["problems"].items():
                print(f"  {name}: {why}")
        for note in report["notes"]:
            print(note)
    return 0 if report["whole"] else 2


def load_for_inference(args):
    """(model, tokenizer, device) for generate and eval: on --device, in --dtype."""
    import torch

    from ladle import device as dev
    from ladle.train.export import load_any_model

    device = dev.pick_device(args.device, field="--device")
    dev.set_device(device)
    dtype = getattr(torch, args.dtype)
    return (*load_any_model(args.model, device=device, dtype=dtype, tokenizer=args.tokenizer), device)


def cmd_eval(args) -> int:
    import json

    from ladle.train.evaluate import check_data_fits, evaluate

    model, tok, device = load_for_inference(args)
    if args.task in ("reward", "preference"):
        from ladle.train.evaluate import evaluate_pairs

        if args.task == "reward" and model.cfg.head != "score":
            raise LadleError(f"{args.model} is not a reward model (no score head); use --task preference")
        result = evaluate_pairs(
            model,
            args.data,
            split=args.split,
            batch_size=args.batch_size,
            pad_id=tok.pad_id if tok is not None and tok.pad_id is not None else 0,
            device=device,
        )
    elif args.task == "generate":
        from ladle.rewards import scorer
        from ladle.train.task_eval import evaluate_generation

        if tok is None:
            raise LadleError(f"{args.model} has no tokenizer; pass --tokenizer")
        result = evaluate_generation(
            model,
            tok,
            args.data,
            template=args.template,
            score=scorer(args.scorer, args.answer_regex),
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            limit=args.limit,
        )
    else:
        check_data_fits(args.data, tok, model.cfg.vocab_size)
        result = evaluate(
            model,
            args.data,
            split=args.split,
            seq_len=args.seq_len or min(model.cfg.max_seq_len, 1024),
            batch_size=args.batch_size,
            max_batches=args.max_batches,
            doc_mask=not args.no_doc_mask,
            device=device,
        )
        result = {"data": str(args.data), **result}
    print(json.dumps({"model": str(args.model), **result, "device": str(device), "dtype": args.dtype}))
    return 0


def cmd_generate(args) -> int:
    import torch

    from ladle.generation import generate, stop_strings, truncate_at_stop

    model, tok, _ = load_for_inference(args)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise LadleError(
            "no prompt: pass --prompt TEXT (repeatable) or prompts on standard input, one a line"
        )
    gen = torch.Generator().manual_seed(args.seed)
    ids = [tok.encode(p) for p in prompts]
    if tok.bos_id is not None and args.add_bos:
        ids = [[tok.bos_id, *x] for x in ids]
    outs = generate(
        model,
        ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_id=tok.eos_id,
        pad_id=tok.pad_id or 0,
        generator=gen,
        stop=stop_strings(tok.decode, args.stop) if args.stop else None,
    )
    for prompt, out in zip(prompts, outs, strict=True):
        text = truncate_at_stop(tok.decode(out), args.stop or [])
        if args.json:
            print(json.dumps({"prompt": prompt, "text": text, "tokens": out}))
        else:
            print(prompt + text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from ladle.recipes import RECIPES

    p = argparse.ArgumentParser(prog="ladle", description="Training recipes for large language models.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("ls", help="list recipes and bundled configs")
    s.set_defaults(fn=cmd_ls)

    s = sub.add_parser("cp", help="copy a bundled config out for editing")
    s.add_argument("config")
    s.add_argument("dest")
    s.add_argument("--force", action="store_true")
    s.set_defaults(fn=cmd_cp)

    s = sub.add_parser("validate", help="load, override and validate a config; print the resolved YAML")
    s.add_argument("--config", required=True)
    s.add_argument("--no-paths", action="store_true", help="check the schema only, not tokenizer and data")
    s.add_argument(
        "--nproc", type=int, default=0, help="also check the parallel layout for this many processes in all"
    )
    s.add_argument(
        "--recipe",
        choices=RECIPES,
        help="also the recipe's own checks: its data task, the models it reads, what its layout may be "
        "(a separated placement's groups)",
    )
    s.add_argument("overrides", nargs="*", metavar="key.path=value")
    s.set_defaults(fn=cmd_validate)

    s = sub.add_parser("plan", help="memory per device and the layouts that fit, before launching")
    s.add_argument("--config", required=True)
    s.add_argument("--devices", type=int, required=True, help="devices in all")
    s.add_argument("--device-memory", required=True, help="memory of one device: 64GB, 64GiB, 80g")
    s.add_argument("--devices-per-node", type=int, default=0, help="default: 8 (or --devices if fewer)")
    s.add_argument(
        "--recipe", choices=RECIPES, help="default: named in the config's file name, else pretrain"
    )
    s.add_argument("--intra-bw", type=float, default=150.0, help="GB/s a rank sustains within a node")
    s.add_argument("--inter-bw", type=float, default=25.0, help="GB/s a rank sustains across nodes")
    s.add_argument("--peak-tflops", type=float, default=312.0, help="dense bf16 peak of one device")
    s.add_argument("--mfu", type=float, default=0.4, help="the MFU step times are estimated at")
    s.add_argument("--margin", type=float, default=0.10, help="allocator fragmentation margin (a fraction)")
    s.add_argument("--cpu", action="store_true", help="plan for CPU processes (the CPU's kernels)")
    s.add_argument("--limit", type=int, default=8, help="layouts listed per kind")
    s.add_argument("--json", action="store_true")
    s.add_argument("overrides", nargs="*", metavar="key.path=value")
    s.set_defaults(fn=cmd_plan)

    s = sub.add_parser("bench", help="measure the links (comm) or the loader (data)")
    bsub = s.add_subparsers(dest="what", required=True, metavar="WHAT")
    b = bsub.add_parser("comm", help="collectives' algorithm and bus bandwidth over the launched ranks")
    b.add_argument("--nproc", type=int, default=1, help="processes on this machine (starts torchrun)")
    b.add_argument(
        "--ops", action="append", help="all_reduce, all_gather, reduce_scatter, all_to_all (default: all)"
    )
    b.add_argument("--min-bytes", default="1K")
    b.add_argument("--max-bytes", default="1G")
    b.add_argument("--factor", type=int, default=4, help="each size this times the previous")
    b.add_argument("--iters", type=int, default=20)
    b.add_argument("--warmup", type=int, default=5)
    b.add_argument("--device", default="auto")
    b.add_argument("--output", help="also write the JSON report here (rank 0)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=cmd_bench_comm)
    b = bsub.add_parser("data", help="the training loader's tokens/s against what a step consumes")
    b.add_argument("--config", required=True)
    b.add_argument("--recipe", choices=RECIPES, help="default: pretrain")
    b.add_argument("--steps", type=int, default=50)
    b.add_argument("--step-s", type=float, help="a step's time in seconds to compare with")
    b.add_argument("--run", help="a run directory: its median step time from metrics.jsonl")
    b.add_argument("--json", action="store_true")
    b.add_argument("overrides", nargs="*", metavar="key.path=value")
    b.set_defaults(fn=cmd_bench_data)

    s = sub.add_parser("report", help="plots and one HTML page of a run")
    s.add_argument("run", help="a run directory (output_dir)")
    s.add_argument("--output", help="default: RUN/report/")
    s.set_defaults(fn=cmd_report)

    s = sub.add_parser("compare", help="config differences, summary metrics and loss curves of runs")
    s.add_argument("runs", nargs="+", metavar="RUN")
    s.add_argument("--output", help="default: the first run's compare/")
    s.set_defaults(fn=cmd_compare)

    s = sub.add_parser("run", help="run a recipe")
    s.add_argument("recipe", help=", ".join(RECIPES))
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

    s = sub.add_parser("launch", help="write a cluster job script for a run")
    lsub = s.add_subparsers(dest="launch_command", required=True, metavar="SCHEDULER")
    sl = lsub.add_parser(
        "slurm", help="an sbatch script: one torchrun per node, c10d rendezvous on the first"
    )
    sl.add_argument("recipe", help=", ".join(RECIPES))
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

    s = sub.add_parser("tokenizer", help="tokenizer tools")
    tsub = s.add_subparsers(dest="tokenizer_command", required=True, metavar="COMMAND")
    t = tsub.add_parser("train", help="train a byte-level BPE tokenizer")
    t.add_argument("--input", nargs="+", required=True, metavar="PATH")
    t.add_argument("--glob", default=None, help="file-name pattern inside input folders, e.g. '*.py'")
    t.add_argument(
        "--exclude", nargs="*", default=None, metavar="PATTERN", help="paths to skip, e.g. 'test/*'"
    )
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--output", required=True)
    t.set_defaults(fn=cmd_tokenizer_train)

    s = sub.add_parser("data", help="data tools")
    dsub = s.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    d = dsub.add_parser("prepare", help="tokenize raw text / jsonl / parquet into memory-mapped shards")
    d.add_argument("--input", nargs="+", required=True, metavar="PATH")
    d.add_argument("--glob", default=None)
    d.add_argument("--exclude", nargs="*", default=None, metavar="PATTERN")
    d.add_argument(
        "--format",
        default="auto",
        choices=["auto", "text", "jsonl", "parquet", "messages", "sharegpt", "alpaca"],
        help="pretrain: the file format; sft: the record shape (messages, sharegpt, alpaca)",
    )
    d.add_argument("--task", default="pretrain", choices=["pretrain", "sft", "preference", "prompts"])
    d.add_argument(
        "--template",
        default=None,
        help="sft, preference, prompts: a built-in chat template (chatml, qwen, llama3)",
    )
    d.add_argument(
        "--mask", default="assistant", choices=["assistant", "last_turn", "all"], help="sft: trained tokens"
    )
    d.add_argument("--train-on-prompt", action="store_true", help="sft: same as --mask all")
    d.add_argument("--last-turn-only", action="store_true", help="sft: same as --mask last_turn")
    d.add_argument("--max-len", type=int, default=4096, help="sft, preference: longest sample, in tokens")
    d.add_argument(
        "--overlong", default="truncate", choices=["truncate", "drop"], help="sft, preference: longer samples"
    )
    d.add_argument(
        "--max-prompt-len",
        type=int,
        default=1024,
        help="prompts: longest prompt, in tokens (longer: skipped)",
    )
    d.add_argument("--text-field", default="text")
    d.add_argument("--tokenizer", required=True, metavar="DIR")
    d.add_argument("--output", required=True, metavar="DIR")
    d.add_argument("--workers", type=int, default=None)
    d.add_argument("--val-fraction", type=float, default=0.0)
    d.add_argument("--strict", action="store_true", help="stop at the first bad record")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(fn=cmd_data_prepare)
    d = dsub.add_parser("synth", help="write a small chat task with checkable answers (the SFT demo's data)")
    d.add_argument("--task", default="addition", choices=["addition", "sort"])
    d.add_argument("--output", required=True, metavar="DIR", help="gets train.jsonl and val.jsonl")
    d.add_argument("--train", type=int, default=20000, help="train examples")
    d.add_argument("--val", type=int, default=200, help="held-out examples (no prompt also in train)")
    d.add_argument("--max-digits", type=int, default=3, help="addition: digits per operand")
    d.add_argument("--max-words", type=int, default=5, help="sort: at most this many words (3 at least)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--pairs",
        action="store_true",
        help="preference pairs: the correct answer against a plausible wrong one",
    )
    d.add_argument(
        "--prompts",
        action="store_true",
        help='{"prompt", "answer"} records: the RL recipes\' prompts (ladle data prepare --task prompts)',
    )
    d.set_defaults(fn=cmd_data_synth)
    d = dsub.add_parser("inspect", help="counts, lengths and decoded samples of prepared data")
    d.add_argument("dir")
    d.add_argument("--samples", type=int, default=2)
    d.add_argument("--tokenizer", default=None)
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=cmd_data_inspect)
    d = dsub.add_parser(
        "show",
        help="records of prepared data decoded whole, by index (documents, chats, pairs or prompts): "
        "what a bad step's report names",
    )
    d.add_argument("dir")
    d.add_argument("index", type=int, nargs="+")
    d.add_argument("--split", default="train", choices=["train", "val"])
    d.add_argument("--tokenizer", default=None, help="default: the one meta.json names")
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=cmd_data_show)

    s = sub.add_parser("export", help="export a checkpoint")
    esub = s.add_subparsers(dest="export_command", required=True, metavar="FORMAT")
    e = esub.add_parser("hf", help="to a Hugging Face safetensors folder")
    e.add_argument("checkpoint", help="a checkpoints/step_* folder or a run directory (its latest)")
    e.add_argument("out")
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    e.add_argument("--max-shard-gb", type=float, default=5.0)
    e.set_defaults(fn=cmd_export_hf)
    e = esub.add_parser("peft", help="an adapter run's adapters as a PEFT folder (hf merges them instead)")
    e.add_argument("checkpoint", help="a checkpoints/step_* folder or a run directory (its latest)")
    e.add_argument("out")
    e.set_defaults(fn=cmd_export_peft)

    s = sub.add_parser("checkpoint", help="checkpoint tools")
    csub = s.add_subparsers(dest="checkpoint_command", required=True, metavar="COMMAND")
    c = csub.add_parser(
        "verify",
        help="check a checkpoint (or all of a run's) against its manifest: files, sizes, sha256; "
        "exit 2 when one is damaged",
    )
    c.add_argument("path", help="a checkpoints/step_* folder or a run directory")
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=cmd_checkpoint_verify)

    s = sub.add_parser(
        "eval",
        help="loss and perplexity on prepared data; (--task generate) the accuracy of greedy answers to chats; "
        "(--task reward / preference) held-out preference accuracy",
    )
    s.add_argument("--model", required=True, help="a run directory, checkpoint or Hugging Face folder")
    s.add_argument(
        "--data",
        required=True,
        help="loss: a folder made by `ladle data prepare` (or Megatron shards); generate: a chat jsonl",
    )
    s.add_argument(
        "--task",
        default="loss",
        choices=["loss", "generate", "reward", "preference"],
        help="reward / preference: held-out accuracy on preference data, of a reward model's scores / "
        "of a policy's completion log-probs",
    )
    s.add_argument(
        "--template", default=None, help="generate: a built-in chat template instead of the tokenizer's"
    )
    s.add_argument(
        "--scorer", default="exact", choices=["exact", "regex"], help="generate: how answers are compared"
    )
    s.add_argument("--answer-regex", default=None, help="generate: compare the first match (its first group)")
    s.add_argument("--max-new-tokens", type=int, default=64, help="generate")
    s.add_argument("--limit", type=int, default=0, help="generate: the first N records (0: all)")
    s.add_argument("--split", default="val", choices=["train", "val"])
    s.add_argument("--seq-len", type=int, default=0, help="default: the model's max_seq_len, at most 1024")
    s.add_argument("--batch-size", type=int, default=8)
    s.add_argument("--max-batches", type=int, default=0, help="0: the whole split")
    s.add_argument(
        "--no-doc-mask", action="store_true", help="plain causal rows, as transformers computes them"
    )
    s.add_argument("--tokenizer", default=None, help="default: the model's own")
    add_inference_args(s)
    s.set_defaults(fn=cmd_eval)

    s = sub.add_parser(
        "rank-table",
        help="Ascend: write HCCL's rank_table.json (from a hosts file and device IPs, or hccn_tool on "
        "this node), or --check one",
    )
    s.add_argument("--hosts", help="server IPs, one a line, in rank order")
    s.add_argument("--device-ips", help="'SERVER_IP DEVICE_ID DEVICE_IP' a line")
    s.add_argument("--hccn", action="store_true", help="this node's device IPs from hccn_tool")
    s.add_argument("--server-id", help="with --hccn: this server's IP (default: its hostname's)")
    s.add_argument("--devices-per-node", type=int, default=8)
    s.add_argument("-o", "--output", help="the file to write (default: standard output)")
    s.add_argument("--check", metavar="FILE", help="validate a rank table: exit 2 naming every problem")
    s.set_defaults(fn=cmd_rank_table)

    s = sub.add_parser(
        "doctor",
        help="is this machine ready: versions, devices, backends, environment, links, disk, GEMM peak "
        "(exit 1 when a check fails)",
    )
    s.add_argument("--output-dir", default="runs", help="where checkpoints will go (free space, write speed)")
    s.add_argument("--no-gemm", action="store_true", help="skip the GEMM measurement")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_doctor)

    s = sub.add_parser("generate", help="sample from a checkpoint or Hugging Face folder")
    s.add_argument("--model", required=True)
    s.add_argument("--prompt", action="append", help="repeatable; default: one prompt a line on stdin")
    s.add_argument("--tokenizer", default=None)
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--add-bos", action="store_true")
    s.add_argument(
        "--stop", action="append", help="repeatable; a row ends at this text, which is cut from the output"
    )
    s.add_argument("--json", action="store_true")
    add_inference_args(s)
    s.set_defaults(fn=cmd_generate)
    return p


def add_inference_args(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--device",
        default="auto",
        help="auto (the accelerator when there is one, else the CPU), cpu, cuda or npu",
    )
    s.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="of the loaded weights"
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # key.path=value overrides may stand anywhere after the command, also after options.
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return args.fn(args)
    except LadleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from ladle.train.loop import OutOfMemory, TrainingDiverged

        if isinstance(e, (TrainingDiverged, OutOfMemory)):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    raise SystemExit(main())
