"""Rank program for test_launch: rank 1 fails while rank 0 waits in a collective.

Argument: a folder for marker files.  Rank 0 joins the job, submits an
allreduce, writes `blocked-0` (its pid) and waits.  Rank 1 never joins, so
that collective cannot complete before its (long) deadline: rank 1 waits for
the marker and exits with status 3.  `gradsync launch` must then stop rank 0
and exit 3 itself.  Every wait has a deadline, so a broken launcher shows up
as a distinct exit status (5), not a hang.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

from gradsync.client import Client, GradsyncError

DEADLINE_S = 60.0


def mark(folder: Path, name: str) -> None:
    """Write the marker atomically: it exists only once it holds our pid."""
    partial = folder / f".{name}.partial"
    partial.write_text(str(os.getpid()))
    os.replace(partial, folder / name)


def main() -> int:
    folder = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    if rank == 1:
        deadline = time.monotonic() + DEADLINE_S
        while not (folder / "blocked-0").exists():
            if time.monotonic() > deadline:
                return 5
            time.sleep(0.01)
        return 3
    with Client() as client:
        work = client.all_reduce(np.ones(4, np.float32), async_op=True)
        assert work is not None
        mark(folder, f"blocked-{rank}")
        try:
            work.wait(timeout=DEADLINE_S)
        except GradsyncError as exc:
            print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    return 5


if __name__ == "__main__":
    sys.exit(main())
