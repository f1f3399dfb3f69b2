"""The machine and the runs: `ladle doctor`, `ladle rank-table` (Ascend), `ladle bench comm | data`,
`ladle report` and `ladle compare`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ladle.errors import LadleError


def cmd_doctor(args) -> int:
    from ladle.doctor import FAIL, as_json, format_checks, run_checks

    checks = run_checks(args.output_dir, gemm=not args.no_gemm)
    print(json.dumps(as_json(checks), indent=2) if args.json else format_checks(checks))
    return 1 if any(c.status == FAIL for c in checks) else 0


def cmd_rank_table(args) -> int:
    from ladle.launch import ranktable

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
    from ladle.ops.report import report

    print(f"wrote {report(args.run, args.output)}")
    return 0


def cmd_compare(args) -> int:
    from ladle.ops.report import compare

    text, page = compare(args.runs, args.output)
    print(text)
    print(f"\nwrote {page}")
    return 0


def _doctor_parser(sub, recipes) -> None:
    s = sub.add_parser(
        "doctor",
        help="is this machine ready: versions, devices, backends, environment, links, disk, GEMM peak "
        "(exit 1 when a check fails)",
    )
    s.add_argument("--output-dir", default="runs", help="where checkpoints will go (free space, write speed)")
    s.add_argument("--no-gemm", action="store_true", help="skip the GEMM measurement")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_doctor)


def _rank_table_parser(sub, recipes) -> None:
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


def _bench_parser(sub, recipes) -> None:
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
    b.add_argument("--recipe", choices=recipes, help="default: pretrain")
    b.add_argument("--steps", type=int, default=50)
    b.add_argument("--step-s", type=float, help="a step's time in seconds to compare with")
    b.add_argument("--run", help="a run directory: its median step time from metrics.jsonl")
    b.add_argument("--json", action="store_true")
    b.add_argument("overrides", nargs="*", metavar="key.path=value")
    b.set_defaults(fn=cmd_bench_data)


def _report_parser(sub, recipes) -> None:
    s = sub.add_parser("report", help="plots and one HTML page of a run")
    s.add_argument("run", help="a run directory (output_dir)")
    s.add_argument("--output", help="default: RUN/report/")
    s.set_defaults(fn=cmd_report)


def _compare_parser(sub, recipes) -> None:
    s = sub.add_parser("compare", help="config differences, summary metrics and loss curves of runs")
    s.add_argument("runs", nargs="+", metavar="RUN")
    s.add_argument("--output", help="default: the first run's compare/")
    s.set_defaults(fn=cmd_compare)


COMMANDS = {  # command -> the function that adds its sub-parser
    "doctor": _doctor_parser,
    "rank-table": _rank_table_parser,
    "bench": _bench_parser,
    "report": _report_parser,
    "compare": _compare_parser,
}
