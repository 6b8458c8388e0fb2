"""What persisting daemon checkpoints to disk costs the training loop.

    python -m benchmarks.checkpoint_persist [--mib 100] [--saves 6] [--gap-s 0.3] [--dir D]

One process, a private daemon: `dcp.save` of a state of MIB MiB into daemon
memory, SAVES times with GAP_S of "training" (a sleep) between saves, with
`DaemonStorageWriter(persist_dir=...)` persisting every step and without,
alternately (without, with, without).  Prints the median time each save
blocked, and how long `wait_persisted` then waited.  The checkpoints go to a
temporary folder under D (default: the current folder, so on its disk, not a
tmpfs), removed afterwards; D itself is left alone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from benchmarks.private_daemon import private_daemon
from gradsync.client.torch.checkpoint import DaemonStorageWriter


def _run(state: dict[str, torch.Tensor], job: str, saves: int, gap_s: float,
         persist_dir: str | None) -> tuple[float, float]:
    """Median blocked seconds per save, and the final wait for persisting."""
    writer = DaemonStorageWriter(job=job, persist_dir=persist_dir)
    blocked = []
    for step in range(1, saves + 1):
        start = time.perf_counter()
        dcp.save(state, storage_writer=writer, checkpoint_id=str(step))
        blocked.append(time.perf_counter() - start)
        time.sleep(gap_s)
    start = time.perf_counter()
    writer.wait_persisted(600)
    waited = time.perf_counter() - start
    writer.store.client.close()
    return statistics.median(blocked), waited


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=100)
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--gap-s", type=float, default=0.3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # DCP's "no process group: one process" warning
    target = tempfile.mkdtemp(prefix="persisted-", dir=args.dir or ".")
    count = args.mib * 2**18 // 10
    state = {f"t{i}": torch.randn(count) for i in range(10)}
    try:
        with private_daemon("--max-shm-bytes", f"{12 * args.mib + 256}MiB") as daemon:
            os.environ["GRADSYNC_DAEMON"] = daemon.endpoint
            for run, persist in enumerate([None, target, None]):
                blocked, waited = _run(state, f"bench-{run}", args.saves, args.gap_s, persist)
                label = "persist every step" if persist else "daemon memory only"
                print(f"{label:20s} save blocked {blocked * 1e3:7.1f} ms (median of "
                      f"{args.saves}), wait_persisted {waited * 1e3:6.0f} ms", flush=True)
    finally:
        shutil.rmtree(target, ignore_errors=True)


if __name__ == "__main__":
    main()
