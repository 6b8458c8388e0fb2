"""Collectives benchmark, nccl-tests style: gradsync (empty() buffers) vs torch gloo.

    python -m benchmarks.collectives [--sizes 64KiB,1MiB,16MiB,64MiB] [--nproc 2,4]
                                     [--out benchmarks/RESULTS.md]

all_gather, reduce_scatter, broadcast, all_to_all and (as the reference row)
all_reduce, float32, N local ranks, in one run.  Starts a private gradsyncd
(`private_daemon`), runs the gradsync ranks through `gradsync launch` and the
gloo ranks as plain processes (`processes`), prints one table per N and with
--out writes the `collectives` section of RESULTS.md (other sections kept).
The same module is the rank program (`python -m benchmarks.collectives --worker`).
Run from the repository root.  See README.md.

Size convention: the total buffer, i.e. all_gather's output, reduce_scatter's
input, broadcast's buffer, all_to_all's per-rank send buffer, all_reduce's buffer.
busbw = algbw * factor (nccl-tests): all_gather, reduce_scatter, all_to_all
(N-1)/N; broadcast 1; all_reduce 2(N-1)/N.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks import machine, results_file
from benchmarks.plan import SamplePolicy, format_size, parse_sizes
from benchmarks.private_daemon import private_daemon
from benchmarks.processes import (
    command_line,
    log_tail,
    module_command,
    rank_env,
    run_all,
    signals_unwind,
)
from benchmarks.report import format_bw, format_time
from gradsync.client.cli.bench_rank import bus_factor, timed_batch, timed_samples

KIB, MIB = 1024, 1024 * 1024
DEFAULT_SIZES = (64 * KIB, MIB, 16 * MIB, 64 * MIB)
COLLECTIVES = ("all_gather", "reduce_scatter", "broadcast", "all_to_all", "all_reduce")
CONTENDERS = {"gradsync": "gradsync empty()", "gloo": "torch gloo"}
SECTION = "collectives"
#: k back-to-back ops per sample: fewer than allreduce.py's 100/10, so that
#: oversubscribed gloo (N = 4 on 2 cores, ~6 ms per small op) fits the time budget.
POLICY = SamplePolicy(budget_s=0.4, min_samples=5, max_samples=40, ops_small=20, ops_medium=5)


def log(message: str) -> None:
    print(f"[collectives] {message}", file=sys.stderr, flush=True)


# -- rank side ----------------------------------------------------------------


def rank_input(rank: int, count: int) -> np.ndarray:
    """Rank r's input: (i mod 251) + 256 (r + 1): small integers, sums exact, rank-distinct."""
    return (np.arange(count, dtype=np.int64) % 251 + 256 * (rank + 1)).astype(np.float32)


def expected(collective: str, rank: int, nproc: int, count: int) -> np.ndarray:
    """What this rank's output must hold, computed with numpy from every rank's input.

    `count` is the element count of the size (the total buffer, see the module doc).
    """
    chunk = count // nproc
    if collective == "all_gather":
        return np.concatenate([rank_input(r, chunk) for r in range(nproc)])
    if collective == "reduce_scatter":
        total = sum(rank_input(r, count) for r in range(nproc))
        return total[rank * chunk : (rank + 1) * chunk]
    if collective == "broadcast":
        return rank_input(0, count)
    if collective == "all_to_all":
        return np.concatenate(
            [rank_input(r, count)[rank * chunk : (rank + 1) * chunk] for r in range(nproc)]
        )
    return sum(rank_input(r, count) for r in range(nproc))


class Gradsync:
    def __init__(self) -> None:
        from gradsync.client import Client

        self.client = Client()
        self.rank, self.nproc = self.client.rank, self.client.world_size
        self.daemon_pid: int | None = self.client.daemon_pid
        self._agree = self.client.empty(1, np.float64)

    def alloc(self, count: int) -> np.ndarray:
        array: np.ndarray = self.client.empty(count, np.float32)
        return array

    def op(self, collective: str, out: np.ndarray, inp: np.ndarray) -> Callable[[], Any]:
        c = self.client
        if collective == "all_gather":
            return lambda: c.all_gather(out, inp)
        if collective == "reduce_scatter":
            return lambda: c.reduce_scatter(out, inp, op="sum")
        if collective == "broadcast":
            return lambda: c.broadcast(inp, src=0)
        if collective == "all_to_all":
            return lambda: c.all_to_all(out, inp)
        return lambda: c.all_reduce(inp, op="sum")

    def barrier(self) -> None:
        self.client.barrier()

    def agree_max(self, value: float) -> float:
        self._agree[0] = value
        self.client.all_reduce(self._agree, op="max")
        return float(self._agree[0])

    def close(self) -> None:
        self.client.close()


class Gloo:
    def __init__(self, init_file: str, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        warnings.filterwarnings("ignore", category=FutureWarning)  # *_tensor deprecations
        self.torch, self.dist = torch, dist
        self.rank, self.nproc = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.daemon_pid = None
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=self.rank,
            world_size=self.nproc, timeout=datetime.timedelta(seconds=timeout_s),
        )

    def alloc(self, count: int) -> np.ndarray:
        return np.empty(count, np.float32)

    def op(self, collective: str, out: np.ndarray, inp: np.ndarray) -> Callable[[], Any]:
        d = self.dist
        o = self.torch.from_numpy(out) if out is not None else None
        i = self.torch.from_numpy(inp)
        if collective == "all_gather":
            return lambda: d.all_gather_into_tensor(o, i)
        if collective == "reduce_scatter":
            return lambda: d.reduce_scatter_tensor(o, i, op=d.ReduceOp.SUM)
        if collective == "broadcast":
            return lambda: d.broadcast(i, src=0)
        if collective == "all_to_all":
            return lambda: d.all_to_all_single(o, i)
        return lambda: d.all_reduce(i, op=d.ReduceOp.SUM)

    def barrier(self) -> None:
        self.dist.barrier()

    def agree_max(self, value: float) -> float:
        t = self.torch.tensor([value], dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t[0])

    def close(self) -> None:
        self.dist.destroy_process_group()


def buffers(rt: Gradsync | Gloo, collective: str, count: int) -> tuple[Any, np.ndarray]:
    """(output or None, input) for one collective of `count` total elements."""
    chunk = count // rt.nproc
    if collective == "all_gather":
        return rt.alloc(count), rt.alloc(chunk)
    if collective == "reduce_scatter":
        return rt.alloc(chunk), rt.alloc(count)
    if collective == "all_to_all":
        return rt.alloc(count), rt.alloc(count)
    return None, rt.alloc(count)


def measure(rt: Gradsync | Gloo, collective: str, nbytes: int) -> dict[str, Any]:
    count = nbytes // 4
    out, inp = buffers(rt, collective, count)
    op = rt.op(collective, out, inp)
    inp[:] = rank_input(rt.rank, inp.size)
    rt.barrier()
    op()
    result = inp if out is None else out
    want = expected(collective, rt.rank, rt.nproc, count)
    bad = np.flatnonzero(result != want)
    wrong = None
    if bad.size:
        first = int(bad[0])
        wrong = (f"{bad.size} of {want.size} elements wrong; first at {first}: "
                 f"got {float(result[first])}, want {float(want[first])}")
    if collective == "all_reduce":
        inp.fill(0.0)  # zeros: repeated sums stay finite
    k = POLICY.ops_for(nbytes)
    rt.barrier()
    timed_batch(op, k)  # warm-up
    rt.barrier()
    samples = POLICY.samples_for(rt.agree_max(timed_batch(op, k) / 1e9))
    cpu0 = time.process_time()
    times = timed_samples(op, k, samples, rt.barrier)
    cpu = time.process_time() - cpu0
    del out, inp, result
    return {"collective": collective, "nbytes": nbytes, "k": k, "samples_ns": times,
            "cpu_s": cpu, "wrong": wrong}


def worker(args: argparse.Namespace) -> int:
    rt: Gradsync | Gloo = (
        Gradsync() if args.contender == "gradsync" else Gloo(args.init_file, args.timeout_s)
    )
    path = os.path.join(args.out_dir, f"{args.contender}-n{rt.nproc}-rank{rt.rank}.json")
    document: dict[str, Any] = {"rank": rt.rank, "records": [], "error": None}
    status = 0
    try:
        for nbytes in parse_sizes(args.sizes):
            for collective in args.collectives.split(","):
                document["records"].append(measure(rt, collective, nbytes))
    except BaseException as exc:
        document["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        status = 1
    with open(path, "w") as out:
        json.dump(document, out)
    if status == 0:
        rt.close()
    return status


# -- driver side ----------------------------------------------------------------


@dataclasses.dataclass
class Cell:
    time_s: float
    p10_s: float
    p90_s: float
    samples: int
    k: int
    wrong: str | None


def merge(run_dir: str, contender: str, nproc: int) -> tuple[dict[tuple[str, int], Cell], str]:
    """Slowest rank per sample, median per op; and any error the ranks recorded."""
    docs, errors = [], []
    for rank in range(nproc):
        path = os.path.join(run_dir, f"{contender}-n{nproc}-rank{rank}.json")
        if not os.path.exists(path):
            errors.append(f"rank {rank}: no result file")
            continue
        with open(path) as source:
            docs.append(json.load(source))
        if docs[-1]["error"]:
            errors.append(f"rank {rank}: {docs[-1]['error']}")
    cells: dict[tuple[str, int], Cell] = {}
    if len(docs) == nproc:
        for records in zip(*(doc["records"] for doc in docs), strict=False):
            samples = np.array([rec["samples_ns"] for rec in records], dtype=np.float64)
            per_op = samples.max(axis=0) / records[0]["k"] / 1e9
            wrong = "; ".join(f"rank {r}: {rec['wrong']}"
                              for r, rec in enumerate(records) if rec["wrong"])
            cells[(records[0]["collective"], records[0]["nbytes"])] = Cell(
                float(np.median(per_op)), float(np.percentile(per_op, 10)),
                float(np.percentile(per_op, 90)), per_op.size, records[0]["k"], wrong or None)
    return cells, "; ".join(errors)


def run_one(contender: str, nproc: int, args: argparse.Namespace, run_dir: str,
            endpoint: str | None) -> tuple[dict[tuple[str, int], Cell], str, float]:
    worker = module_command(
        "collectives", "--worker", "--contender", contender,
        "--sizes", ",".join(str(s) for s in args.size_list), "--collectives", args.collectives,
        "--out-dir", run_dir, "--init-file", os.path.join(run_dir, f"{contender}-{nproc}.store"),
        "--timeout-s", str(args.timeout_s),
    )
    log_path = os.path.join(run_dir, f"{contender}-n{nproc}.log")
    if contender == "gradsync":
        assert endpoint is not None
        commands = [([sys.executable, "-m", "gradsync.client.cli", "launch",
                      "--nproc-per-node", str(nproc), "--daemon", endpoint,
                      "--job", f"coll-n{nproc}", *worker], rank_env())]
    else:
        commands = [
            (worker,
             rank_env(RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r),
                      LOCAL_WORLD_SIZE=str(nproc), GLOO_SOCKET_IFNAME="lo"))
            for r in range(nproc)
        ]
    started = time.perf_counter()
    failure = run_all(commands, log_path, args.timeout_s)
    wall = time.perf_counter() - started
    cells, errors = merge(run_dir, contender, nproc)
    note = "; ".join(x for x in (failure, errors) if x)
    if note:
        log(f"{contender} N={nproc} failed: {note}\n{log_tail(log_path)}")
    return cells, note, wall


def cell_text(cell: Cell | None, collective: str, nbytes: int, nproc: int) -> tuple[str, str]:
    if cell is None:
        return "failed", "—"
    if cell.wrong:
        return f"WRONG ({format_time(cell.time_s)})", "—"
    busbw = nbytes / cell.time_s / 1e9 * bus_factor(collective, nproc)
    return format_time(cell.time_s), format_bw(busbw)


def table(results: dict[tuple[str, int], dict[tuple[str, int], Cell]], nproc: int,
          sizes: Sequence[int], collectives: Sequence[str]) -> str:
    lines = [
        "| collective | size | gradsync empty() time | busbw GB/s | torch gloo time | "
        "busbw GB/s | gradsync / gloo busbw |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for collective in collectives:
        for nbytes in sizes:
            row = [collective, format_size(nbytes)]
            cells = [results.get((c, nproc), {}).get((collective, nbytes)) for c in CONTENDERS]
            for cell in cells:
                row.extend(cell_text(cell, collective, nbytes, nproc))
            ours, theirs = cells
            ratio = (f"{theirs.time_s / ours.time_s:.2f}x"
                     if ours and theirs and not ours.wrong and not theirs.wrong else "—")
            lines.append("| " + " | ".join([*row, ratio]) + " |")
    return "\n".join(lines)


def spread_table(results: dict[tuple[str, int], dict[tuple[str, int], Cell]]) -> str:
    lines = ["| N | contender | collective | size | samples x k | per-op p10 to p90 |",
             "|---|---|---|---|---:|---:|"]
    for (contender, nproc), cells in sorted(results.items(), key=lambda kv: kv[0][1]):
        for (collective, nbytes), cell in cells.items():
            lines.append(f"| {nproc} | {CONTENDERS[contender]} | {collective} | "
                         f"{format_size(nbytes)} | {cell.samples} x {cell.k} | "
                         f"{format_time(cell.p10_s)} to {format_time(cell.p90_s)} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                        help="total buffer sizes (default 64KiB,1MiB,16MiB,64MiB)")
    parser.add_argument("--nproc", default="2,4", help="local rank counts (default 2,4)")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES))
    parser.add_argument("--contenders", default="gradsync,gloo")
    parser.add_argument("--out", metavar="RESULTS.md",
                        help="write the 'collectives' section of this file")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--keep", action="store_true", help="keep per-rank JSON and logs")
    # rank side
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    parser.add_argument("--init-file", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    signals_unwind()
    args.size_list = parse_sizes(args.sizes)
    nprocs = [int(n) for n in args.nproc.split(",") if n.strip()]
    collectives = [c for c in args.collectives.split(",") if c]
    contenders = [c for c in args.contenders.split(",") if c]
    bad = [c for c in collectives if c not in COLLECTIVES] + [
        c for c in contenders if c not in CONTENDERS]
    if bad or any(n < 2 for n in nprocs):
        print(f"collectives: unknown {bad} or N < 2", file=sys.stderr)
        return 2
    for nbytes in args.size_list:
        for nproc in nprocs:
            if nbytes % (4 * nproc):
                print(f"collectives: {nbytes} B does not split into {nproc} float32 chunks",
                      file=sys.stderr)
                return 2
    started_at = datetime.datetime.now().astimezone()
    started = time.perf_counter()
    run_dir = tempfile.mkdtemp(prefix="gsb-coll-", dir="/tmp")
    results: dict[tuple[str, int], dict[tuple[str, int], Cell]] = {}
    problems: list[str] = []
    daemon_command = None
    try:
        with private_daemon() as daemon:
            daemon_command = daemon.shown_command()
            for nproc in nprocs:
                for contender in contenders:
                    log(f"N={nproc}: {CONTENDERS[contender]} ...")
                    cells, note, wall = run_one(contender, nproc, args, run_dir, daemon.endpoint)
                    results[(contender, nproc)] = cells
                    log(f"N={nproc}: {CONTENDERS[contender]} done in {wall:.0f}s")
                    if note:
                        problems.append(f"- {CONTENDERS[contender]}, N={nproc}: {note}")
                    problems += [
                        f"- {CONTENDERS[contender]}, N={nproc}, {coll} {format_size(nb)}: "
                        f"WRONG RESULT: {cell.wrong}"
                        for (coll, nb), cell in cells.items() if cell.wrong
                    ]
        if daemon.exit_code != 0:
            problems.append(f"- gradsyncd exited with status {daemon.exit_code} on SIGTERM")
        if daemon.leaked_segments:
            problems.append(f"- gradsyncd left {len(daemon.leaked_segments)} /dev/shm "
                            "segments (removed by the benchmark)")
    except KeyboardInterrupt:
        log("interrupted; ranks and daemon stopped")
        return 130
    finally:
        if args.keep:
            log(f"per-rank results and logs kept in {run_dir}")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)

    tables = {n: table(results, n, args.size_list, collectives) for n in nprocs}
    for nproc, text in tables.items():
        print(f"\n### N = {nproc}\n\n{text}")
    for line in problems:
        log(line)
    if args.out:
        write(args, argv, started_at, time.perf_counter() - started, tables, results,
              problems, daemon_command)
        log(f"wrote section '{SECTION}' of {args.out}")
    return 1 if problems else 0


def write(args: argparse.Namespace, argv: Sequence[str] | None,
          started_at: datetime.datetime, duration_s: float, tables: dict[int, str],
          results: dict[tuple[str, int], dict[tuple[str, int], Cell]],
          problems: list[str], daemon_command: str | None) -> None:
    info = machine.describe()
    out = [
        "# Collectives benchmark: gradsync vs torch gloo\n",
        f"Recorded {started_at.strftime('%Y-%m-%d %H:%M %Z')}, {duration_s:.0f} s in all, on "
        f"{info['CPU']} (torch {info['torch']}, gradsync {info['gradsync']}). Reproduce from "
        "the repository root (venv active):\n",
        f"```\n{command_line(__file__, argv)}\n```\n",
        "float32, N ranks on this one node, every rank with `OMP_NUM_THREADS=1`. gradsync: "
        "`Client.all_gather` / `reduce_scatter` / `broadcast(src=0)` / `all_to_all` / "
        "`all_reduce` on buffers from `Client.empty()` (input and output), private daemon "
        f"`{daemon_command}`. torch gloo (file:// store): `all_gather_into_tensor`, "
        "`reduce_scatter_tensor`, `broadcast`, `all_to_all_single`, `all_reduce` on "
        "`torch.from_numpy` views. **size** is the total buffer: all_gather's output, "
        "reduce_scatter's input, the broadcast buffer, all_to_all's per-rank send buffer, "
        "all_reduce's buffer. Each collective and size is checked once against numpy "
        "(every element of every rank's output) before timing. time = median over samples "
        f"of the slowest rank's time for k back-to-back ops / k (k = {POLICY.ops_small} up "
        f"to 64 KiB, {POLICY.ops_medium} up to 1 MiB, 1 above; a barrier before each "
        f"sample; samples for about {POLICY.budget_s:g} s, {POLICY.min_samples} to "
        f"{POLICY.max_samples}). busbw = bytes / time × (N−1)/N for all_gather, "
        "reduce_scatter and all_to_all, × 1 for broadcast, × 2(N−1)/N for all_reduce "
        "(nccl-tests). The last column is gloo's time / gradsync's time.\n",
    ]
    for nproc, text in tables.items():
        note = f" ({os.cpu_count()} cores: oversubscribed)" if nproc > (os.cpu_count() or 1) else ""
        out += [f"## Collectives, N = {nproc}{note}\n", text, ""]
    if problems:
        out += ["## Collectives: problems in this run\n", *problems, ""]
    out += ["## Collectives: spread\n", spread_table(results), ""]
    results_file.write_section(args.out, SECTION, "\n".join(out),
                               writer="benchmarks/collectives.py")


if __name__ == "__main__":
    sys.exit(main())
