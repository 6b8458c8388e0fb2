"""Rank program: a few allreduces of a large buffer, checked, then exit at once.

argv: [count] [rounds] [algorithm].  Prints {"rounds": n, "wrong": n} and leaves
as soon as its last collective returns, as a training script's rank does when
its loop ends: the ranks of the other daemons may still be finishing theirs.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from gradsync.client import Client


def main() -> int:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 4 * 1024 * 1024
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    algorithm = sys.argv[3] if len(sys.argv) > 3 else "ring"
    wrong = 0
    with Client() as client:
        world = client.world_size
        buffer = client.empty(count, np.float32)
        for round_ in range(rounds):
            buffer[...] = client.rank + round_
            client.all_reduce(buffer, algorithm=algorithm)
            expected = sum(range(world)) + world * round_
            wrong += int(np.count_nonzero(buffer != expected))
    print(json.dumps({"rounds": rounds, "wrong": wrong}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
