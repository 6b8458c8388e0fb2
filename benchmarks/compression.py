"""Compressed allreduce between daemons: codec cost, link speed-up, DDP step time.

    python -m benchmarks.compression [--rate 2gbit] [--iterations 8] [--steps 6]

1. The wire codecs on one core (daemon/backends/wire_codec.py): GB/s of
   float32 input encoded (rounding in place included) and decoded-and-added,
   C module (each variant of its kernels this CPU runs: avx512, avx2, baseline)
   and numpy, 4 MiB slices, with the CPU's model name.
2. Two daemons, one rank each, 64 MiB float32 sum allreduce (ring, the
   default daemon settings), uncompressed, bf16 and fp8: on 127.0.0.1 (what
   compression costs in CPU where the link is fast) and in two network
   namespaces joined by a veth pair shaped with tbf to `--rate` each way
   (benchmarks/topology.py; created and deleted here).  busbw = 2(M-1)/M x
   bytes / time, and as a fraction of the link rate.
3. torch DDP on that shaped link: a 25 M-parameter model (5000 x 5000 linear,
   float32), median step time uncompressed, bf16, fp8 on backend gradsync, and
   torch's fp16_compress_hook on gloo (ranks in the namespaces).
Prints the tables (markdown).  Needs root and iproute2 for 2 and 3.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import numpy as np

from benchmarks import machine, topology
from benchmarks.private_daemon import daemon_cluster
from benchmarks.processes import clean_env

MIB = 1 << 20
#: The CPU features the codec variants use (wire_codec.variants()).
SIMD_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"})
MODES = ("none", "bf16", "fp8", "auto")


def codec_rows() -> list[str]:
    """Markdown rows: format, implementation (each variant of the C module's kernels this
    CPU runs, the one chosen at run time marked, then numpy), encode and decode+add GB/s."""
    from gradsync.daemon.backends import wire_codec

    count = MIB  # 4 MiB of float32
    values = np.random.default_rng(0).standard_normal(count).astype(np.float32)
    compiled, chosen = wire_codec._wirecodec, wire_codec.variant()
    rows = []
    for name, codec in wire_codec.CODECS.items():
        for variant in (*wire_codec.variants(), None):
            if variant is None:
                wire_codec._wirecodec = None
            else:
                wire_codec.set_variant(variant)
            try:
                work = values.copy()
                encode = _best(lambda: codec.encode(work))  # noqa: B023
                payload = codec.encode(values.copy())
                target = np.zeros(count, np.float32)
                decode = _best(lambda: codec.decode_into(payload, target, True))  # noqa: B023
            finally:
                wire_codec._wirecodec = compiled
                if chosen is not None:
                    wire_codec.set_variant(chosen)
            label = ("numpy" if variant is None else
                     f"C {variant}{' (run-time choice)' if variant == chosen else ''}")
            ratio = codec.nbytes(count) / (4 * count)
            rows.append(f"| {name} | {label} | {4 * count / encode / 1e9:.2f} | "
                        f"{4 * count / decode / 1e9:.2f} | {ratio:.3f} |")
    return rows


def lane_rows(slice_bytes: int = 4 * MIB) -> list[str]:
    """Markdown rows: the daemon's own codec-rate measurement (run/codec_rates.py, what
    `auto` weighs: encode plus decode-and-add, every lane at once) at 1, 2 and 4 lanes."""
    import concurrent.futures

    from gradsync.daemon.run.codec_rates import measure_codec_rates

    rows = []
    for lanes in (1, 2, 4):
        with concurrent.futures.ThreadPoolExecutor(max_workers=lanes) as pool:
            rates = measure_codec_rates(pool, lanes, slice_bytes)
        rows.append(f"| {lanes} | {rates.get('bf16', 0) / 1e9:.2f} | "
                    f"{rates.get('fp8', 0) / 1e9:.2f} |")
    return rows


def _best(step: object, repeats: int = 15) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return min(times)


@contextlib.contextmanager
def cluster(topo: topology.Topology, extra: Sequence[str] = ()) -> Iterator[list[str]]:
    """Two --insecure daemons on `topo` (plus `extra` flags); yields their client endpoints."""
    endpoints = topo.endpoints()[0]
    flags = [["--listen", endpoints[i], "--peers", ",".join(endpoints), "--insecure", *extra]
             for i in range(topo.size)]
    with daemon_cluster(flags, [topo.prefix(i) for i in range(topo.size)]) as runs:
        yield [run.endpoint for run in runs]


def run_ranks(topo: topology.Topology, daemons: list[str], args: list[str],
              master: str) -> list[dict[str, object]]:
    """One rank per daemon (inside its namespace) running this module's --as-rank."""
    port = str(topology.NETNS_BASE_PORT + 50 if topo.kind == "netns" else
               topology.free_ports(1)[0])
    ranks = [subprocess.Popen(
        [*topo.prefix(rank), sys.executable, "-m", "benchmarks.compression", "--as-rank",
         *args],
        env=clean_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      GRADSYNC_DAEMON=daemons[rank], GRADSYNC_JOB="bench-compression",
                      MASTER_ADDR=master, MASTER_PORT=port, OMP_NUM_THREADS="1",
                      GLOO_SOCKET_IFNAME=topo.interfaces[rank]),
        stdout=subprocess.PIPE, text=True) for rank in range(len(daemons))]
    deadline = time.monotonic() + 900
    while any(rank.poll() is None for rank in ranks):
        if any(rank.returncode for rank in ranks) or time.monotonic() > deadline:
            for rank in ranks:  # one failed (or all hang): the others would wait forever
                rank.kill()
        time.sleep(0.05)
    outputs = [rank.communicate()[0] for rank in ranks]
    if any(rank.returncode for rank in ranks):
        raise RuntimeError(f"a rank failed: {outputs}")
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


def allreduce_rank(iterations: int) -> dict[str, object]:
    """Median seconds of a 64 MiB allreduce per mode.

    The modes take turns, each turn in its own order (shuffled alike on every
    rank), and every timed call starts from a barrier: identical calls timed
    back to back differ by up to 10 % by their place in the turn alone (the rank
    that returns first from the call before waits for the other inside the next
    one; what a compressed call leaves behind is freed in the next), so a fixed
    order would charge one mode for its neighbour (measured 2026-12-05: `none`
    twice in a fixed order, 38.8 against 35.3 ms)."""
    from gradsync.client import Client

    order = random.Random(0)  # the same orders on every rank: the calls must match
    with Client() as client:
        array = client.empty(16 * MIB, np.float32)
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for turn in range(iterations + 1):
            for mode in order.sample(MODES, len(MODES)):
                array[:] = 1.0
                client.barrier()
                start = time.perf_counter()
                client.all_reduce(array, compression=mode)
                if turn:  # the first round warms up
                    times[mode].append(time.perf_counter() - start)
        return {mode: statistics.median(values) for mode, values in times.items()} | {
            f"{mode} spread": max(values) - min(values) for mode, values in times.items()}


def ddp_rank(steps: int) -> dict[str, object]:
    """Median DDP step seconds per mode on a 25 M-parameter model."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    import gradsync.client.torch  # noqa: F401
    from gradsync.client.torch.compression import set_compression

    torch.set_num_threads(1)
    dist.init_process_group("gradsync", rank=int(os.environ["RANK"]), world_size=2)
    gloo = dist.new_group(backend="gloo")
    results = {}
    for mode in (*MODES, "gloo_fp16_hook"):
        torch.manual_seed(0)
        model = torch.nn.Linear(5000, 5000)
        group = gloo if mode == "gloo_fp16_hook" else None
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        if group is not None:
            ddp.register_comm_hook(group, fp16_compress_hook)
        else:
            set_compression(None, mode)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        batch = torch.randn(8, 5000)
        times = []
        for step in range(steps + 2):
            start = time.perf_counter()
            optimizer.zero_grad()
            ddp(batch).square().mean().backward()
            optimizer.step()
            if step >= 2:  # storages are shared with the daemon from the second use
                times.append(time.perf_counter() - start)
        results[mode] = statistics.median(times)
    dist.destroy_process_group()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="2gbit")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--codec-lanes", type=int, default=None,
                        help="the daemons' --codec-lanes (a tuned flag; default: theirs)")
    parser.add_argument("--as-rank", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.as_rank is not None:
        kind, count = args.as_rank
        result = allreduce_rank(int(count)) if kind == "allreduce" else ddp_rank(int(count))
        print(json.dumps(result), flush=True)
        return 0
    from gradsync.daemon.backends import wire_codec

    flags = set(machine.cpu_flags())
    print(f"Wire codecs on one core of {machine.cpu_model()} (flags: "
          f"{' '.join(sorted(flags & SIMD_FLAGS)) or 'none of ' + ' '.join(sorted(SIMD_FLAGS))}; "
          f"run-time choice: {wire_codec.variant()}):\n")
    print("| format | codec | encode GB/s | decode+add GB/s | wire bytes per byte |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(codec_rows()))
    print(f"\nThe daemon's codec rate (encode + decode-and-add, GB/s of float32 input, "
          f"every lane at once) by lanes, on {os.cpu_count()} cores:\n")
    print("| lanes | bf16 | fp8 |")
    print("| --- | --- | --- |")
    print("\n".join(lane_rows()))
    rate_bps = float(args.rate[:-4]) * {"g": 1e9, "m": 1e6, "k": 1e3}[args.rate[-4]] / 8
    nbytes = 64 * MIB
    print("\n| link | format | time (ms) | max - min (ms) | busbw (GB/s) | of link rate "
          "| speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, make in (("127.0.0.1", lambda: topology.loopback(2)),
                       (f"veth, tbf {args.rate}", lambda: topology.namespaces(2, args.rate))):
        lanes = () if args.codec_lanes is None else ("--codec-lanes", str(args.codec_lanes))
        with make() as topo, cluster(topo, lanes) as daemons:
            (medians, _) = run_ranks(topo, daemons, ["allreduce", str(args.iterations)],
                                     topo.hosts[0])
            for mode in MODES:
                seconds = float(medians[mode])  # type: ignore[arg-type]
                busbw = nbytes / seconds  # 2(M-1)/M = 1 for M = 2
                share = f"{busbw / rate_bps:.2f}" if topo.kind == "netns" else "-"
                spread = float(medians[f"{mode} spread"])  # type: ignore[arg-type]
                print(f"| {name} | {mode} | {seconds * 1e3:.1f} | {spread * 1e3:.1f} "
                      f"| {busbw / 1e9:.3f} | {share} "
                      f"| {float(medians['none']) / seconds:.2f}x |")  # type: ignore[arg-type]
            if topo.kind == "netns":
                (steps, _) = run_ranks(topo, daemons, ["ddp", str(args.steps)], topo.hosts[0])
    print(f"\n| torch DDP, 25 M parameters, veth tbf {args.rate} | step (ms) | speed-up |")
    print("| --- | --- | --- |")
    for mode, seconds in steps.items():
        print(f"| {mode} | {float(seconds) * 1e3:.0f} | "  # type: ignore[arg-type]
              f"{float(steps['none']) / float(seconds):.2f}x |")  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
