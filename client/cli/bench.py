"""`gradsync bench`: the nccl-tests table (size, time, algbw, busbw, algorithm)
for allreduce, all-gather and reduce-scatter over this node's daemon, or over
a whole job's when `gradsync launch`'s node options follow `--`; `--vs gloo`
times torch's gloo on the same ranks.  The ranks are `bench_rank.py` under
`gradsync launch`, which starts a private daemon when none answers."""

from __future__ import annotations

import argparse
import os

from gradsync.client.cli.doctor import byte_count

#: The collectives it times (bench_rank.py takes them from here).
OPS = ("allreduce", "all_gather", "reduce_scatter")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc-per-node", type=int, default=2, metavar="N",
                        help="ranks on this node (default 2)")
    parser.add_argument("--sizes", default="4KiB,1MiB,16MiB",
                        help="comma-separated sizes (default 4KiB,1MiB,16MiB)")
    parser.add_argument("--ops", default=",".join(OPS),
                        help=f"comma-separated, of {', '.join(OPS)} (default all)")
    parser.add_argument("--seconds", type=float, default=1.0,
                        help="about how long to time each size (default 1)")
    parser.add_argument("--vs", default="", choices=("", "gloo"),
                        help="also time torch's gloo on the same ranks")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    parser.add_argument("launch_args", nargs=argparse.REMAINDER,
                        help="after --: gradsync launch options (--nnodes, --node-rank, "
                        "--daemon, --listen, --peers, ...)")


def run_bench(args: argparse.Namespace) -> int:
    from gradsync.client.cli import bench_rank
    from gradsync.client.cli.launch import add_launch_arguments, log, run_launch

    try:
        sizes = [byte_count(text) for text in args.sizes.split(",")]
    except argparse.ArgumentTypeError as exc:
        log(f"--sizes: {exc}")
        return 2
    ops = [op for op in args.ops.split(",") if op]
    unknown = sorted(set(ops) - set(OPS))
    if unknown or not ops:
        log(f"--ops: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(OPS)}")
        return 2
    rank_args = ["--sizes", ",".join(map(str, sizes)), "--ops", ",".join(ops),
                 "--seconds", str(args.seconds), "--vs", args.vs]
    if args.json:
        rank_args.append("--json")
    extra = [a for a in args.launch_args if a != "--"]
    launcher = argparse.ArgumentParser(prog="gradsync bench --", allow_abbrev=False)
    add_launch_arguments(launcher)
    launch = launcher.parse_args(["--nproc-per-node", str(args.nproc_per_node), *extra,
                                  os.path.abspath(bench_rank.__file__), *rank_args])
    return run_launch(launch)
