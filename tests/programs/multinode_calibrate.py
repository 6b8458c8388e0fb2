"""Rank program: enough allreduces for `auto` to re-agree its figures and timings.

Arguments: rounds, and optionally the algorithms (comma-separated, default
ring,rhd,auto).  Each round runs 4 KiB and 256 KiB float32 sums with each
algorithm in turn (2 keys per algorithm), every result checked exactly
against numpy.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from gradsync.client import Client

SIZES = (1024, 65536)  # float32 elements: 4 KiB and 256 KiB


def main() -> int:
    rounds = int(sys.argv[1])
    algorithms = sys.argv[2].split(",") if len(sys.argv) > 2 else ["ring", "rhd", "auto"]
    failures = checked = 0
    with Client() as client:
        world = client.world_size
        for round_number in range(rounds):
            for algorithm in algorithms:
                for count in SIZES:
                    base = np.arange(count, dtype=np.float32) % 97
                    buffer = client.empty(count, np.float32)
                    buffer[...] = base * (client.rank + 1) + round_number
                    client.all_reduce(buffer, algorithm=algorithm)
                    expected = base * (world * (world + 1) // 2) + world * round_number
                    checked += 1
                    if not np.array_equal(buffer, expected):
                        failures += 1
                        print(json.dumps({"fail": [algorithm, count, round_number]}), flush=True)
    print(json.dumps({"rank": client.rank, "checked": checked, "failures": failures}), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
