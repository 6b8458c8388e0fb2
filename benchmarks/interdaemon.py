"""Allreduce between daemons, nccl-tests style: every algorithm, torch gloo, raw pyzmq.

    python -m benchmarks.interdaemon [--nproc 2,4] [--placements loopback,netns]
                                     [--encryption-only] [--out benchmarks/RESULTS.md]

For every placement (127.0.0.1, or one network namespace per node) and every
number of nodes M, it starts M `gradsyncd`s that peer over TCP, one rank per
daemon, and measures float32 sum allreduce with `ring`, `tree`, `rhd`, `star`
and `auto` side by side (the algorithms take turns at each size); then torch
gloo with one process per node over the same network, and raw pyzmq TCP
throughput between the same addresses (one way, and a ring exchange).  At
every placement it also times `ring` at 16 and 64 MiB over CURVE links (sealed
data streams) against --insecure ones for every M, beside gloo at the same
sizes, and records the raw AEAD throughput per core (benchmarks/aead.py) of
the same run; `--encryption-only` runs just those cells (and gloo at those
sizes) and writes them as the "interdaemon-encryption" section.  `auto`'s
choices, and the link costs it priced each size with, are read from every
daemon's statistics before it stops.  Prints the tables; with --out, writes
them as the "interdaemon" section of RESULTS.md (the rest of the file is
kept).  Run from the repository root; the ranks run `python -m
benchmarks.rank_worker` (and `benchmarks.raw_zmq`).  See README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

from benchmarks import interdaemon_report as report_mod
from benchmarks import machine, topology
from benchmarks.daemon_logs import AutoPicks, LinkProbe, parse_links, picks_from_stats
from benchmarks.plan import (
    ALGORITHMS,
    MIB,
    SamplePolicy,
    algorithm_key,
    format_size,
    parse_sizes,
)
from benchmarks.private_daemon import DaemonRun, daemon_cluster
from benchmarks.processes import (
    clean_env,
    log_tail,
    module_command,
    rank_env,
    run_all,
    signals_unwind,
)
from benchmarks.rank_worker import result_path
from benchmarks.report import ContenderRun, load_rank_files, merge_ranks

DEFAULT_SIZES = (4 << 10, 64 << 10, MIB, 16 * MIB, 64 * MIB)
CURVE_SIZES = (16 * MIB, 64 * MIB)
PLACEMENTS = ("loopback", "netns", "shaped")
#: A daemon's log line for an opened data stream, and how it is sealed.
STREAM_OPEN = re.compile(r"data stream to \S+ open \(port \d+\), ([\w-]+)")


def log(message: str) -> None:
    print(f"[interdaemon] {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Settings:
    sizes: tuple[int, ...]
    nprocs: tuple[int, ...]
    placements: tuple[str, ...]
    algorithms: tuple[str, ...]
    policy: SamplePolicy
    timeout_s: float
    quiet_wait_s: float
    daemon_args: tuple[str, ...]
    gloo: bool
    raw: bool
    curve: bool
    raw_stream_bytes: tuple[int, ...]
    raw_ring_bytes: tuple[int, ...]
    raw_rounds: int
    repeat: int
    shaped_rate: str = "2gbit"
    #: Only the encryption cells: CURVE vs --insecure ring, gloo, AEAD rows.
    encryption_only: bool = False


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="float32 sum allreduce between gradsync daemons (ring, tree, rhd, star, "
        "auto) vs torch gloo vs raw pyzmq TCP, on 127.0.0.1 and across network namespaces.",
    )
    parser.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                        help="message sizes, comma-separated (default 4KiB,64KiB,1MiB,16MiB,"
                        "64MiB; add 256MiB if time allows)")
    parser.add_argument("--nproc", default="2,4",
                        help="numbers of nodes M (daemons, one rank each), comma-separated "
                        "(default 2,4)")
    parser.add_argument("--placements", default="loopback,netns",
                        help="loopback (127.0.0.1), netns (a network namespace per node; "
                        "needs root and iproute2) and/or shaped (namespaces whose links are "
                        "capped at --shaped-rate each way, so the wire sets the pace, not "
                        "the CPUs); default loopback,netns")
    parser.add_argument("--shaped-rate", default="2gbit",
                        help="link rate of the shaped placement, tc syntax (default 2gbit)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS),
                        help=f"subset of {','.join(ALGORITHMS)} (default: all)")
    parser.add_argument("--no-gloo", action="store_true", help="skip torch gloo")
    parser.add_argument("--no-raw", action="store_true", help="skip the raw pyzmq probes")
    parser.add_argument("--no-curve", action="store_true",
                        help="skip the CURVE vs --insecure comparison")
    parser.add_argument("--encryption-only", action="store_true",
                        help="only ring at 16 and 64 MiB over CURVE and --insecure, gloo at "
                        "those sizes, and the raw AEAD rows; --out then writes the "
                        "'interdaemon-encryption' section")
    parser.add_argument("--out", metavar="RESULTS.md",
                        help="also write the report as the 'interdaemon' section of this file")
    parser.add_argument("--budget-s", type=float, default=0.6,
                        help="timed seconds per algorithm and size (default %(default)s)")
    parser.add_argument("--min-samples", type=int, default=5)
    parser.add_argument("--max-samples", type=int, default=50)
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="give up on one contender at one placement and M after this long")
    parser.add_argument("--quiet-wait-s", type=float, default=10.0,
                        help="before each placement and M, wait up to this long for other "
                        "processes to drop below 0.25 cores (0: don't wait; default %(default)s)")
    parser.add_argument("--daemon-args", default="", metavar="ARGS",
                        help="extra gradsyncd flags for every daemon, e.g. "
                        "'--pipeline-slice-bytes 4MiB'")
    parser.add_argument("--raw-rounds", type=int, default=8,
                        help="timed rounds per raw pyzmq pattern and volume (default 8)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run everything R times; tables show, per placement, contender "
                        "and M, the repeat other processes disturbed least (default 1)")
    parser.add_argument("--keep", action="store_true",
                        help="keep per-rank JSON, logs and daemon logs (path printed)")
    return parser.parse_args(argv)


# -- results of one placement and M -----------------------------------------


@dataclasses.dataclass
class RawResult:
    """Raw pyzmq: seconds per round (slowest node) per pattern and volume."""

    stream_s: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    ring_s: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    status: str = "ok"
    note: str = ""

    def stream_gbps(self, volume: int) -> float | None:
        times = self.stream_s.get(volume)
        return volume / statistics.median(times) / 1e9 if times else None

    def ring_gbps(self, volume: int) -> float | None:
        """Bytes each node sent (and received) per second, median round."""
        times = self.ring_s.get(volume)
        return volume / statistics.median(times) / 1e9 if times else None

    def best_gbps(self) -> tuple[float | None, float | None]:
        """Best over volumes of 1 MiB and more: (one way, ring exchange)."""
        streams = [v for x in self.stream_s if x >= MIB and (v := self.stream_gbps(x))]
        rings = [v for x in self.ring_s if x >= MIB and (v := self.ring_gbps(x))]
        return (max(streams) if streams else None, max(rings) if rings else None)


@dataclasses.dataclass
class ClusterInfo:
    """What the daemons of one gradsync run did besides the numbers."""

    label: str = ""
    commands: list[str] = dataclasses.field(default_factory=list)
    #: auto's picks, from the daemons' statistics.
    picks: AutoPicks = dataclasses.field(default_factory=AutoPicks)
    links: list[LinkProbe] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    #: How the data streams were sealed, from the daemons' stream-open log lines.
    ciphers: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class Group:
    """One placement, one M, one repeat: every contender's run and the daemons' story."""

    placement: str
    nproc: int
    repeat: int
    description: str = ""
    runs: list[ContenderRun] = dataclasses.field(default_factory=list)
    cluster: ClusterInfo = dataclasses.field(default_factory=ClusterInfo)
    raw: RawResult | None = None
    curve_runs: list[ContenderRun] = dataclasses.field(default_factory=list)
    curve_cluster: list[ClusterInfo] = dataclasses.field(default_factory=list)
    background_cores: float | None = None
    quiet_wait_s: float = 0.0


# -- running ----------------------------------------------------------------


def _policy_json(policy: SamplePolicy) -> str:
    return json.dumps(dataclasses.asdict(policy))


def _collect(
    keys: Sequence[str], nproc: int, out_dir: str, failure: str | None, wall: float,
    background: float | None, log_path: str,
) -> list[ContenderRun]:
    runs = []
    for key in keys:
        paths = [result_path(out_dir, key, nproc, r) for r in range(nproc)]
        documents, errors = load_rank_files(paths)
        cells = merge_ranks(documents, nproc) if len(documents) == nproc else {}
        run = ContenderRun(key, nproc, "ok", cells=cells, wall_s=wall,
                           background_cores=background)
        if failure is not None or errors:
            run.status = "failed"
            run.note = "; ".join([failure or "", *errors]).strip("; ")
        runs.append(run)
    if any(run.status == "failed" for run in runs):
        tail = log_tail(log_path)
        log(f"{', '.join(keys)} at M={nproc} failed: {runs[0].note}\n{tail}")
    return runs


def _daemon_flags(
    endpoints: Sequence[str], index: int, settings: Settings, keys: tuple[str, str] | None,
    log_level: str,
) -> list[str]:
    flags = ["--listen", endpoints[index], "--peers", ",".join(endpoints),
             "--log-level", log_level]
    if keys is None:
        flags.append("--insecure")
    else:
        flags += ["--curve-secret", keys[0], "--curve-authorized", keys[1]]
    return [*flags, *settings.daemon_args]


def _make_keys(folder: str, endpoints: Sequence[str]) -> list[tuple[str, str]]:
    """A CURVE keypair per daemon (`gradsync keygen`), every public key authorised."""
    from gradsync.client.cli.keygen import generate_keypair

    authorized = os.path.join(folder, "authorized")
    os.makedirs(authorized, mode=0o700)
    pairs = []
    for index, endpoint in enumerate(endpoints):
        public, secret = generate_keypair(os.path.join(folder, f"n{index}"), f"n{index}",
                                          endpoint)
        shutil.copy(public, authorized)
        pairs.append((secret, authorized))
    return pairs


def run_gradsync(
    topo: topology.Topology, settings: Settings, out_dir: str, *, algorithms: Sequence[str],
    sizes: Sequence[int], label: str, policy: SamplePolicy, curve: bool = False,
    log_level: str = "info",
) -> tuple[list[ContenderRun], ClusterInfo]:
    """M daemons peering over `topo`, one rank each, every algorithm at every size."""
    nproc = topo.size
    info = ClusterInfo(label)
    endpoints = topo.endpoints()[0]
    keys: list[tuple[str, str]] | None = None
    if curve:
        keys = _make_keys(tempfile.mkdtemp(prefix=f"keys-{label}-", dir=out_dir), endpoints)
    flags = [
        _daemon_flags(endpoints, i, settings, keys[i] if keys else None, log_level)
        for i in range(nproc)
    ]
    log_path = os.path.join(out_dir, f"{label}.log")
    keys_out = [algorithm_key(a, label) for a in algorithms]
    job = f"bench-{label}-{topo.kind}-m{nproc}-{os.getpid()}"
    logs_to = os.path.join(out_dir, f"{label}-daemon-logs")  # kept with --keep
    os.makedirs(logs_to)
    with daemon_cluster(flags, [topo.prefix(i) for i in range(nproc)],
                        logs_to=logs_to) as daemons:
        info.commands = [d.shown_command() for d in daemons]
        pids = [d.pid for d in daemons]
        meter = machine.LoadMeter(pids)
        started = time.perf_counter()
        commands = []
        for rank, daemon in enumerate(daemons):
            command = [
                *topo.prefix(rank), *module_command("rank_worker"),
                "--contender", "gradsync-empty", "--algorithms", ",".join(algorithms),
                "--label", label, "--sizes", ",".join(map(str, sizes)), "--out-dir", out_dir,
                "--policy", _policy_json(policy), "--timeout-s", str(settings.timeout_s),
            ]
            env = rank_env(clean_env(), RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK="0",
                           LOCAL_WORLD_SIZE="1", GRADSYNC_DAEMON=daemon.endpoint,
                           GRADSYNC_JOB=job)
            commands.append((command, env))
        failure = run_all(commands, log_path, settings.timeout_s)
        wall = time.perf_counter() - started
        background = meter.foreign_cores()
        logs = [d.log() for d in daemons]
        info.links = parse_links(logs)
        info.ciphers = {cipher for text in logs for cipher in STREAM_OPEN.findall(text)}
        info.picks = picks_from_stats(_snapshots(daemons, info.problems), job, nproc)
        if failure is not None:
            for index, daemon in enumerate(daemons):
                log(f"daemon {index} log tail:\n{daemon.log_tail()}")
    info.problems += _daemon_problems(daemons, label)
    runs = _collect(keys_out, nproc, out_dir, failure, wall, background, log_path)
    return runs, info


def _snapshots(daemons: Sequence[DaemonRun], problems: list[str]) -> list[dict[str, Any]]:
    """Each daemon's statistics (for auto's picks); a daemon that does not answer is noted."""
    from gradsync.client.cli.stats import fetch_snapshot
    from gradsync.protocol.errors import GradsyncError

    snapshots = []
    for index, daemon in enumerate(daemons):
        try:
            snapshots.append(fetch_snapshot(f"{daemon.endpoint}.stats", 10.0))
        except GradsyncError as exc:
            problems.append(f"daemon {index}: no statistics: {exc}")
    return snapshots


def _daemon_problems(daemons: Sequence[DaemonRun], label: str) -> list[str]:
    problems = []
    for index, daemon in enumerate(daemons):
        if daemon.exit_code != 0:
            problems.append(f"{label}: daemon {index} exited with status {daemon.exit_code} "
                            "on SIGTERM")
        if daemon.leaked_segments:
            problems.append(
                f"{label}: daemon {index} left {len(daemon.leaked_segments)} /dev/shm segments "
                f"(removed by the benchmark): {', '.join(daemon.leaked_segments[:5])}"
            )
    return problems


def run_gloo(topo: topology.Topology, settings: Settings, out_dir: str) -> ContenderRun:
    """torch.distributed gloo, one process per node, over the nodes' interfaces."""
    nproc = topo.size
    if machine.missing("torch"):
        return ContenderRun("gloo", nproc, "skipped", "torch is not installed")
    log_path = os.path.join(out_dir, "gloo.log")
    store = os.path.join(out_dir, "gloo.store")
    meter = machine.LoadMeter()
    started = time.perf_counter()
    commands = []
    for rank in range(nproc):
        command = [
            *topo.prefix(rank), *module_command("rank_worker"), "--contender", "gloo",
            "--sizes", ",".join(map(str, settings.sizes)), "--out-dir", out_dir,
            "--policy", _policy_json(settings.policy), "--init-file", store,
            "--timeout-s", str(settings.timeout_s),
        ]
        env = rank_env(clean_env(), RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK="0",
                       LOCAL_WORLD_SIZE="1", GLOO_SOCKET_IFNAME=topo.interfaces[rank])
        commands.append((command, env))
    failure = run_all(commands, log_path, settings.timeout_s)
    wall = time.perf_counter() - started
    return _collect(["gloo"], nproc, out_dir, failure, wall, meter.foreign_cores(),
                    log_path)[0]


def run_raw(topo: topology.Topology, settings: Settings, out_dir: str) -> RawResult:
    """Raw pyzmq between the same addresses (its own sockets): one way and ring exchange."""
    nproc = topo.size
    endpoints = topo.endpoints()[0]
    log_path = os.path.join(out_dir, "raw.log")
    outs = [os.path.join(out_dir, f"raw-{i}.json") for i in range(nproc)]
    commands = [
        ([*topo.prefix(i), *module_command("raw_zmq"), "--index", str(i),
          "--endpoints", ",".join(endpoints),
          "--stream-bytes", ",".join(map(str, settings.raw_stream_bytes)),
          "--ring-bytes", ",".join(map(str, settings.raw_ring_bytes)),
          "--rounds", str(settings.raw_rounds), "--out", outs[i]],
         rank_env(clean_env()))
        for i in range(nproc)
    ]
    failure = run_all(commands, log_path, min(settings.timeout_s, 120.0))
    result = RawResult()
    if failure is not None:
        result.status, result.note = "failed", failure
        log(f"raw pyzmq at M={nproc} failed: {failure}\n{log_tail(log_path)}")
        return result
    documents = []
    for path in outs:
        with open(path) as source:
            documents.append(json.load(source))
    for volume in settings.raw_stream_bytes:
        result.stream_s[volume] = documents[0]["stream_s"][str(volume)]
    for volume in settings.raw_ring_bytes:
        per_node = [doc["ring_s"][str(volume)] for doc in documents]
        result.ring_s[volume] = [max(times) for times in zip(*per_node, strict=True)]
    return result


@contextlib.contextmanager
def _placement(kind: str, size: int, rate: str) -> Iterator[topology.Topology]:
    if kind == "loopback":
        with topology.loopback(size) as topo:
            yield topo
    else:
        with topology.namespaces(size, rate if kind == "shaped" else None) as topo:
            yield topo


def run_group(
    placement: str, nproc: int, repeat: int, settings: Settings, run_dir: str
) -> Group:
    group = Group(placement, nproc, repeat)
    out_dir = os.path.join(run_dir, f"{placement}-m{nproc}-r{repeat}")
    os.makedirs(out_dir)
    if settings.quiet_wait_s > 0:
        waited, load = machine.wait_for_quiet(settings.quiet_wait_s, 0.25)
        group.quiet_wait_s = waited
        if waited > 1.5:
            log(f"waited {waited:.0f}s for other processes to quieten (now {load:.2f} cores)")
    meter = machine.LoadMeter()
    with _placement(placement, nproc, settings.shaped_rate) as topo:
        group.description = topo.description
        title = f"{placement}, M={nproc}" + (f", repeat {repeat}" if settings.repeat > 1 else "")
        if not settings.encryption_only:
            log(f"{title}: gradsync {', '.join(settings.algorithms)} ...")
            runs, group.cluster = run_gradsync(
                topo, settings, out_dir, algorithms=settings.algorithms, sizes=settings.sizes,
                label="gradsync", policy=settings.policy,
            )
            group.runs += runs
            _report_progress(title, runs)
        if settings.gloo:
            log(f"{title}: torch gloo ...")
            group.runs.append(run_gloo(topo, settings, out_dir))
            _report_progress(title, group.runs[-1:])
        if settings.raw and not settings.encryption_only:
            log(f"{title}: raw pyzmq ...")
            group.raw = run_raw(topo, settings, out_dir)
        if settings.curve:
            curve_policy = dataclasses.replace(
                settings.policy, budget_s=2 * settings.policy.budget_s,
                min_samples=max(10, settings.policy.min_samples),
            )
            for label, curve in (("gradsync-insecure", False), ("gradsync-curve", True)):
                log(f"{title}: ring at {', '.join(map(format_size, CURVE_SIZES))}, {label} ...")
                runs, info = run_gradsync(
                    topo, settings, out_dir, algorithms=("ring",), sizes=CURVE_SIZES,
                    label=label, policy=curve_policy, curve=curve,
                )
                group.curve_runs += runs
                group.curve_cluster.append(info)
                _report_progress(title, runs)
    group.background_cores = meter.foreign_cores()
    return group


def _report_progress(title: str, runs: Sequence[ContenderRun]) -> None:
    for run in runs:
        load = run.background_cores
        log(f"{title}: {run.key} {run.status} in {run.wall_s:.0f}s"
            + (f", background load {load:.2f} cores" if load is not None else "")
            + (f" ({run.note})" if run.note else ""))


# -- main -------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    signals_unwind()  # SIGTERM/SIGHUP unwind like Ctrl-C: every finally block runs
    try:
        return _main(argv)
    except KeyboardInterrupt:
        log("interrupted; ranks, daemons and namespaces removed")
        return 130


def _settings(args: argparse.Namespace) -> Settings | str:
    try:
        sizes = parse_sizes(args.sizes)
        nprocs = tuple(int(n) for n in args.nproc.split(",") if n.strip())
    except ValueError as exc:
        return str(exc)
    placements = tuple(p.strip() for p in args.placements.split(",") if p.strip())
    algorithms = tuple(a.strip() for a in args.algorithms.split(",") if a.strip())
    if not nprocs or any(n < 2 for n in nprocs):
        return f"every M must be at least 2, got {nprocs}"
    if not placements or any(p not in PLACEMENTS for p in placements):
        return f"placements must come from {PLACEMENTS}, got {placements}"
    if not algorithms or any(a not in ALGORITHMS for a in algorithms):
        return f"algorithms must come from {ALGORITHMS}, got {algorithms}"
    if args.repeat < 1:
        return "--repeat must be at least 1"
    if args.encryption_only:
        if args.no_curve:
            return "--encryption-only and --no-curve exclude each other"
        sizes = CURVE_SIZES  # gloo's cells beside the encryption ones
    try:
        topology.check_rate(args.shaped_rate)
    except ValueError as exc:
        return f"--shaped-rate: {exc}"
    policy = SamplePolicy(
        budget_s=args.budget_s, min_samples=args.min_samples, max_samples=args.max_samples,
        latency_budget_s=0.0, latency_min_ops=0, ops_small=10, ops_medium=3,
    )
    return Settings(
        sizes=sizes, nprocs=nprocs, placements=placements, algorithms=algorithms,
        policy=policy, timeout_s=args.timeout_s, quiet_wait_s=args.quiet_wait_s,
        daemon_args=tuple(shlex.split(args.daemon_args)), gloo=not args.no_gloo,
        raw=not args.no_raw, curve=not args.no_curve,
        raw_stream_bytes=(16 * MIB, 64 * MIB), raw_ring_bytes=(4 << 10, 16 * MIB, 64 * MIB),
        raw_rounds=args.raw_rounds, repeat=args.repeat, shaped_rate=args.shaped_rate,
        encryption_only=args.encryption_only,
    )


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    settings = _settings(args)
    if isinstance(settings, str):
        print(f"interdaemon: {settings}", file=sys.stderr)
        return 2
    if machine.missing("gradsync.client"):
        print("interdaemon: gradsync is not installed in this interpreter", file=sys.stderr)
        return 2
    started_at = datetime.datetime.now().astimezone()
    started = time.perf_counter()
    notes: list[str] = []
    placements = settings.placements
    for kind in ("netns", "shaped"):
        if kind not in placements:
            continue
        reason = topology.namespaces_unavailable(shaped=kind == "shaped")
        if reason:
            notes.append(f"{kind} placement skipped: {reason}")
            placements = tuple(p for p in placements if p != kind)
    if {"netns", "shaped"} & set(placements):
        stale = topology.sweep_stale()
        if stale:
            notes.append(f"deleted namespaces an interrupted earlier run left: {stale}")
    if settings.gloo and machine.missing("torch"):
        notes.append("torch gloo skipped: torch is not installed (pip install torch)")
    info = machine.describe()
    load_average = machine.load_average()
    aead_rows: list[tuple[str, int, float, float]] = []
    if settings.curve:
        from benchmarks import aead

        log("raw AEAD throughput, one core ...")
        aead_rows = aead.measure_aead(sizes=(1 << 20,), budget_s=0.3)
        aead_rows += aead.measure_without_aes_ni(1 << 20, budget_s=0.3)
    run_dir = tempfile.mkdtemp(prefix="gsb-inter-", dir="/tmp")
    log(f"sizes {', '.join(format_size(s) for s in settings.sizes)}; M = {settings.nprocs}; "
        f"placements {', '.join(placements)}; scratch {run_dir}")
    groups: list[Group] = []
    try:
        for repeat in range(1, settings.repeat + 1):
            for placement in placements:
                for nproc in settings.nprocs:
                    groups.append(run_group(placement, nproc, repeat, settings, run_dir))
    finally:
        if args.keep:
            log(f"per-rank results and logs kept in {run_dir}")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    description = report_mod.RunDescription(
        command=_command(argv),
        started=started_at.strftime("%Y-%m-%d %H:%M %Z"),
        duration_s=time.perf_counter() - started,
        machine=info,
        load_average=load_average,
        settings_text=_settings_text(settings),
        notes=notes,
        aead_rows=aead_rows,
    )
    selected = report_mod.select_groups(groups)
    if settings.encryption_only:
        print(report_mod.render_encryption(description, selected, groups))
        if args.out:
            from benchmarks import results_file

            results_file.write_section(args.out, "interdaemon-encryption",
                                       report_mod.render_encryption(description, selected,
                                                                    groups),
                                       "benchmarks/interdaemon.py --encryption-only")
            log(f"wrote the interdaemon-encryption section of {args.out}")
    else:
        print(report_mod.console(selected, settings.sizes, settings.algorithms, aead_rows))
    if args.out and not settings.encryption_only:
        from benchmarks import results_file

        notes_text = results_file.existing_notes(
            args.out, report_mod.NOTES_BEGIN, report_mod.NOTES_END
        )
        text = report_mod.render(description, selected, groups, settings.sizes,
                                 settings.algorithms, notes_text)
        results_file.write_section(args.out, "interdaemon", text, "benchmarks/interdaemon.py")
        log(f"wrote the interdaemon section of {args.out}")
    for line in notes:
        log(line)
    bad = report_mod.failures(groups)
    for line in bad:
        log(line)
    return 1 if bad else 0


def _command(argv: Sequence[str] | None) -> str:
    from benchmarks.processes import command_line

    return command_line(__file__, argv)


def _settings_text(settings: Settings) -> str:
    policy = settings.policy
    return (
        f"k = {policy.ops_small} ops per sample up to 64 KiB, {policy.ops_medium} up to 1 MiB, "
        f"1 above; samples for about {policy.budget_s:g} s per algorithm and size (at least "
        f"{policy.min_samples}, at most {policy.max_samples}); raw pyzmq: "
        f"{settings.raw_rounds} timed rounds per volume"
        + (f"; extra daemon flags `{' '.join(settings.daemon_args)}`"
           if settings.daemon_args else "")
    )


if __name__ == "__main__":
    sys.exit(main())
