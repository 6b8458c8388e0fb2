"""Rank program: all-reduce a large buffer over and over until something fails.

Prints one JSON line per outcome: {"started": ...} after the first success, then
{"error": type, "message": ...} when a collective fails (and exits 0).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from gradsync.client import Client, GradsyncError


def main() -> int:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 4 * 1024 * 1024
    with Client() as client:
        buffer = client.empty(count, np.float32)
        buffer[...] = 1
        for attempt in range(100_000):
            try:
                client.all_reduce(buffer)
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
