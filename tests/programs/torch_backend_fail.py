"""Rank program: the last rank dies mid-step; the others must raise, not hang.

Usage: torch_backend_fail.py
Every rank runs allreduces on backend "gradsync"; at step 3 the last rank
SIGKILLs itself once the others have their allreduce in flight (it waits until
the statistics of a daemon in GRADSYNC_TEST_DAEMONS say so).  The others print
{"error": type, "message": ..., "seconds": time to the error}.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import gradsync.client.torch  # noqa: F401 (registers the backend)
from gradsync.client.cli.stats import fetch_snapshot

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def emit(record: dict[str, Any]) -> None:
    """One JSON line in one write: ranks sharing a launcher's stdout do not interleave."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def others_in_flight() -> bool:
    """Whether the other ranks wait in the current allreduce: a daemon holds a key that
    waits for this rank alone, or one all its own ranks are in that waits for peers."""
    for endpoint in os.environ["GRADSYNC_TEST_DAEMONS"].split(","):
        for job in fetch_snapshot(endpoint + ".stats", 5.0)["jobs"].values():
            for entry in job.get("in_flight") or []:
                if entry.get("waiting_for_ranks") == [RANK] or entry.get("waiting_for_peers"):
                    return True
    return False


def wait_for_the_others(timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not others_in_flight():
        if time.monotonic() > deadline:
            raise TimeoutError("the other ranks never had this step's allreduce in flight")
        time.sleep(0.01)


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("GRADSYNC_TEST_TIMEOUT_S", "60")))
    dist.init_process_group("gradsync", rank=RANK, world_size=WORLD, timeout=timeout)
    t = torch.ones(1 << 16)
    for step in range(10):
        if step == 3 and RANK == WORLD - 1:
            wait_for_the_others()
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.monotonic()
        try:
            dist.all_reduce(t)
        except Exception as exc:
            emit({"error": type(exc).__name__, "message": str(exc), "step": step,
                  "seconds": time.monotonic() - started})
            dist.destroy_process_group()
            return
    emit({"error": None})


if __name__ == "__main__":
    main()
