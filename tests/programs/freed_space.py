"""Rank program: a freed `empty()` segment's space in /dev/shm is back by the time
the next collective returns, on the fast path and on the socket.

Each round allocates an input and an output in daemon memory, runs one
collective over them (argv[1]: all_gather or reduce_scatter), lets both go,
runs one small allreduce, and then rank 0 reserves (posix_fallocate) as much
of /dev/shm as the freed segments of every rank took: on a tmpfs sized for
the job that fails with ENOSPC while any of them still holds its space.
Prints one JSON line per rank.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from gradsync.client import Client

ELEMENTS = 1 << 20  # 4 MiB of float32 per input
ROUNDS = 4


def reserve(nbytes: int) -> str | None:
    """Reserve `nbytes` in /dev/shm as another program would; None if it fit."""
    path = f"/dev/shm/freed-space-probe-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return None
    except OSError as exc:
        return f"{exc.strerror} reserving {nbytes} bytes"
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    kind = sys.argv[1]
    failures: list[str] = []
    with Client() as client:
        small = np.ones(16, np.float32)
        client.all_reduce(small)  # scratch and fast page exist from here on
        for round_ in range(ROUNDS):
            x = client.empty(ELEMENTS, np.float32)
            x[:] = client.rank + 1
            if kind == "all_gather":
                out = client.empty((client.world_size, ELEMENTS), np.float32)
                client.all_gather(out, x)
                ok = all(float(out[r, 0]) == r + 1 for r in range(client.world_size))
            else:
                out = client.empty(ELEMENTS // client.world_size, np.float32)
                client.reduce_scatter(out, x)
                ok = float(out[0]) == sum(range(1, client.world_size + 1))
            if not ok:
                failures.append(f"round {round_}: wrong {kind} result")
            taken = (x.nbytes + out.nbytes) * client.world_size
            del x, out
            client.all_reduce(small)
            if client.rank == 0:
                problem = reserve(taken)
                if problem is not None:
                    failures.append(f"round {round_}: {problem} after the next collective")
            client.barrier()
    print(json.dumps({"rank": client.rank, "failures": failures}), flush=True)


if __name__ == "__main__":
    main()
