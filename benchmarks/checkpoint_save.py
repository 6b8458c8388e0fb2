"""How long a checkpoint blocks the training loop: daemon memory against the others.

    python -m benchmarks.checkpoint_save [--mib 100,1024] [--saves 5] [--dir D]

One process, a private daemon (benchmarks/private_daemon.py) with its defaults
(bar a `--max-shm-bytes` that holds the kept checkpoints and the spares).  For a state of each
size (10 float32 tensors), the seconds each way of saving keeps the caller from
its next step, the ways taking turns save by save (A B C ..., then again),
median of `--saves`:

* memory copy: `t.clone()` of every tensor (the floor: one read, one write);
* daemon: `dcp.save` with `DaemonStorageWriter` (tensors copied once into
  daemon-owned shared memory, then committed);
* daemon, async: `dcp.async_save` with `DaemonStorageWriter` (blocked until it
  returns; its future is awaited before the next save, outside the clock);
* disk: `dcp.save` with torch's `FileSystemWriter` to a directory on D's disk
  (default: a temporary folder under the current one, not a tmpfs);
* disk, async: `dcp.async_save` with `FileSystemWriter` (blocked until it returns).

Prints a markdown table with the CPU named, and each way against the memory copy.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp

from benchmarks import machine
from benchmarks.private_daemon import private_daemon
from gradsync.client.torch.checkpoint import DaemonStorageWriter

Save = Callable[[dict[str, torch.Tensor], int], float]


def _timed(action: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = action()
    return time.perf_counter() - start, result


def ways(folder: str, job: str) -> dict[str, Save]:
    """Each way of saving: (state, step) -> seconds the caller was blocked."""
    writer = DaemonStorageWriter(job=job)
    async_writer = DaemonStorageWriter(job=f"{job}-async")

    def memory_copy(state: dict[str, torch.Tensor], step: int) -> float:
        return _timed(lambda: {name: t.clone() for name, t in state.items()})[0]

    def daemon(state: dict[str, torch.Tensor], step: int) -> float:
        return _timed(lambda: dcp.save(state, storage_writer=writer,
                                       checkpoint_id=str(step)))[0]

    def daemon_async(state: dict[str, torch.Tensor], step: int) -> float:
        seconds, future = _timed(lambda: dcp.async_save(
            state, storage_writer=async_writer, checkpoint_id=str(step)))
        future.result()  # type: ignore[attr-defined]
        return seconds

    def disk(state: dict[str, torch.Tensor], step: int) -> float:
        path = os.path.join(folder, f"sync-{step}")
        return _timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(path)))[0]

    def disk_async(state: dict[str, torch.Tensor], step: int) -> float:
        path = os.path.join(folder, f"async-{step}")
        seconds, future = _timed(lambda: dcp.async_save(
            state, storage_writer=dcp.FileSystemWriter(path)))
        future.result()  # type: ignore[attr-defined]
        return seconds

    return {"memory copy": memory_copy, "daemon (DaemonStorageWriter)": daemon,
            "daemon, dcp.async_save": daemon_async, "disk (FileSystemWriter)": disk,
            "disk, dcp.async_save": disk_async}


def measure(mib: int, saves: int, folder: str, gap_s: float) -> dict[str, float]:
    """Median blocked seconds per way for a state of `mib` MiB, ways in turns, `gap_s`
    between saves (a training step's room: what a save leaves to the background,
    unmapping, the next spare, an async save's copy, lands there and not on the next
    way's clock)."""
    count = mib * 2**18 // 10
    state = {f"t{i}": torch.randn(count) for i in range(10)}
    chosen = ways(folder, f"bench-save-{mib}")
    blocked: dict[str, list[float]] = {name: [] for name in chosen}
    for step in range(saves + 1):  # the first round warms up
        for name, save in chosen.items():
            seconds = save(state, step)
            if step:
                blocked[name].append(seconds)
            time.sleep(gap_s)
        for entry in os.listdir(folder):  # keep one disk checkpoint at a time
            shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)
    return {name: statistics.median(values) for name, values in blocked.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", default="100,1024", help="state sizes, comma-separated")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the disk checkpoints go")
    parser.add_argument("--gap-s", type=float, default=1.0,
                        help="seconds between saves, as a training step would leave")
    args = parser.parse_args()
    sizes = [int(size) for size in args.mib.split(",")]
    warnings.simplefilter("ignore")  # DCP's "no process group: one process" warnings
    torch.set_num_threads(1)
    folder = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir or ".")
    # Per size, two ways x (two kept checkpoints, the save under way, the spare for the
    # next), and room: a budget too tight for the spare would measure fresh pages.
    budget = f"{2 * 4 * sum(sizes) + 256}MiB"
    try:
        with private_daemon("--max-shm-bytes", budget) as daemon:
            os.environ["GRADSYNC_DAEMON"] = daemon.endpoint
            _report(sizes, args.saves, folder, args.gap_s)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _report(sizes: list[int], saves: int, folder: str, gap_s: float) -> None:
    """The markdown table: every way at every size, against the memory copy."""
    print(f"{machine.cpu_model()}, {os.cpu_count()} cores; median of {saves} saves "
          f"per way, ways in turns, {gap_s:g} s between saves; seconds the caller is "
          "blocked per save\n")
    print("| state | way | blocked (ms) | against the memory copy |")
    print("| --- | --- | ---: | ---: |")
    for mib in sizes:
        medians = measure(mib, saves, folder, gap_s)
        floor = medians["memory copy"]
        for name, seconds in medians.items():
            print(f"| {mib} MiB | {name} | {seconds * 1e3:.1f} | {seconds / floor:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
