"""Allreduce time per op on one daemon or two: the workload of a before/after A/B.

A restructuring must not change speed.  This runs the same allreduces on
whatever gradsync the interpreter imports (put a tree's `.mypy-src` first on
PYTHONPATH to choose one) and prints one line, the median seconds per op at
each size as rank 0 saw them, so that two trees can be run in turn, A B A B,
and compared pair by pair:

    python -m benchmarks.ab_allreduce --daemons 1 --sizes 4K,1M,64M
    python -m benchmarks.ab_allreduce --daemons 2 --sizes 4K,1M,64M

One daemon: `gradsync launch --nproc-per-node 2`.  Two daemons: two
`gradsync launch` nodes on 127.0.0.1 (`--insecure`), one rank each.  Arrays
are daemon memory (`Client.empty`), so the figures are the daemons' own work.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'4K' -> 4096; a plain number is bytes."""
    text = text.strip().upper()
    if text and text[-1] in UNITS:
        return int(text[:-1]) * UNITS[text[-1]]
    return int(text)


def run_rank(sizes: list[int], seconds: float) -> None:
    """One rank: a warm-up, then allreduces of each size for about `seconds`."""
    import numpy as np

    from gradsync.client import Client
    from gradsync.client.cli.bench_rank import measure  # gradsync bench's timing loop

    with Client() as client:

        def agree(value: float) -> float:  # every rank runs the largest count asked for
            box = np.array([value], np.float64)
            client.all_reduce(box, op="max")
            return float(box[0])

        medians = []
        for nbytes in sizes:
            array = client.empty(nbytes // 4, np.float32)
            array[:] = 1.0
            medians.append(measure(lambda a=array: client.all_reduce(a), agree, seconds))
            del array
        if client.rank == 0:
            cells = " ".join(f"{size}={median * 1e6:.1f}us"
                             for size, median in zip(sizes, medians, strict=True))
            sys.stdout.write(f"RESULT daemons={os.environ.get('AB_DAEMONS', '?')} {cells}\n")
            sys.stdout.flush()


def launch(daemons: int, size_args: str, seconds: float) -> int:
    """Start the ranks under `gradsync launch`, one node per daemon; their exit status."""
    rank_args = [os.path.abspath(__file__), "--as-rank", "--sizes", size_args,
                 "--seconds", str(seconds)]
    env = {**os.environ, "AB_DAEMONS": str(daemons)}
    cli = [sys.executable, "-m", "gradsync.client.cli", "launch"]
    if daemons == 1:
        return subprocess.call([*cli, "--nproc-per-node", "2", "--job", "ab", *rank_args],
                               env=env)
    from benchmarks.topology import free_ports  # not in a rank: it runs as a plain script

    ports = free_ports(daemons + 1)
    peers = ",".join(f"tcp://127.0.0.1:{port}" for port in ports[:daemons])
    nodes = [
        subprocess.Popen([*cli, "--nnodes", str(daemons), "--node-rank", str(node),
                          "--nproc-per-node", "1", "--job", "ab",
                          "--listen", f"tcp://127.0.0.1:{ports[node]}", "--peers", peers,
                          "--insecure", "--master-port", str(ports[-1]), *rank_args], env=env)
        for node in range(daemons)
    ]
    return max(node.wait(timeout=900) for node in nodes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--daemons", type=int, default=1, choices=(1, 2))
    parser.add_argument("--sizes", default="4K,1M,64M", help="comma-separated, e.g. 4K,1M")
    parser.add_argument("--seconds", type=float, default=1.0,
                        help="about how long to time each size")
    parser.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [parse_size(text) for text in args.sizes.split(",")]
    if args.as_rank:
        run_rank(sizes, args.seconds)
        return 0
    return launch(args.daemons, args.sizes, args.seconds)


if __name__ == "__main__":
    sys.exit(main())
