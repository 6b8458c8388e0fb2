"""Allreduce benchmark, nccl-tests style: gradsync vs torch gloo vs Open MPI on one node.

    python -m benchmarks.allreduce [--sizes 4KiB,16MiB] [--nproc 2,4] [--out benchmarks/RESULTS.md]

Starts a private gradsyncd, runs every contender for every N (gradsync ranks
through `gradsync launch`, gloo ranks as plain processes, MPI ranks under
`mpirun`), prints one markdown table per N, and with --out writes RESULTS.md.
A contender whose library is missing is skipped with a note.  See README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from benchmarks import machine, results_file
from benchmarks.plan import (
    CONTENDER_KEYS,
    DEFAULT_NPROCS,
    DEFAULT_SIZES,
    LATENCY_SIZE,
    TITLES,
    SamplePolicy,
    format_size,
    parse_sizes,
)
from benchmarks.private_daemon import DaemonRun, private_daemon
from benchmarks.processes import (
    command_line,
    log_tail,
    module_command,
    rank_env,
    signals_unwind,
    start_group,
    stop_group,
    wait_all,
)
from benchmarks.rank_worker import result_path
from benchmarks.report import (
    ContenderRun,
    latency_table,
    load_rank_files,
    merge_ranks,
    results_table,
    select_runs,
)


def log(message: str) -> None:
    print(f"[allreduce] {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Settings:
    sizes: tuple[int, ...]
    nprocs: tuple[int, ...]
    contenders: tuple[str, ...]
    policy: SamplePolicy
    timeout_s: float
    run_dir: str
    quiet_wait_s: float


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="float32 sum allreduce: gradsync (empty() and numpy buffers) vs torch "
        "gloo vs Open MPI, nccl-tests style.",
    )
    parser.add_argument(
        "--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
        help="message sizes, comma-separated: 4KiB,64KiB,1MiB,16MiB,64MiB,256MiB (default)",
    )
    parser.add_argument("--nproc", default=",".join(map(str, DEFAULT_NPROCS)),
                        help="local rank counts N, comma-separated (default 2,4)")
    parser.add_argument("--contenders", default=",".join(CONTENDER_KEYS),
                        help=f"subset of {','.join(CONTENDER_KEYS)} (default: all)")
    parser.add_argument("--out", metavar="RESULTS.md",
                        help="also write the full report (machine, tables, diagnostics) here")
    parser.add_argument("--budget-s", type=float, default=SamplePolicy.budget_s,
                        help="timed seconds per contender and size (default %(default)s)")
    parser.add_argument("--min-samples", type=int, default=SamplePolicy.min_samples)
    parser.add_argument("--max-samples", type=int, default=SamplePolicy.max_samples)
    parser.add_argument("--timeout-s", type=float, default=900.0,
                        help="give up on one contender at one N after this long")
    parser.add_argument("--quiet-wait-s", type=float, default=30.0,
                        help="before each contender, wait up to this long for other processes "
                        "to drop below 0.25 cores (0: don't wait; default %(default)s)")
    parser.add_argument("--daemon-args", default="", metavar="ARGS",
                        help="extra gradsyncd flags for the private daemon, e.g. "
                        "'--threads 1' (default: none)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run everything R times; tables show, per contender and N, the "
                        "repeat other processes disturbed least (default 1)")
    parser.add_argument("--no-probes", action="store_true",
                        help="skip the memory-bandwidth and socket round-trip probes")
    parser.add_argument("--keep", action="store_true",
                        help="keep the per-rank JSON files and logs (path printed)")
    return parser.parse_args(argv)


# -- availability -----------------------------------------------------------


def skip_reason(key: str) -> str | None:
    """Why a contender cannot run here, or None."""
    if key.startswith("gradsync") and machine.missing("gradsync.client"):
        return "gradsync is not installed in this interpreter"
    if key in ("gloo", "gradsync-torch") and machine.missing("torch"):
        return "torch is not installed (pip install torch)"
    if key == "mpi":
        if machine.missing("mpi4py"):
            return "mpi4py is not installed (pip install mpi4py)"
        if shutil.which("mpirun") is None:
            return "mpirun is not on PATH (apt-get install openmpi-bin libopenmpi-dev)"
    return None


# -- running one contender --------------------------------------------------


def _worker_args(key: str, settings: Settings, nproc: int) -> list[str]:
    return module_command(
        "rank_worker",
        "--contender", key,
        "--sizes", ",".join(map(str, settings.sizes)),
        "--out-dir", settings.run_dir,
        "--policy", json.dumps(dataclasses.asdict(settings.policy)),
        "--init-file", os.path.join(settings.run_dir, f"{key}-n{nproc}.store"),
        "--timeout-s", str(settings.timeout_s),
    )


def mpirun_prefix(nproc: int) -> list[str]:
    prefix = [shutil.which("mpirun") or "mpirun"]
    if os.geteuid() == 0:
        prefix.append("--allow-run-as-root")
    return [*prefix, "--oversubscribe", "-np", str(nproc), "-x", "OMP_NUM_THREADS"]


def run_contender(
    key: str, nproc: int, settings: Settings, daemon: DaemonRun | None
) -> ContenderRun:
    reason = skip_reason(key)
    if reason is None and key.startswith("gradsync") and daemon is None:
        reason = "no gradsync daemon"
    if reason is not None:
        return ContenderRun(key, nproc, "skipped", reason)
    log_path = os.path.join(settings.run_dir, f"{key}-n{nproc}.log")
    worker = _worker_args(key, settings, nproc)
    helpers = [daemon.pid] if daemon is not None else []
    waited = 0.0
    if settings.quiet_wait_s > 0:
        waited, load = machine.wait_for_quiet(settings.quiet_wait_s, 0.25, helpers)
        if waited > 1.5:
            log(f"waited {waited:.0f}s for other processes to quieten (now {load:.2f} cores)")
    meter = machine.LoadMeter(helpers)
    started = time.perf_counter()
    if key.startswith("gradsync"):
        assert daemon is not None
        command = [
            sys.executable, "-m", "gradsync.client.cli", "launch",
            "--nproc-per-node", str(nproc), "--daemon", daemon.endpoint,
            # The "script" is this interpreter, its arguments `-m benchmarks.rank_worker ...`.
            "--job", f"bench-{key}-n{nproc}", *worker,
        ]
        commands = [(command, rank_env())]
    elif key == "gloo":
        commands = [
            (worker, rank_env(RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r),
                              LOCAL_WORLD_SIZE=str(nproc), GLOO_SOCKET_IFNAME="lo"))
            for r in range(nproc)
        ]
    else:
        commands = [([*mpirun_prefix(nproc), *worker], rank_env())]
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for command, env in commands:  # started inside the try: each is stopped below
            processes.append(start_group(command, env, log_path))
        failure = wait_all(processes, settings.timeout_s)
    finally:  # an interrupt must not leave ranks behind in their own sessions
        for process in processes:
            stop_group(process)
    wall = time.perf_counter() - started
    background = meter.foreign_cores()
    paths = [result_path(settings.run_dir, key, nproc, r) for r in range(nproc)]
    documents, errors = load_rank_files(paths)
    cells = merge_ranks(documents, nproc) if len(documents) == nproc else {}
    run = ContenderRun(key, nproc, "ok", cells=cells, wall_s=wall,
                       background_cores=background, quiet_wait_s=waited)
    if failure is None and not errors:
        return run
    run.status = "failed"
    run.note = "; ".join([failure or "", *errors]).strip("; ")
    tail = log_tail(log_path)
    if tail:
        log(f"{TITLES[key]}, N={nproc} failed; last lines of its output:\n{tail}")
    if daemon is not None and key.startswith("gradsync"):
        daemon_tail = daemon.log_tail()
        if daemon_tail:
            log(f"gradsyncd log:\n{daemon_tail}")
    return run


# -- main -------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    # SIGTERM unwinds like Ctrl-C, so ranks, daemon and scratch files are cleaned up.
    signals_unwind()
    try:
        return _main(argv)
    except KeyboardInterrupt:
        log("interrupted; ranks and daemon stopped")
        return 130


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    try:
        sizes = parse_sizes(args.sizes)
        nprocs = tuple(int(n) for n in args.nproc.split(",") if n.strip())
    except ValueError as exc:
        print(f"allreduce: {exc}", file=sys.stderr)
        return 2
    contenders = tuple(c.strip() for c in args.contenders.split(",") if c.strip())
    unknown = [c for c in contenders if c not in CONTENDER_KEYS]
    if args.repeat < 1:
        print("allreduce: --repeat must be at least 1", file=sys.stderr)
        return 2
    if unknown or not contenders or any(n < 2 for n in nprocs) or not nprocs:
        print(f"allreduce: contenders must come from {CONTENDER_KEYS} and every N must be "
              f">= 2; got {contenders}, {nprocs}", file=sys.stderr)
        return 2
    policy = SamplePolicy(budget_s=args.budget_s, min_samples=args.min_samples,
                          max_samples=args.max_samples)
    started_at = datetime.datetime.now().astimezone()
    started = time.perf_counter()
    info = machine.describe()
    load_average = machine.load_average()
    run_dir = tempfile.mkdtemp(prefix="gsb-run-", dir="/tmp")  # removed in the finally below
    settings = Settings(
        sizes, nprocs, contenders, policy, args.timeout_s, run_dir, args.quiet_wait_s
    )
    log(f"sizes {', '.join(format_size(s) for s in sizes)}; N = {nprocs}; "
        f"contenders {', '.join(contenders)}; scratch {run_dir}")
    for key in contenders:
        reason = skip_reason(key)
        if reason:
            log(f"skipping {TITLES[key]}: {reason}")

    all_runs: list[ContenderRun] = []
    probes: dict[str, float] = {}
    round_trips: dict[str, tuple[float, float]] = {}
    probe_background: float | None = None
    daemon_command: str | None = None
    daemon_notes: list[str] = []
    needs_daemon = any(k.startswith("gradsync") and skip_reason(k) is None for k in contenders)
    try:
        daemon_context = (
            private_daemon(*shlex.split(args.daemon_args))
            if needs_daemon
            else contextlib.nullcontext()
        )
        with daemon_context as daemon:
            if daemon is not None:
                daemon_command = daemon.shown_command()
                log(f"private gradsyncd pid {daemon.pid} at {daemon.endpoint}")
            if not args.no_probes:
                helpers = [daemon.pid] if daemon is not None else []
                if args.quiet_wait_s > 0:
                    machine.wait_for_quiet(args.quiet_wait_s, 0.25, helpers)
                log("probing memory bandwidth and the daemon's socket round trip")
                meter = machine.LoadMeter(helpers)
                probes = machine.memory_probes(os.cpu_count() or 1)
                if daemon is not None:
                    round_trips = machine.daemon_round_trips_us(daemon.endpoint, daemon.pid)
                probe_background = meter.foreign_cores()
            for repeat in range(1, args.repeat + 1):
                for nproc in nprocs:
                    for key in contenders:
                        title = f"N={nproc}: {TITLES[key]}" + (
                            f" (repeat {repeat}/{args.repeat})" if args.repeat > 1 else ""
                        )
                        log(f"{title} ...")
                        # Each repeat in its own folder: nothing of an earlier
                        # one (result files, gloo's file store) can be read again.
                        repeat_dir = os.path.join(run_dir, f"r{repeat}")
                        os.makedirs(repeat_dir, exist_ok=True)
                        run = run_contender(key, nproc,
                                            dataclasses.replace(settings, run_dir=repeat_dir),
                                            daemon)
                        run.repeat = repeat
                        all_runs.append(run)
                        load = run.background_cores
                        log(f"{title}: {run.status} in {run.wall_s:.0f}s"
                            + (f", background load {load:.2f} cores" if load is not None else "")
                            + (f" ({run.note})" if run.note else ""))
        if daemon is not None:
            if daemon.exit_code != 0:
                daemon_notes.append(f"gradsyncd exited with status {daemon.exit_code} on SIGTERM")
            if daemon.leaked_segments:
                daemon_notes.append(
                    f"gradsyncd left {len(daemon.leaked_segments)} /dev/shm segments "
                    f"(removed by the benchmark): {', '.join(daemon.leaked_segments[:5])}"
                )
    finally:
        if args.keep:
            log(f"per-rank results and logs kept in {run_dir}")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)

    runs = select_runs(all_runs)
    for nproc in nprocs:
        print(f"\n### N = {nproc}\n\n{results_table(runs, sizes, nproc)}")
    print(f"\n### {format_size(LATENCY_SIZE)} per-op latency\n\n{latency_table(runs, nprocs)}\n")
    for line in daemon_notes:
        log(line)
    if args.out:
        description = results_file.RunDescription(
            command=command_line(__file__, argv),
            started=started_at.strftime("%Y-%m-%d %H:%M %Z"),
            duration_s=time.perf_counter() - started,
            machine=info,
            probes=probes,
            round_trips=round_trips,
            probe_background=probe_background,
            daemon_command=daemon_command,
            mpirun_command=(
                shlex.join([*mpirun_prefix(nprocs[0]), "python", "rank_worker.py", "..."])
                if "mpi" in contenders and skip_reason("mpi") is None else None
            ),
            daemon_notes=daemon_notes,
            load_average=load_average,
            policy=policy,
        )
        text = results_file.render(
            description, runs, all_runs, sizes, nprocs, results_file.existing_notes(args.out)
        )
        # The main body of the file; sections other benchmarks wrote are kept.
        results_file.write_section(args.out, None, text)
        log(f"wrote {args.out}")
    failed = any(run.status == "failed" for run in all_runs)
    wrong = any(not cell.correct for run in all_runs for cell in run.cells.values())
    return 1 if failed or wrong or daemon_notes else 0


if __name__ == "__main__":
    sys.exit(main())
