"""Rank program: run one collective on a large buffer over and over until it fails.

argv: [count] [marker folder] [collective].  Writes started-<rank> in the
marker folder after the first success; prints {"error": type, "message", "at"}
when a collective fails, and exits 0.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from gradsync.client import Client, GradsyncError


def main() -> int:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 4 * 1024 * 1024
    kind = sys.argv[3] if len(sys.argv) > 3 else "all_reduce"
    with Client() as client:
        world = client.world_size
        one = client.empty(count, np.float32)
        many = client.empty(world * count, np.float32)
        one[...] = 1
        many[...] = 1
        calls = {
            "all_reduce": lambda: client.all_reduce(one),
            "broadcast": lambda: client.broadcast(one, src=0),
            "reduce": lambda: client.reduce(one, dst=0),
            "all_gather": lambda: client.all_gather(many, one),
            "reduce_scatter": lambda: client.reduce_scatter(one, many),
            "gather": lambda: client.gather(many if client.rank == 0 else None, one, dst=0),
            "scatter": lambda: client.scatter(one, many if client.rank == 0 else None, src=0),
            "all_to_all": lambda: client.all_to_all(many, many.copy()),
            "barrier": lambda: client.barrier(),
        }
        for attempt in range(1_000_000):
            try:
                calls[kind]()
            except GradsyncError as exc:
                print(json.dumps({"error": type(exc).__name__, "message": exc.message,
                                  "at": time.monotonic()}), flush=True)
                return 0
            if attempt == 0 and len(sys.argv) > 2:
                with open(f"{sys.argv[2]}/started-{client.rank}", "w") as marker:
                    marker.write("ok")
    return 1


if __name__ == "__main__":
    sys.exit(main())
