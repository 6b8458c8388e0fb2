"""From per-rank sample files to tables: slowest rank per sample, medians, bandwidths.

time   = median over samples of (slowest rank's sample time / k)
algbw  = bytes / time
busbw  = algbw * 2 (N - 1) / N      (nccl-tests' convention for allreduce)
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.plan import CONTENDERS, LATENCY_SIZE, TITLES, format_size

#: Every known contender key, in table order (single-node ones first).
CONTENDER_ORDER = {key: index for index, key in enumerate(TITLES)}


@dataclasses.dataclass
class Cell:
    """One contender, one N, one size."""

    nbytes: int
    nproc: int
    ops_per_sample: int
    samples: int
    time_s: float
    p10_s: float
    p90_s: float
    correct: bool
    wrong_detail: str | None
    cores_busy: float | None  # CPU seconds of all ranks (+ daemons) per wall second
    daemon_cores: float | None  # of which the daemons' (every distinct one, summed)
    latency_median_s: float | None
    latency_p99_s: float | None
    latency_ops: int

    @property
    def algbw(self) -> float:
        return self.nbytes / self.time_s / 1e9

    @property
    def busbw(self) -> float:
        return self.algbw * 2 * (self.nproc - 1) / self.nproc


@dataclasses.dataclass
class ContenderRun:
    """One contender at one N: its cells, or why there are none."""

    key: str
    nproc: int
    status: str  # "ok", "skipped", "failed"
    note: str = ""
    cells: dict[int, Cell] = dataclasses.field(default_factory=dict)
    wall_s: float = 0.0
    background_cores: float | None = None  # CPU used by unrelated processes meanwhile
    quiet_wait_s: float = 0.0
    repeat: int = 1


def select_runs(all_runs: Sequence[ContenderRun]) -> list[ContenderRun]:
    """Per contender and N, the repeat that other processes disturbed least.

    Chosen by background load, not by speed, so a shared machine's bursts are
    dropped without picking the luckiest timings.  Failed repeats lose to
    successful ones.
    """

    def badness(run: ContenderRun) -> tuple[int, float]:
        load = run.background_cores if run.background_cores is not None else float("inf")
        return (0 if run.status == "ok" else 1, load)

    best: dict[tuple[str, int], ContenderRun] = {}
    for run in all_runs:
        key = (run.key, run.nproc)
        if key not in best or badness(run) < badness(best[key]):
            best[key] = run
    return list(best.values())


def merge_ranks(documents: Sequence[dict[str, Any]], nproc: int) -> dict[int, Cell]:
    """Combine every rank's records into cells (sizes every rank finished)."""
    per_rank = [{rec["nbytes"]: rec for rec in doc["sizes"]} for doc in documents]
    common = set(per_rank[0]).intersection(*per_rank[1:])
    cells: dict[int, Cell] = {}
    for nbytes in sorted(common):
        records = [ranks[nbytes] for ranks in per_rank]
        k = int(records[0]["ops_per_sample"])
        samples = np.array([rec["samples_ns"] for rec in records], dtype=np.float64)
        per_op = samples.max(axis=0) / k / 1e9
        wall = max(rec["wall_s"] for rec in records)
        daemon_cpu = _daemons_cpu_s(records)
        rank_cpu = sum(rec["cpu_s"] for rec in records)
        latency_median = latency_p99 = None
        latency_ops = 0
        if all(rec["latency_ns"] for rec in records):
            latency = np.array([rec["latency_ns"] for rec in records], dtype=np.float64)
            slowest = latency.max(axis=0) / 1e9
            latency_median = float(np.median(slowest))
            latency_p99 = float(np.percentile(slowest, 99))
            latency_ops = int(slowest.size)
        wrong = [
            f"rank {rank}: {rec['wrong_detail']}"
            for rank, rec in enumerate(records)
            if not (rec["correct_before"] and rec["correct_after"])
        ]
        cells[nbytes] = Cell(
            nbytes=nbytes,
            nproc=nproc,
            ops_per_sample=k,
            samples=int(per_op.size),
            time_s=float(np.median(per_op)),
            p10_s=float(np.percentile(per_op, 10)),
            p90_s=float(np.percentile(per_op, 90)),
            correct=not wrong,
            wrong_detail="; ".join(wrong) or None,
            cores_busy=(rank_cpu + (daemon_cpu or 0.0)) / wall if wall > 0 else None,
            daemon_cores=daemon_cpu / wall if daemon_cpu is not None and wall > 0 else None,
            latency_median_s=latency_median,
            latency_p99_s=latency_p99,
            latency_ops=latency_ops,
        )
    return cells


def _daemons_cpu_s(records: Sequence[dict[str, Any]]) -> float | None:
    """CPU seconds of the daemons the ranks used: each distinct daemon counted once.

    Ranks of one node share a daemon; ranks of a multi-daemon job each name
    theirs by pid.  Records without a pid (older files) count the first only.
    """
    by_daemon: dict[Any, float] = {}
    for rec in records:
        cpu = rec.get("daemon_cpu_s")
        if cpu is None:
            continue
        pid = rec.get("daemon_pid")
        by_daemon.setdefault(pid if pid is not None else "unknown", float(cpu))
    return sum(by_daemon.values()) if by_daemon else None


def load_rank_files(paths: Sequence[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The rank documents that exist, and the errors any of them recorded."""
    documents, errors = [], []
    for path in paths:
        if not os.path.exists(path):
            errors.append(f"{os.path.basename(path)} missing")
            continue
        with open(path) as source:
            document = json.load(source)
        documents.append(document)
        if document.get("error"):
            errors.append(f"rank {document['rank']}: {document['error']}")
    return documents, errors


# -- formatting -------------------------------------------------------------


def format_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def format_bw(gbps: float) -> str:
    if gbps >= 0.01:
        return f"{gbps:.3g}"
    return f"{gbps:.2g}"


def _cell_text(run: ContenderRun | None, nbytes: int) -> tuple[str, str]:
    if run is None or run.status == "skipped":
        return "skipped", "—"
    cell = run.cells.get(nbytes)
    if cell is None:
        return "failed", "—"
    if not cell.correct:
        return f"WRONG ({format_time(cell.time_s)})", "—"
    return format_time(cell.time_s), format_bw(cell.busbw)


def results_table(
    runs: Sequence[ContenderRun],
    sizes: Sequence[int],
    nproc: int,
    order: Sequence[tuple[str, str]] = CONTENDERS,
) -> str:
    """size | per contender (in `order`, those that ran): time, busbw."""
    by_key = {run.key: run for run in runs if run.nproc == nproc}
    keys = [key for key, _ in order if key in by_key]
    header = ["size"]
    align = ["---"]
    for key in keys:
        header += [f"{TITLES[key]} time", "busbw GB/s"]
        align += ["---:", "---:"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    for nbytes in sizes:
        row = [format_size(nbytes)]
        for key in keys:
            row.extend(_cell_text(by_key[key], nbytes))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def latency_table(runs: Sequence[ContenderRun], nprocs: Sequence[int]) -> str:
    lines = [
        f"| N | contender | {format_size(LATENCY_SIZE)} per-op median | p99 | ops timed |",
        "|---|---|---:|---:|---:|",
    ]
    for nproc in nprocs:
        for run in runs:
            cell = run.cells.get(LATENCY_SIZE) if run.nproc == nproc else None
            if cell is None or cell.latency_median_s is None or cell.latency_p99_s is None:
                continue
            lines.append(
                f"| {nproc} | {TITLES[run.key]} | {format_time(cell.latency_median_s)} | "
                f"{format_time(cell.latency_p99_s)} | {cell.latency_ops} |"
            )
    return "\n".join(lines)


def details_table(runs: Sequence[ContenderRun], sizes: Sequence[int], nproc: int) -> str:
    """Per size and contender: samples, spread, CPU use (what the limits notes cite)."""
    lines = [
        "| size | contender | samples x k | per-op p10 to p90 | algbw GB/s | "
        "CPU cores busy | of which daemon |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for nbytes in sizes:
        for run in runs:
            cell = run.cells.get(nbytes) if run.nproc == nproc else None
            if cell is None:
                continue
            busy = f"{cell.cores_busy:.2f}" if cell.cores_busy is not None else "—"
            daemon = f"{cell.daemon_cores:.2f}" if cell.daemon_cores is not None else "—"
            lines.append(
                f"| {format_size(nbytes)} | {TITLES[run.key]} | "
                f"{cell.samples} x {cell.ops_per_sample} | "
                f"{format_time(cell.p10_s)} to {format_time(cell.p90_s)} | "
                f"{format_bw(cell.algbw)} | {busy} | {daemon} |"
            )
    return "\n".join(lines)


#: Small-message targets (issue 23): (N, size, seconds) for one op after a barrier
#: (measured at LATENCY_SIZE only) and per op in a batch.
SMALL_TARGETS = ((2, 4 * 1024, 40e-6), (2, 64 * 1024, 60e-6), (4, 4 * 1024, 80e-6))


def target_lines(runs: Sequence[ContenderRun], sizes: Sequence[int]) -> list[str]:
    """The targets: N = 2 busbw >= Open MPI from 16 MiB up (empty()); the small-message
    latencies of `SMALL_TARGETS` (gradsync empty())."""
    by_key = {run.key: run for run in runs if run.nproc == 2}
    ours, mpi = by_key.get("gradsync-empty"), by_key.get("mpi")
    lines = []
    if ours is not None and mpi is not None:
        for nbytes in sizes:
            if nbytes < 16 << 20:
                continue
            a, b = ours.cells.get(nbytes), mpi.cells.get(nbytes)
            if a is None or b is None:
                continue
            verdict = "met" if a.correct and a.busbw >= b.busbw else "MISSED"
            lines.append(
                f"- N=2, {format_size(nbytes)}: gradsync empty() busbw {format_bw(a.busbw)} "
                f"vs Open MPI {format_bw(b.busbw)} GB/s: {verdict} "
                f"({a.busbw / b.busbw:.2f}x)"
            )
    empty_runs = {run.nproc: run for run in runs if run.key == "gradsync-empty"}
    for nproc, nbytes, target in SMALL_TARGETS:
        run = empty_runs.get(nproc)
        cell = run.cells.get(nbytes) if run is not None else None
        if cell is None:
            continue
        measured = [("in a batch", cell.time_s)]
        if cell.latency_median_s is not None:
            measured.append(("one op after a barrier", cell.latency_median_s))
        for what, seconds in measured:
            verdict = "met" if cell.correct and seconds <= target else "MISSED"
            lines.append(
                f"- N={nproc}, {format_size(nbytes)} {what}: gradsync empty() "
                f"{format_time(seconds)} per op vs target {format_time(target)}: {verdict}"
            )
    return lines


#: Background load above this many cores makes a contender's numbers suspect.
BUSY_MACHINE_CORES = 0.2


def problems(runs: Sequence[ContenderRun], all_runs: Sequence[ContenderRun]) -> list[str]:
    """Skips, failures and wrong results of any repeat; disturbance of the reported ones."""
    lines = []
    repeats = len({run.repeat for run in all_runs}) > 1
    for run in all_runs:
        title = f"{TITLES[run.key]}, N={run.nproc}" + (f", repeat {run.repeat}" if repeats else "")
        if run.status == "failed" or (run.status == "skipped" and run.repeat == 1):
            lines.append(f"- {title}: {run.status}: {run.note}")
        for cell in run.cells.values():
            if not cell.correct:
                lines.append(
                    f"- {title}, {format_size(cell.nbytes)}: WRONG RESULT: {cell.wrong_detail}"
                )
    for run in runs:
        if run.background_cores is not None and run.background_cores > BUSY_MACHINE_CORES:
            lines.append(
                f"- {TITLES[run.key]}, N={run.nproc}: other processes used "
                f"{run.background_cores:.2f} cores on average while it ran; its times are "
                "pessimistic"
            )
    return lines


def load_table(all_runs: Sequence[ContenderRun], selected: Sequence[ContenderRun]) -> str:
    """How long each run took, how busy the rest of the machine was, which one is reported."""
    chosen = {id(run) for run in selected}
    lines = [
        "| N | contender | repeat | status | wall | waited for quiet | "
        "background load (cores) | in the tables |",
        "|---|---|---:|---|---:|---:|---:|---|",
    ]
    for run in sorted(all_runs, key=lambda r: (r.nproc, CONTENDER_ORDER[r.key], r.repeat)):
        load = f"{run.background_cores:.2f}" if run.background_cores is not None else "—"
        lines.append(
            f"| {run.nproc} | {TITLES[run.key]} | {run.repeat} | {run.status} | "
            f"{run.wall_s:.0f} s | {run.quiet_wait_s:.0f} s | {load} | "
            f"{'yes' if id(run) in chosen else ''} |"
        )
    return "\n".join(lines)
