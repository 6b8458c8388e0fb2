"""Rank program: the last rank dies mid-step; the others must raise, not hang.

Usage: torch_backend_fail.py
Every rank runs allreduces on backend "gradsync"; at step 3 the last rank
SIGKILLs itself while the others have their allreduce in flight.  The others
print {"error": type, "message": ..., "seconds": time to the error}.
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

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def emit(record: dict[str, Any]) -> None:
    """One JSON line in one write: ranks sharing a launcher's stdout do not interleave."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("GRADSYNC_TEST_TIMEOUT_S", "60")))
    dist.init_process_group("gradsync", rank=RANK, world_size=WORLD, timeout=timeout)
    t = torch.ones(1 << 16)
    for step in range(10):
        if step == 3 and RANK == WORLD - 1:
            time.sleep(0.5)  # the others are waiting in this step's allreduce by now
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
