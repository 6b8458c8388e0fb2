"""Rank program for the rank-killed-mid-allreduce tests.

Every rank all-reduces a 64 MiB daemon array in a loop; after the first
round each prints `{"ready": pid}`.  The test SIGKILLs one rank while the
others are in the middle of an all_reduce; they print the error they got and
exit 0 (a rank that never gets one gives up after argv[1] seconds).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from gradsync.client import Client, GradsyncError


def main() -> int:
    give_up_at = time.monotonic() + float(sys.argv[1])
    with Client() as client:
        array = client.empty(16 * 1024 * 1024, np.float32)
        array[...] = 1
        record: dict[str, object] = {"rank": client.rank, "error": None}
        rounds = 0
        while time.monotonic() < give_up_at:
            try:
                client.all_reduce(array)
            except GradsyncError as exc:
                record["error"] = type(exc).__name__
                break
            rounds += 1
            if rounds == 1:
                print(json.dumps({"ready": os.getpid()}), flush=True)
        record["rounds"] = rounds
        del array
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
