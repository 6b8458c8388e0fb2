"""The machine a run happened on, and raw-path probes to compare results with.

The probes are the ceilings the "what limits it" notes refer to: memory
bandwidth of numpy add/copy on one and on all cores, and the round trip of a
small message through the daemon's client socket.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import resource
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np


def missing(module: str) -> bool:
    """Whether `module` cannot be imported here (checked without importing it)."""
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].split()
    except OSError:
        pass
    return []


def memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return None


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def open_mpi_version() -> str | None:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return None
    try:
        text = subprocess.run(
            [mpirun, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"\(Open MPI\)\s*(\S+)", text)
    return match.group(1) if match else (text.splitlines() or ["?"])[0]


def libzmq_version() -> str | None:
    try:
        import zmq
    except ImportError:
        return None
    return str(zmq.zmq_version())


def gradsync_source() -> str | None:
    """Commit of the gradsync checkout next to this folder, and whether it is modified."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", "client", "daemon", "protocol"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"commit {head}" + (" + uncommitted changes in client/daemon/protocol" if dirty else "")


def describe() -> dict[str, str]:
    """Machine and software versions, as label -> text."""
    memory = memory_gib()
    info = {
        "CPU": f"{cpu_model()}, {os.cpu_count()} logical CPUs (nproc)",
        "memory": f"{memory:.1f} GiB" if memory is not None else "unknown",
        "kernel": platform.release(),
        "python": platform.python_version(),
    }
    for label, distribution in (
        ("gradsync", "gradsync"),
        ("numpy", "numpy"),
        ("torch", "torch"),
        ("mpi4py", "mpi4py"),
        ("pyzmq", "pyzmq"),
        ("uvloop", "uvloop"),
        ("msgpack", "msgpack"),
    ):
        info[label] = _version(distribution) or "not installed"
    source = gradsync_source()
    if source:
        info["gradsync"] += f" ({source})"
    info["Open MPI"] = open_mpi_version() or "not installed"
    info["libzmq"] = libzmq_version() or "not installed"
    return info


# -- probes -----------------------------------------------------------------


def _best_s(run: Callable[[], object], repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _threaded(parts: int, work: Callable[[int], None]) -> Callable[[], None]:
    """Run `work(part)` for every part on its own thread (numpy drops the GIL)."""

    def run() -> None:
        threads = [threading.Thread(target=work, args=(p,)) for p in range(parts)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    return run


def _bandwidths(nbytes: int, threads: int) -> tuple[float, float, float]:
    """GB/s of add on one thread, add on `threads`, copy on `threads`."""
    count = nbytes // 4
    a = np.ones(count, np.float32)
    b = np.ones(count, np.float32)
    out = np.empty(count, np.float32)
    bounds = np.linspace(0, count, threads + 1).astype(int)

    def add(part: int) -> None:
        lo, hi = bounds[part], bounds[part + 1]
        np.add(a[lo:hi], b[lo:hi], out=out[lo:hi])

    def copy(part: int) -> None:
        lo, hi = bounds[part], bounds[part + 1]
        np.copyto(out[lo:hi], a[lo:hi])

    repeats = 20 if nbytes <= 16 << 20 else 5
    add_one = _best_s(lambda: np.add(a, b, out=out), repeats)
    add_all = _best_s(_threaded(threads, add), repeats)
    copy_all = _best_s(_threaded(threads, copy), repeats)
    return 3 * nbytes / add_one / 1e9, 3 * nbytes / add_all / 1e9, 2 * nbytes / copy_all / 1e9


def memory_probes(threads: int) -> dict[str, float]:
    """GB/s of numpy add (a + b -> out, 3 passes counted) and copy (2 passes)."""
    results: dict[str, float] = {}
    for label, nbytes in (("16 MiB", 16 << 20), ("256 MiB", 256 << 20)):
        add_one, add_all, copy_all = _bandwidths(nbytes, threads)
        results[f"numpy add {label}, 1 thread (3 passes counted)"] = add_one
        results[f"numpy add {label}, {threads} threads"] = add_all
        results[f"numpy copy {label}, {threads} threads (2 passes counted)"] = copy_all
    return results


def _median_p99_us(run: Callable[[], object], count: int) -> tuple[float, float]:
    for _ in range(min(200, count)):
        run()
    times = np.empty(count)
    for i in range(count):
        start = time.perf_counter_ns()
        run()
        times[i] = time.perf_counter_ns() - start
    return float(np.median(times)) / 1e3, float(np.percentile(times, 99)) / 1e3


def _threads_of(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


@contextlib.contextmanager
def _pinned(mine: set[int] | None, daemon_pid: int, daemons: set[int] | None) -> Iterator[None]:
    """Temporarily restrict this process and every daemon thread to the given CPUs."""
    saved_mine = os.sched_getaffinity(0)
    saved = {tid: os.sched_getaffinity(tid) for tid in _threads_of(daemon_pid)}
    try:
        if mine is not None:
            os.sched_setaffinity(0, mine)
        if daemons is not None:
            for tid in saved:
                os.sched_setaffinity(tid, daemons)
        yield
    finally:
        os.sched_setaffinity(0, saved_mine)
        # Threads the daemon started meanwhile inherited the pin: give them the
        # mask its main thread had.
        default = saved.get(daemon_pid)
        for tid in set(saved) | set(_threads_of(daemon_pid)):
            cpus = saved.get(tid, default)
            if cpus is not None:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(tid, cpus)


def daemon_round_trips_us(
    endpoint: str, daemon_pid: int, count: int = 2000
) -> dict[str, tuple[float, float]]:
    """Median and p99 (µs) of a `ping`, and of a 4 KiB allreduce in a job of one rank.

    The allreduce of one rank waits for nobody and reduces nothing, so the gap
    to the ping is the per-collective bookkeeping of client and daemon.  Both
    are measured with this process and the daemon on one CPU and on two
    different CPUs: on a VM a switch between processes on one CPU can cost far
    more than a wake-up on another, and small collectives are bound by it.
    """
    from gradsync.client import Client

    client = Client(
        daemon=endpoint, job=f"bench-solo-{os.getpid()}", rank=0, world_size=1,
        local_rank=0, local_world_size=1,
    )
    cpus = sorted(os.sched_getaffinity(0))
    placements: list[tuple[str, set[int] | None, set[int] | None]] = [("", None, None)]
    if len(cpus) >= 2:
        placements = [
            (", same CPU", {cpus[0]}, {cpus[0]}),
            (", different CPUs", {cpus[1]}, {cpus[0]}),
        ]
    results: dict[str, tuple[float, float]] = {}
    try:
        connection = client._connection  # the client's own socket: same path as collectives
        buffer = client.empty((1024,), np.float32)
        for label, mine, daemons in placements:
            with _pinned(mine, daemon_pid, daemons):
                results[f"ping{label}"] = _median_p99_us(
                    lambda: connection.call("ping", timeout_s=10.0), count
                )
                results[f"allreduce-solo{label}"] = _median_p99_us(
                    lambda: client.all_reduce(buffer), count
                )
    finally:
        client.close()
    return results


# -- background load ----------------------------------------------------------


def machine_busy_s() -> float:
    """CPU seconds all CPUs have spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal (guest time is already in user)
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + fields[7]
    return busy / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """utime + stime of a live process, 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s(extra_pids: Sequence[int] = ()) -> float:
    """CPU of this process, its waited-for descendants, and live helpers (the daemon)."""
    mine = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = mine.ru_utime + mine.ru_stime + children.ru_utime + children.ru_stime
    return total + sum(process_cpu_s(pid) for pid in extra_pids)


class LoadMeter:
    """Cores' worth of CPU used by processes that are not this benchmark's."""

    def __init__(self, extra_pids: Sequence[int] = ()) -> None:
        self.extra_pids = tuple(extra_pids)
        self._start = (time.perf_counter(), machine_busy_s(), own_cpu_s(self.extra_pids))

    def foreign_cores(self) -> float:
        wall0, busy0, own0 = self._start
        wall = time.perf_counter() - wall0
        foreign = (machine_busy_s() - busy0) - (own_cpu_s(self.extra_pids) - own0)
        return max(0.0, foreign / wall) if wall > 0 else 0.0


def wait_for_quiet(
    limit_s: float, threshold_cores: float, extra_pids: Sequence[int] = ()
) -> tuple[float, float]:
    """Wait (up to `limit_s`) until others use under `threshold_cores` for 1 s.

    Returns (seconds waited, the last background load seen).
    """
    started = time.perf_counter()
    while True:
        meter = LoadMeter(extra_pids)
        time.sleep(1.0)
        load = meter.foreign_cores()
        waited = time.perf_counter() - started
        if load < threshold_cores or waited >= limit_s:
            return waited, load


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"
