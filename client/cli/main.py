"""`gradsync`: the parser and the dispatch of every subcommand.

Building the parser imports every subcommand's module, so those modules import
only what their options need: numpy, ZeroMQ and the like load inside the
function that runs a command (tests/test_cli_imports.py keeps it so).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

from gradsync.client.cli.bench import add_bench_arguments, run_bench
from gradsync.client.cli.demo import add_demo_arguments, run_demo
from gradsync.client.cli.doctor import add_doctor_arguments, run_doctor
from gradsync.client.cli.keygen import add_keygen_arguments, run_keygen
from gradsync.client.cli.launch import add_launch_arguments, run_launch
from gradsync.client.cli.ping import ping
from gradsync.client.cli.stats import (
    add_stats_arguments,
    add_trace_arguments,
    run_stats,
    run_top,
    run_trace,
)
from gradsync.protocol.endpoint import default_endpoint
from gradsync.protocol.version import __version__


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: a mistyped or shortened flag is an error, not a
    # guess (`--thread 4` must not quietly mean --threads).
    parser = argparse.ArgumentParser(
        prog="gradsync", description="gradsync command line", allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"gradsync {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_command = functools.partial(commands.add_parser, allow_abbrev=False)

    launch = add_command(
        "launch",
        help="start N ranks of a script on this node (and a private daemon if none runs)",
        description="Start --nproc-per-node copies of SCRIPT with RANK, WORLD_SIZE, "
        "LOCAL_RANK, LOCAL_WORLD_SIZE, GRADSYNC_DAEMON and GRADSYNC_JOB set.",
    )
    add_launch_arguments(launch)

    demo = add_command(
        "demo",
        help="train a small MLP on N data-parallel ranks and check it against one process",
        description="Train an MLP on a generated spiral data set with --nproc ranks whose "
        "gradients gradsync averages during backward (torch DDP if installed, else numpy), "
        "then check that every rank holds the same parameters as single-process training "
        "on the full batches; exit 1 if not.",
    )
    add_demo_arguments(demo)

    keygen = add_command(
        "keygen", help="create a CURVE keypair for a daemon's peer links",
        description="Write NAME.key (public: copy it into every peer's authorized folder) "
        "and NAME.key_secret (mode 0600: stays on this node) in DIR.",
    )
    add_keygen_arguments(keygen)

    stats = add_command(
        "stats", help="a daemon's live statistics (table, JSON, Prometheus)"
    )
    add_stats_arguments(stats)
    top = add_command("top", help="a live, refreshing view of a daemon's statistics")
    add_stats_arguments(top, live=True)

    trace = add_command(
        "trace", help="record collective phases for a while, write a Chrome trace (Perfetto)"
    )
    add_trace_arguments(trace)

    ping_parser = add_command("ping", help="check that a daemon answers")
    ping_parser.add_argument(
        "--daemon", default=None, metavar="ENDPOINT",
        help=f"daemon endpoint (default: $GRADSYNC_DAEMON or {default_endpoint()})",
    )
    ping_parser.add_argument("--timeout-s", type=float, default=5.0,
                             help="how long one try waits for the answer (default 5)")
    ping_parser.add_argument(
        "--wait", type=float, default=0.0, metavar="SECONDS",
        help="try again until the daemon answers or SECONDS have passed (default: try once), "
        "e.g. right after starting it",
    )
    bench = add_command(
        "bench", help="time allreduce, all-gather, reduce-scatter (nccl-tests' table)",
        description="Time each collective at each size over this node's daemon (a private "
        "one if none answers), or a whole job's with gradsync launch options after --; "
        "--vs gloo times torch's gloo on the same ranks.",
    )
    add_bench_arguments(bench)
    doctor = add_command(
        "doctor", help="check this node (and its peers) for what makes training fail",
        description="Check /dev/shm, the daemon's socket and protocol, its peers' links and "
        "ports, CURVE key files, limits, the fast path's C module and the torch backend; "
        "each ok, warning or problem with its fix. Exit 1 if any problem.",
    )
    add_doctor_arguments(doctor)
    for command in commands.choices.values():
        command.set_defaults(command_parser=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        # argparse leaves a subcommand's unknown flags to the top-level parser, whose
        # usage says nothing about them: show the subcommand's usage instead.
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "launch":
        return int(run_launch(args))
    if args.command == "demo":
        return int(run_demo(args))
    if args.command == "stats":
        return int(run_stats(args))
    if args.command == "trace":
        return int(run_trace(args))
    if args.command == "top":
        return int(run_top(args))
    if args.command == "keygen":
        return int(run_keygen(args))
    if args.command == "bench":
        return int(run_bench(args))
    if args.command == "doctor":
        return int(run_doctor(args))
    if args.command == "ping":
        return int(ping(args.daemon, args.timeout_s, args.wait))
    return 2


if __name__ == "__main__":
    sys.exit(main())
