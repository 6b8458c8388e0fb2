"""One rank of `gradsync bench` (started by `gradsync launch`): time each
collective at each size on daemon memory, and with `--vs gloo` the same on
torch's gloo over the same ranks; rank 0 prints the table (or JSON lines).

The timing loop here is the repository's only one: `measure()` times
benchmarks/ab_allreduce.py's allreduces, and `timed_samples()` (batches of
back-to-back collectives, each after a barrier) the samples of
benchmarks/allreduce.py and benchmarks/collectives.py; `bus_factor()` is their
busbw factor too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from gradsync.client import Client


def bus_factor(op: str, world: int) -> float:
    """nccl-tests' bus bandwidth factor: what each rank moves per byte of the size
    (allreduce 2(n-1)/n, broadcast 1, the gathers, scatters and all-to-all (n-1)/n)."""
    if op in ("allreduce", "all_reduce"):
        return 2 * (world - 1) / world
    return 1.0 if op == "broadcast" else (world - 1) / world


def timed_batch(run: Callable[[], object], k: int) -> int:
    """Nanoseconds of `k` back-to-back `run()`s."""
    start = time.perf_counter_ns()
    for _ in range(k):
        run()
    return time.perf_counter_ns() - start


def timed_samples(run: Callable[[], object], k: int, samples: int,
                  barrier: Callable[[], object] = lambda: None) -> list[int]:
    """`samples` timed batches of `k` runs (nanoseconds), each after `barrier()`, so
    that every rank starts each batch together."""
    times = []
    for _ in range(samples):
        barrier()
        times.append(timed_batch(run, k))
    return times


def measure(run: Callable[[], object], agree: Callable[[float], float], seconds: float) -> float:
    """Median seconds of `run()`, after a warm-up; every rank runs the same count
    (`agree` returns the largest count any rank asks for)."""
    run()
    first = timed_batch(run, 1) / 1e9
    count = int(agree(float(max(5, min(5000, int(seconds / max(first, 1e-6)))))))
    return statistics.median(timed_samples(run, 1, count)) / 1e9


def _gradsync_case(client: Client, op: str, nbytes: int) -> Callable[[], object]:
    """One collective of `nbytes` (nccl-tests' size: the whole buffer) on daemon memory."""
    world = client.world_size
    count = _elements(nbytes, world)
    if op == "allreduce":
        data = client.empty(count, np.float32)
        data[:] = 1.0
        return lambda: client.all_reduce(data)
    if op == "all_gather":
        part = client.empty(count // world, np.float32)
        whole = client.empty((world, count // world), np.float32)
        part[:] = 1.0
        return lambda: client.all_gather(whole, part)
    source = client.empty(count, np.float32)
    target = client.empty(count // world, np.float32)
    source[:] = 1.0
    return lambda: client.reduce_scatter(target, source)


def _gloo_case(op: str, nbytes: int, world: int) -> Callable[[], object]:
    import torch
    import torch.distributed as dist

    count = _elements(nbytes, world)
    if op == "allreduce":
        data = torch.ones(count)
        return lambda: dist.all_reduce(data)
    # Newer torch names them *_single (the old names warn); older torch has only those.
    if op == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        part, whole = torch.ones(count // world), torch.empty(count)
        return lambda: gather(whole, part)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    source, target = torch.ones(count), torch.empty(count // world)
    return lambda: scatter(target, source)


def _elements(nbytes: int, world: int) -> int:
    """float32 elements of a buffer of about `nbytes`, divisible by the ranks."""
    return max(world, nbytes // 4 // world * world)


def _auto_picks(client: Client) -> dict[str, Any]:
    """The daemon's `auto` picks for this job, by buffer bytes (its statistics)."""
    from gradsync.client.cli.stats import fetch_snapshot
    from gradsync.protocol.errors import GradsyncError

    try:
        job = fetch_snapshot(client.daemon + ".stats", 5.0)["jobs"].get(client.job, {})
    except GradsyncError:
        return {}
    return dict(job.get("auto") or {})


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with Client() as client:
        world = client.world_size

        def agree(value: float) -> float:
            box = np.array([value], np.float64)
            client.all_reduce(box, op="max")
            return float(box[0])

        one_node = world == client.local_world_size
        for op in args.ops:
            for asked in args.sizes:
                nbytes = _elements(asked, world) * 4
                seconds = measure(_gradsync_case(client, op, nbytes), agree, args.seconds)
                # Between daemons all-gather and reduce-scatter are ring plans.
                algorithm = "local" if one_node else ("auto" if op == "allreduce" else "ring")
                rows.append(_row("gradsync", op, nbytes, world, seconds, algorithm))
        if not one_node and "allreduce" in args.ops:
            picks = _auto_picks(client)
            for row in rows:
                if row["op"] == "allreduce":
                    row["algorithm"] = picks.get(str(row["size"]), {}).get("last") or "auto"
        if "gloo" in args.vs:
            import torch.distributed as dist

            dist.init_process_group("gloo", rank=client.rank, world_size=world)
            try:
                for op in args.ops:
                    for asked in args.sizes:
                        nbytes = _elements(asked, world) * 4
                        seconds = measure(_gloo_case(op, nbytes, world), agree, args.seconds)
                        rows.append(_row("gloo", op, nbytes, world, seconds, ""))
            finally:
                dist.destroy_process_group()
        rank = client.rank
    return rows if rank == 0 else []


def _row(library: str, op: str, nbytes: int, world: int, seconds: float,
         algorithm: str) -> dict[str, Any]:
    algbw = nbytes / seconds / 1e9
    return {"library": library, "op": op, "size": nbytes, "ranks": world,
            "time_us": seconds * 1e6, "algbw_gbps": algbw,
            "busbw_gbps": algbw * bus_factor(op, world), "algorithm": algorithm}


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'library':<9}{'op':<15}{'size (B)':>12}{'time (us)':>12}{'algbw GB/s':>12}"
             f"{'busbw GB/s':>12}  algorithm"]
    for row in rows:
        lines.append(f"{row['library']:<9}{row['op']:<15}{row['size']:>12}"
                     f"{row['time_us']:>12.1f}{row['algbw_gbps']:>12.3f}"
                     f"{row['busbw_gbps']:>12.3f}  {row['algorithm'] or '-'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradsync bench (rank)")
    parser.add_argument("--sizes", type=lambda t: [int(x) for x in t.split(",")], required=True)
    parser.add_argument("--ops", type=lambda t: t.split(","), required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--vs", type=lambda t: [x for x in t.split(",") if x], default=[])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = run(args)
    if rows:
        if args.json:
            for row in rows:
                print(json.dumps(row))
        else:
            print(table(rows))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
