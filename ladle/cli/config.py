"""`ladle ls`, `cp`, `validate` and `plan`: the bundled configs, a config checked as every process
will see it, and the memory planner before launch."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from ladle.errors import ConfigError, LadleError


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
    from ladle.launch.checks import check
    from ladle.recipes import load

    cfg = load_config(args.config, args.overrides)
    recipe = load(args.recipe) if args.recipe else None
    found = check(cfg, recipe, world=args.nproc, paths=not args.no_paths)
    cfg, lay = found.cfg, found.layout
    if lay is not None:
        print(f"# layout for {args.nproc} processes: {lay.describe()}", file=sys.stderr)
    sys.stdout.write(to_yaml(cfg))
    print(f"# config hash: {config_hash(cfg)}", file=sys.stderr)
    return 0


def cmd_plan(args) -> int:
    from ladle.checkpoint.init_from import resolve_config
    from ladle.config.load import load_config
    from ladle.plan import Target, plan
    from ladle.recipes import RECIPES
    from ladle.units import parse_size

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


def _ls_parser(sub, recipes) -> None:
    s = sub.add_parser("ls", help="list recipes and bundled configs")
    s.set_defaults(fn=cmd_ls)


def _cp_parser(sub, recipes) -> None:
    s = sub.add_parser("cp", help="copy a bundled config out for editing")
    s.add_argument("config")
    s.add_argument("dest")
    s.add_argument("--force", action="store_true")
    s.set_defaults(fn=cmd_cp)


def _validate_parser(sub, recipes) -> None:
    s = sub.add_parser("validate", help="load, override and validate a config; print the resolved YAML")
    s.add_argument("--config", required=True)
    s.add_argument("--no-paths", action="store_true", help="check the schema only, not tokenizer and data")
    s.add_argument(
        "--nproc", type=int, default=0, help="also check the parallel layout for this many processes in all"
    )
    s.add_argument(
        "--recipe",
        choices=recipes,
        help="also the recipe's own checks: its data task, the models it reads, what its layout may be "
        "(a separated placement's groups)",
    )
    s.add_argument("overrides", nargs="*", metavar="key.path=value")
    s.set_defaults(fn=cmd_validate)


def _plan_parser(sub, recipes) -> None:
    s = sub.add_parser("plan", help="memory per device and the layouts that fit, before launching")
    s.add_argument("--config", required=True)
    s.add_argument("--devices", type=int, required=True, help="devices in all")
    s.add_argument("--device-memory", required=True, help="memory of one device: 64GB, 64GiB, 80g")
    s.add_argument("--devices-per-node", type=int, default=0, help="default: 8 (or --devices if fewer)")
    s.add_argument(
        "--recipe", choices=recipes, help="default: named in the config's file name, else pretrain"
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


COMMANDS = {  # command -> the function that adds its sub-parser
    "ls": _ls_parser,
    "cp": _cp_parser,
    "validate": _validate_parser,
    "plan": _plan_parser,
}
