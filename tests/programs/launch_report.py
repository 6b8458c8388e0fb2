"""Rank program for test_launch: report what `gradsync launch` gave this rank.

Prints one JSON line: the torchrun-style environment, the daemon's pid and
endpoint as the client sees them, and the sum of all ranks over one allreduce.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from gradsync.client import Client


def main() -> int:
    with Client() as client:
        values = client.empty(3, np.int64)
        values[...] = [client.rank, 1, 10**client.rank]
        client.all_reduce(values, op="sum")
        record = {
            "rank": client.rank,
            "world_size": client.world_size,
            "local_rank": client.local_rank,
            "local_world_size": client.local_world_size,
            "job": client.job,
            "env_daemon": os.environ.get("GRADSYNC_DAEMON"),
            "daemon": client.daemon,
            "daemon_pid": client.daemon_pid,
            "sum": [int(v) for v in values],
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        }
    # One write(2) of under PIPE_BUF bytes: lines of ranks sharing a pipe never interleave.
    os.write(sys.stdout.fileno(), (json.dumps(record) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
