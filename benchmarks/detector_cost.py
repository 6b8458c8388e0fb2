"""What the adaptive failure detector costs a training step: DDP step time with
`--failure-detector adaptive` (the default) against `timeout`, same run.

    python -m benchmarks.detector_cost [--rounds 3] [--steps 10] [--rate 2gbit]

Two daemons, one rank each, in two network namespaces joined by a veth pair
(benchmarks/topology.py; created and deleted here): unshaped, and with
`--rate` also shaped with tbf to that rate each way.  The daemons run their
defaults but for the detector (and `--insecure`, as in
benchmarks/compression.py, whose cluster this reuses); the ranks train torch
DDP on backend gradsync, uncompressed, with the 25 M-parameter model of
benchmarks/compression.py (a 5000 x 5000 linear layer, float32, batch 8).
Each round starts both daemons afresh with each setting in turn, A B A B, and
the ranks time `--steps` steps after 2 warm-up steps.  Prints, per link and
setting, the median of all steps, the spread of the rounds' medians (max -
min) and the machine's load average before and after.  Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks import topology
from benchmarks.compression import cluster
from benchmarks.processes import clean_env
from gradsync.client.cli.stats import fetch_snapshot

SETTINGS = ("adaptive", "timeout")
WARMUP = 2
#: A round's ranks are killed after this long (a hung rank must not hang the run).
RANK_TIMEOUT_S = 600


def ddp_rank(steps: int) -> list[float]:
    """Seconds of each DDP step after the warm-up (this rank's)."""
    import torch
    import torch.distributed as dist

    import gradsync.client.torch  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group("gradsync", rank=int(os.environ["RANK"]), world_size=2)
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(5000, 5000))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    batch = torch.randn(8, 5000)
    times = []
    for step in range(steps + WARMUP):
        start = time.perf_counter()
        optimizer.zero_grad()
        ddp(batch).square().mean().backward()
        optimizer.step()
        if step >= WARMUP:  # storages are shared with the daemon from the second use
            times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    return times


def run_round(topo: topology.Topology, setting: str, steps: int, store_port: int) -> list[float]:
    """Fresh daemons with `--failure-detector setting`, one DDP rank on each; the
    step times of rank 0 (the ranks' steps end together: DDP waits for both)."""
    with cluster(topo, ("--failure-detector", setting)) as daemons:
        for daemon in daemons:  # the daemons run what is measured
            running = fetch_snapshot(daemon + ".stats", 10.0)["config"]["failure_detector"]
            if running != setting:
                raise RuntimeError(f"{daemon} runs detector {running!r}, not {setting!r}")
        ranks = [
            subprocess.Popen(
                [
                    *topo.prefix(rank),
                    sys.executable,
                    "-m",
                    "benchmarks.detector_cost",
                    "--as-rank",
                    str(steps),
                ],
                env=clean_env(
                    RANK=str(rank),
                    WORLD_SIZE="2",
                    LOCAL_RANK="0",
                    LOCAL_WORLD_SIZE="1",
                    GRADSYNC_DAEMON=daemons[rank],
                    GRADSYNC_JOB="bench-detector",
                    MASTER_ADDR=topo.hosts[0],
                    MASTER_PORT=str(store_port),
                    OMP_NUM_THREADS="1",
                ),
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in range(topo.size)
        ]
        try:
            outputs = [rank.communicate(timeout=RANK_TIMEOUT_S)[0] for rank in ranks]
        finally:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
                    rank.wait()
        if any(rank.returncode for rank in ranks):
            raise RuntimeError(f"a rank failed: {outputs}")
    return [float(t) for t in json.loads(outputs[0].strip().splitlines()[-1])]


def load() -> str:
    with open("/proc/loadavg") as handle:
        return " ".join(handle.read().split()[:3])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="A B rounds per link (3)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round (10)")
    parser.add_argument(
        "--rate", default=None, help="also on a link shaped to this rate (tc syntax, e.g. 2gbit)"
    )
    parser.add_argument("--as-rank", type=int, metavar="STEPS", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.as_rank is not None:
        print(json.dumps(ddp_rank(args.as_rank)), flush=True)
        return 0
    reason = topology.namespaces_unavailable(shaped=args.rate is not None)
    if reason:
        print(f"detector_cost: {reason}", file=sys.stderr)
        return 2
    if args.rate is not None:
        topology.check_rate(args.rate)
    topology.sweep_stale()
    links = [
        ("veth, unshaped", None),
        *([(f"veth, tbf {args.rate}", args.rate)] if args.rate else []),
    ]
    print(f"load average before: {load()} ({os.cpu_count()} cores)")
    print(
        "\n| link | detector | median step (ms) | round medians (ms) | spread of round "
        "medians (ms) | steps min-max (ms) | vs adaptive |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    port = topology.NETNS_BASE_PORT + 50
    for name, rate in links:
        with topology.namespaces(2, rate) as topo:
            times: dict[str, list[list[float]]] = {setting: [] for setting in SETTINGS}
            for _ in range(args.rounds):
                for setting in SETTINGS:
                    port += 1  # a fresh store port: the last one may linger in TIME_WAIT
                    times[setting].append(run_round(topo, setting, args.steps, port))
        base = statistics.median(t for r in times["adaptive"] for t in r)
        for setting in SETTINGS:
            pooled = [t for r in times[setting] for t in r]
            medians = [statistics.median(r) for r in times[setting]]
            median = statistics.median(pooled)
            print(
                f"| {name} | {setting} | {median * 1e3:.0f} | "
                f"{', '.join(f'{m * 1e3:.0f}' for m in medians)} | "
                f"{(max(medians) - min(medians)) * 1e3:.0f} | "
                f"{min(pooled) * 1e3:.0f}-{max(pooled) * 1e3:.0f} | {median / base:.3f} |"
            )
    print(f"\nload average after: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
