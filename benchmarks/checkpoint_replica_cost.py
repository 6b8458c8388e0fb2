"""What a checkpoint every step, replicated to a peer daemon, costs a DDP step (issue 50).

    python -m benchmarks.checkpoint_replica_cost [--rate 2gbit] [--mib 96] [--blocks 4]
        [--block-steps 8]

Two nodes: network namespaces joined by a veth pair shaped to RATE each way with
tbf (benchmarks/topology.py), one daemon each with CURVE keys (sealed data
streams) and the daemons' defaults (so `--checkpoint-replicas 1`: each node's
parts also go to the other node, in the link's idle time between collectives;
`--checkpoint-replicas 0` turns that off, to tell the replicas' cost from the
save's own).
One rank per node: torch DDP on backend "gradsync", Adam on a model whose state
(parameters + Adam's two moments) is about MIB MiB.  In one run, blocks of
BLOCK_STEPS steps take turns, A B C A B C ... (BLOCKS of each, after a warm-up
block): A trains alone; B also saves a DCP checkpoint of the model and the
optimizer into the daemon (`DaemonStorageWriter`) after every step with
`dcp.save`; C the same with `dcp.async_save` (over a gloo group, which torch
requires; the save of the step before is awaited first).  The first
two steps of each block are left out (replicas of the block before may still be
on the wire).  Rank 0's step times (the ranks step together): median and spread
per way, its cost against A, the step split into training and the save's
blocking time, and how many of the checkpoints the daemons replicated (a newer
step replaces one still waiting).

Prints markdown tables.  Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import machine, topology
from benchmarks.checkpoint_recovery import kill_ranks, sealed_flags, spawn_ranks
from benchmarks.private_daemon import daemon_cluster
from benchmarks.processes import (
    exit_without_destructors,
    wait_all,
)

MIB = 1 << 20
WIDTH = 2048
#: Steps at the start of each block left out of the medians.
SETTLE = 2
JOB = "bench-replica-cost"
#: A: no checkpoint; B: dcp.save every step; C: dcp.async_save every step.
WAYS = "ABC"
NAMES = {
    "A": "A: no checkpoint",
    "B": "B: dcp.save every step",
    "C": "C: dcp.async_save every step",
}


def _layers(mib: int) -> int:
    """Linear(WIDTH, WIDTH) layers whose parameters and Adam moments make about `mib` MiB."""
    return max(1, round(mib * MIB / (3 * (WIDTH * WIDTH + WIDTH) * 4)))


def worker(mib: int, blocks: int, block_steps: int, batch: int) -> None:
    """One rank: the warm-up block, then A and B blocks in turns; rank 0 prints the
    times of every step as one JSON line."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import gradsync.client.torch  # noqa: F401
    from gradsync.client.torch.checkpoint import DaemonStorageWriter

    torch.set_num_threads(1)
    dist.init_process_group("gradsync")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(_layers(mib))]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    writer = DaemonStorageWriter(job=JOB)
    # torch's async_save takes only groups that name a CPU backend: a gloo one.
    gloo = dist.new_group(backend="gloo")
    pending = None
    steps: list[dict[str, Any]] = []
    step = 0
    for block in range(len(WAYS) * blocks + 1):
        way = "warm-up" if block == 0 else WAYS[(block - 1) % len(WAYS)]
        for index in range(block_steps):
            started = time.perf_counter()
            inputs = torch.randn(batch, WIDTH, generator=torch.Generator().manual_seed(step))
            optimizer.zero_grad()
            model(inputs).square().mean().backward()
            optimizer.step()
            trained = time.perf_counter()
            if pending is not None:  # the async save of the step before
                pending.result()
                pending = None
            awaited = time.perf_counter()
            if way != "A":
                model_state, optim_state = get_state_dict(model, optimizer)
                state = {"model": model_state, "optim": optim_state, "step": torch.tensor(step)}
                if way == "C":
                    pending = dcp.async_save(
                        state, storage_writer=writer, checkpoint_id=str(step), process_group=gloo
                    )
                else:
                    dcp.save(state, storage_writer=writer, checkpoint_id=str(step))
            done = time.perf_counter()
            steps.append(
                {
                    "way": way,
                    "index": index,
                    "step_s": done - started,
                    "train_s": trained - started,
                    "await_s": awaited - trained,
                    "save_s": done - awaited,
                }
            )
            step += 1
    if pending is not None:
        pending.result()
    dist.barrier()
    if rank == 0:
        print(json.dumps({"steps": steps}), flush=True)
    dist.destroy_process_group()
    exit_without_destructors(0)


def _spread(values: list[float]) -> str:
    return f"{min(values) * 1e3:.0f}-{max(values) * 1e3:.0f}"


def run(rate: str, mib: int, blocks: int, block_steps: int, batch: int, replicas: int) -> None:
    topology.sweep_stale()
    folder = Path(tempfile.mkdtemp(prefix="ckpt-replica-cost-", dir="/tmp"))
    try:
        steps, replicated = _measure(folder, rate, mib, blocks, block_steps, batch, replicas)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    _report(steps, replicated, rate, mib, blocks, block_steps, batch, replicas)


def _measure(
    folder: Path, rate: str, mib: int, blocks: int, block_steps: int, batch: int, replicas: int
) -> tuple[list[dict[str, Any]], list[list[float]]]:
    """Every step rank 0 timed, and the seconds of each replica each daemon made."""
    with contextlib.ExitStack() as stack:
        topo = stack.enter_context(topology.namespaces(2, rate))
        flags = [[*f, "--checkpoint-replicas", str(replicas)] for f in sealed_flags(topo, folder)]
        runs = stack.enter_context(daemon_cluster(flags, [topo.prefix(0), topo.prefix(1)]))
        logs = [folder / f"rank{rank}.log" for rank in range(2)]
        args = [str(mib), str(blocks), str(block_steps), str(batch)]
        ranks = spawn_ranks(
            args,
            [run.endpoint for run in runs],
            logs,
            topo,
            port=topology.NETNS_BASE_PORT + 60,
            module="checkpoint_replica_cost",
        )
        stack.callback(kill_ranks, ranks)  # before the daemons and namespaces go
        failed = wait_all(ranks, 1800)
        if failed:
            tails = "\n".join(log.read_text(errors="replace")[-3000:] for log in logs)
            raise RuntimeError(f"{failed}:\n{tails}")
        daemon_logs = [run.log() for run in runs]
    output = logs[0].read_text(errors="replace").splitlines()
    steps = json.loads(next(line for line in reversed(output) if line.startswith("{")))["steps"]
    pattern = rf"of job '{JOB}' replicated on \S+ \((\d+) bytes, ([\d.]+)s\)"
    return steps, [[float(t) for _, t in re.findall(pattern, text)] for text in daemon_logs]


def _report(
    steps: list[dict[str, Any]],
    replicated: list[list[float]],
    rate: str,
    mib: int,
    blocks: int,
    block_steps: int,
    batch: int,
    replicas: int,
) -> None:
    kept = [s for s in steps if s["way"] in WAYS and s["index"] >= SETTLE]
    by = {way: [s for s in kept if s["way"] == way] for way in WAYS}
    saved = sum(1 for s in steps if s["way"] != "A")
    state_mib = _layers(mib) * 3 * (WIDTH * WIDTH + WIDTH) * 4 / MIB
    print(
        f"torch DDP over 2 namespace nodes (veth, tbf {rate} each way), 1 rank per node, "
        f"{state_mib:.0f} MiB of state ({_layers(mib)} x Linear({WIDTH}, {WIDTH}) + Adam), "
        f"batch {batch}; {machine.cpu_model()}, {os.cpu_count()} cores shared by both "
        f"nodes; {blocks} blocks of {block_steps} steps per way, A B C A B C, the first "
        f"{SETTLE} of each block left out; daemons with `--checkpoint-replicas {replicas}`"
        f"{' (their default)' if replicas == 1 else ''}, sealed streams\n"
    )
    print(
        "| way | steps | median step (ms) | min-max (ms) | median training (ms) "
        "| median wait for the async save before (ms) | median save call (ms) "
        "| against A |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = statistics.median(s["step_s"] for s in by["A"])
    for way, name in NAMES.items():
        values = [s["step_s"] for s in by[way]]
        median = statistics.median(values)
        print(
            f"| {name} | {len(values)} | {median * 1e3:.0f} | {_spread(values)} "
            f"| {statistics.median(s['train_s'] for s in by[way]) * 1e3:.0f} "
            f"| {statistics.median(s['await_s'] for s in by[way]) * 1e3:.0f} "
            f"| {statistics.median(s['save_s'] for s in by[way]) * 1e3:.0f} "
            f"| {(median / base - 1) * 100:+.1f} % |"
        )
    print(
        "\nsave call: get_state_dict and dcp.save or dcp.async_save.  Checkpoints saved "
        f"(warm-up, B and C): {saved}; replicated to the peer, as the daemons' logs say: "
        + "; ".join(
            f"node {node} {len(times)}"
            + (f", median {statistics.median(times):.2f} s each" if times else "")
            for node, times in enumerate(replicated)
        )
        + "."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rate", default="2gbit", help="each node's link rate (tc syntax)")
    parser.add_argument("--mib", type=int, default=96, help="the model + Adam state, MiB")
    parser.add_argument("--blocks", type=int, default=4, help="blocks per way")
    parser.add_argument("--block-steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--checkpoint-replicas",
        type=int,
        default=1,
        help="the daemons' --checkpoint-replicas (1, their default; 0: none, "
        "to tell the replicas' cost from the save's own)",
    )
    parser.add_argument("--worker", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker[:3], args.worker[3])
        return 0
    topology.check_rate(args.rate)
    reason = topology.namespaces_unavailable(shaped=True)
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    run(args.rate, args.mib, args.blocks, args.block_steps, args.batch, args.checkpoint_replicas)
    return 0


if __name__ == "__main__":
    sys.exit(main())
