"""Rank program: 64 all_reduces in flight at once, waited in a shuffled order.

Buffers mix `empty()` arrays and ordinary arrays, several sizes (from 0 to
above the inline-reduce threshold), dtypes and ops.  Every rank submits in the
same order (the keys are sequence numbers) but waits in its own random order;
the first few are awaited by polling `is_completed()` only.  Prints one JSON
record with the number of wrong results.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from gradsync.client import Client

SIZES = [0, 1, 3, 17, 1000, 4096, 65_537, 300_000]
IN_FLIGHT = 64
POLLED = 8


def make(rank: int, index: int, count: int, dtype: type) -> np.ndarray:
    return ((np.arange(count) * (rank + 1) + index) % 7).astype(dtype)


def expected(world: int, index: int, count: int, dtype: type, op: str) -> np.ndarray:
    inputs = [make(r, index, count, dtype) for r in range(world)]
    if op == "sum":
        return np.sum(inputs, axis=0).astype(dtype)
    return np.max(inputs, axis=0).astype(dtype)


def main() -> int:
    with Client() as client:
        rank, world = client.rank, client.world_size
        entries = []
        for index in range(IN_FLIGHT):
            count = SIZES[index % len(SIZES)]
            dtype = np.int64 if index % 3 == 0 else np.float32
            op = "max" if index % 4 == 0 else "sum"
            values = make(rank, index, count, dtype)
            if (index // 2) % 2 == 0:
                buffer = client.empty(count, dtype)
                buffer[...] = values
            else:
                buffer = values.copy()
            work = client.all_reduce(buffer, op=op, async_op=True)
            assert work is not None
            entries.append((index, buffer, work, expected(world, index, count, dtype, op)))
        order = np.random.default_rng(1000 + rank).permutation(IN_FLIGHT)
        deadline = time.monotonic() + 60
        for position in order[:POLLED]:
            work = entries[position][2]
            while not work.is_completed():
                if time.monotonic() > deadline:
                    print(json.dumps({"stuck": int(position)}), flush=True)
                    return 1
                time.sleep(0.001)
        for position in order[POLLED:]:
            entries[position][2].wait()
        wrong = [
            index
            for index, buffer, work, want in entries
            if not (work.is_completed() and work.exception() is None
                    and np.array_equal(buffer, want))
        ]
    print(json.dumps({"rank": rank, "checked": IN_FLIGHT, "wrong": wrong,
                      "order": [int(p) for p in order[:5]]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
