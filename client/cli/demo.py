"""`gradsync demo`, the command: its options, and the launch of its ranks.

The ranks run `gradsync.client.cli.demo_rank`, which trains with numpy (or torch); this
side only parses, checks and launches, so it imports neither: `gradsync`
builds every subcommand's options at start, and no command should pay for
numpy's import to show its help or to ping.
"""

from __future__ import annotations

import argparse
import os
import sys

from gradsync.client.cli.launch import LaunchInterrupted, SignalForwarder, daemon_for, run_ranks
from gradsync.protocol.endpoint import default_endpoint

BACKENDS = ("auto", "torch", "numpy")


def _note(message: str) -> None:
    print(f"gradsync demo: {message}", file=sys.stderr, flush=True)


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=2, metavar="N",
                        help="data-parallel ranks on this node (default 2)")
    parser.add_argument("--epochs", type=int, default=8, help="passes over the data (default 8)")
    parser.add_argument("--batch-size", type=int, default=32, metavar="B",
                        help="samples per rank per step; a step's global batch is nproc x B, "
                        "which the single-process reference takes at once (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="data, shuffling and init (default 0)")
    parser.add_argument("--hidden", type=int, default=128, metavar="H",
                        help="width of the two hidden layers (default 128)")
    parser.add_argument("--samples", type=int, default=1536,
                        help="size of the generated spiral data set (default 1536)")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="SGD learning rate, momentum 0.9 (default 0.05)")
    parser.add_argument("--bucket-kib", type=float, default=32.0, metavar="KIB",
                        help="gradient bucket size; small, so the small model has several "
                        "(default 32)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="torch DistributedDataParallel, numpy GradientBucketer, or auto: "
                        "torch when it is installed (default)")
    parser.add_argument("--daemon", default=None, metavar="ENDPOINT",
                        help="use the daemon here; a private one is started if none answers "
                        f"(default: $GRADSYNC_DAEMON or {default_endpoint()})")
    # Perturbs the last rank's parameters once mid-training: the check must catch it.
    parser.add_argument("--_break", action="store_true", help=argparse.SUPPRESS)


#: Options the ranks get from the command (everything but --nproc and --daemon).
_FORWARDED = ("epochs", "batch_size", "seed", "hidden", "samples", "lr", "bucket_kib",
              "backend")


def _problem(args: argparse.Namespace) -> str | None:
    checks = [
        (args.nproc >= 1, "--nproc must be at least 1"),
        (args.epochs >= 1, "--epochs must be at least 1"),
        (args.batch_size >= 1, "--batch-size must be at least 1"),
        (args.hidden >= 1, "--hidden must be at least 1"),
        (args.lr > 0, "--lr must be positive"),
        (args.bucket_kib > 0, "--bucket-kib must be positive"),
        (args.samples >= args.nproc * args.batch_size,
         f"--samples {args.samples} is fewer than one global batch "
         f"({args.nproc} ranks x {args.batch_size})"),
    ]
    return next((message for ok, message in checks if not ok), None)


def run_demo(args: argparse.Namespace) -> int:
    """`gradsync demo`: a daemon (found or private) and `--nproc` ranks of the demo."""
    problem = _problem(args)
    if problem is not None:
        print(f"gradsync demo: {problem}", file=sys.stderr)
        return 2
    # Small matrices: BLAS and torch threads beyond the cores of a rank only fight (one
    # core is left to the daemon).
    threads = str(max(1, len(os.sched_getaffinity(0)) // (args.nproc + 1)))
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, threads)
    command = [sys.executable, "-m", "gradsync.client.cli.demo_rank"]
    for name in _FORWARDED:
        command += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if args._break:
        command.append("--_break")
    with SignalForwarder() as signals:
        try:
            with daemon_for(args.daemon, signals=signals, report=_note) as endpoint:
                return run_ranks(command, args.nproc, endpoint, f"demo-{os.getpid()}",
                                 signals=signals)
        except LaunchInterrupted as interrupted:
            print(f"gradsync demo: interrupted by signal {interrupted.signum} while starting",
                  file=sys.stderr)
            return 128 + interrupted.signum
