"""The `ladle` command: parse, validate, call into the package. User errors exit 2, no traceback.

One module per group of commands, each with the functions that add its sub-parsers (`COMMANDS`)
and its `cmd_*` functions, which import what they run only when they run: config (ls, cp,
validate, plan), run (run, launch slurm), data (tokenizer, data), models (export, checkpoint,
eval, generate), rewards (rewards score), tools (doctor, rank-table, bench, report, compare).
"""

from __future__ import annotations

import argparse
import sys

from ladle.cli import config, data, models, rewards, run, tools
from ladle.errors import LadleError

COMMANDS = {
    name: add for group in (config, run, data, models, rewards, tools) for name, add in group.COMMANDS.items()
}
# the order `ladle --help` lists them in
ORDER = (
    "ls", "cp", "validate", "plan", "bench", "report", "compare", "run", "launch", "tokenizer", "data",
    "export", "checkpoint", "eval", "rewards", "rank-table", "doctor", "generate",
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    from ladle.recipes import RECIPES

    p = argparse.ArgumentParser(prog="ladle", description="Training recipes for large language models.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in sorted(COMMANDS, key=ORDER.index):  # a command left out of ORDER fails here
        COMMANDS[name](sub, RECIPES)
    return p


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
