"""Rank program for test_launch: block until `gradsync launch` forwards SIGTERM.

Argument: a folder for marker files.  Both ranks join the job.  Rank 0
submits an allreduce that rank 1 never matches and waits in it; rank 1 just
waits.  Each writes `ready-<rank>` (its pid) once blocked.  On SIGTERM a rank
writes `term-<rank>` and dies of the signal, as an unhandled SIGTERM would.
Every wait has a deadline: a rank that is never signalled exits 5.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import numpy as np

from gradsync.client import Client, GradsyncError

DEADLINE_S = 60.0


def mark(folder: Path, name: str) -> None:
    partial = folder / f".{name}.partial"
    partial.write_text(str(os.getpid()))
    os.replace(partial, folder / name)


def main() -> int:
    folder = Path(sys.argv[1])
    rank = int(os.environ["RANK"])

    def on_term(signum: int, frame: FrameType | None) -> None:
        mark(folder, f"term-{rank}")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    with Client() as client:
        if rank == 0:
            work = client.all_reduce(np.ones(4, np.float32), async_op=True)
            assert work is not None
            mark(folder, f"ready-{rank}")
            try:
                work.wait(timeout=DEADLINE_S)
            except GradsyncError as exc:
                print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        else:
            mark(folder, f"ready-{rank}")
            time.sleep(DEADLINE_S)
    return 5


if __name__ == "__main__":
    sys.exit(main())
