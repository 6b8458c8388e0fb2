"""Rank program: one ring allreduce that is expected to fail, and the buffer after it.

argv: count, seed.  The input is float32 noise from `seed + rank`, in a
daemon-owned buffer; prints {"error": type or None, "message", "unchanged":
the elements that still hold the input, "summed": those that hold the sum of
every rank's input, "count"} and exits 0.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from gradsync.client import Client, GradsyncError


def rank_input(seed: int, rank: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed + rank).standard_normal(count, dtype=np.float32)


def main() -> int:
    count, seed = int(sys.argv[1]), int(sys.argv[2])
    with Client() as client:
        mine = rank_input(seed, client.rank, count)
        buffer = client.empty(count, np.float32)
        buffer[...] = mine
        error, message = None, ""
        try:
            client.all_reduce(buffer, algorithm="ring")
        except GradsyncError as exc:
            error, message = type(exc).__name__, exc.message
        total = sum(rank_input(seed, rank, count) for rank in range(client.world_size))
        unchanged = buffer == mine
        summed = (buffer == total) & ~unchanged
        print(json.dumps({"error": error, "message": message, "count": count,
                          "unchanged": int(unchanged.sum()), "summed": int(summed.sum())}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
