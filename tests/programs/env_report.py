"""Rank program for test_environment: which identity `Client()` found in the environment.

Prints one JSON line: rank, world size, local rank and size, job, the launcher
style the identity came from, and the sum of all ranks (one allreduce), which
is only right if every rank got a distinct, correct rank.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from gradsync.client import Client
from gradsync.client.environment import resolve_identity


def main() -> int:
    source = resolve_identity().source
    with Client() as client:
        ranks = client.empty(2, np.int64)
        ranks[...] = [client.rank, 1 << client.rank]
        client.all_reduce(ranks, op="sum")
        record = {
            "rank": client.rank,
            "world_size": client.world_size,
            "local_rank": client.local_rank,
            "local_world_size": client.local_world_size,
            "job": client.job,
            "source": source,
            "sum": int(ranks[0]),
            "bits": int(ranks[1]),
        }
    os.write(sys.stdout.fileno(), (json.dumps(record) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
