"""What a checkpoint commit costs everyone else on the daemon (issue 50).

After answering a commit, the daemon frees the checkpoint it pruned and sets
spares aside for the next save (daemon/checkpoints.py).  Where that runs on
its event loop, every other client's request, collective and heartbeat waits
behind it.  This measures the wait: one process saves a state of `--mib` MiB
through the daemon's checkpoint requests (put, write, commit) every
`--gap-s`; right after each commit's reply a second session of another job
asks the daemon for its checkpoint list, and the time to that reply is
recorded, against the same request with no save before it.

    python -m benchmarks.checkpoint_settle --mib 256,1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.machine import describe
from benchmarks.private_daemon import private_daemon
from gradsync.client.checkpoints import DaemonCheckpoints, checkpoint_client, map_populated

MIB = 2**20


def measure(endpoint: str, mib: int, saves: int, gap_s: float) -> dict[str, float]:
    """Median ms of a bystander's request, right after a commit and at rest."""
    after, rest = [], []
    nbytes = mib * MIB
    with (checkpoint_client("saver", 0, endpoint) as saver,
          checkpoint_client("bystander", 0, endpoint) as bystander):
        saves_to, asks = DaemonCheckpoints(saver), DaemonCheckpoints(bystander)
        for step in range(1, saves + 2):
            reply = saver.call("ckpt_put", job="saver", step=step, item="data", nbytes=nbytes)
            mapping = map_populated(reply["name"], reply["nbytes"])
            mapping[:nbytes:4096] = bytes([step % 256]) * (nbytes // 4096)
            mapping.close()
            saves_to.commit(step, [(0, "data")])
            started = time.perf_counter()
            asks.list()
            waited = time.perf_counter() - started
            time.sleep(gap_s)
            started = time.perf_counter()
            asks.list()
            if step > 1:  # the first save has no spare and prunes nothing
                after.append(waited * 1e3)
                rest.append((time.perf_counter() - started) * 1e3)
    return {"after_commit_ms": statistics.median(after), "at_rest_ms": statistics.median(rest),
            "worst_after_ms": max(after)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", default="256,1024", help="state sizes in MiB, comma-separated")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--gap-s", type=float, default=1.0)
    args = parser.parse_args()
    sizes = [int(s) for s in args.mib.split(",")]
    print(", ".join(f"{k}: {v}" for k, v in describe().items() if k in ("CPU", "gradsync")))
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("| state | bystander's request after a commit (ms, median) | worst | at rest (ms) |")
    print("| --- | ---: | ---: | ---: |")
    for mib in sizes:
        # Two kept checkpoints, the save under way and two spares, with room to spare.
        budget = f"{6 * mib + 64}MiB"
        with private_daemon("--max-shm-bytes", budget) as daemon:
            result = measure(daemon.endpoint, mib, args.saves, args.gap_s)
        print(f"| {mib} MiB | {result['after_commit_ms']:.1f} | {result['worst_after_ms']:.1f} "
              f"| {result['at_rest_ms']:.2f} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
