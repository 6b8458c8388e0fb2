"""Rank program: a known sequence of collectives, then hold the job open until released.

argv[1]: folder; writes ready-<rank> there after the collectives and waits for
a file named `release` (bounded wait).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from gradsync.client import Client


def main() -> int:
    folder = sys.argv[1]
    with Client() as client:
        grads = client.empty(1024, np.float32)
        for _ in range(5):
            client.all_reduce(grads)
        params = np.zeros(256, np.float64)
        for _ in range(3):
            client.broadcast(params, src=0)
        with open(os.path.join(folder, f"ready-{client.rank}"), "w") as marker:
            marker.write("ok")
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(folder, "release")):
            if time.monotonic() > deadline:
                return 1
            time.sleep(0.02)
    return 0


if __name__ == "__main__":
    sys.exit(main())
