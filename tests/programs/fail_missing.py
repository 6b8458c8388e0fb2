"""Rank program: rank 1 never connects; rank 0's all_reduce must time out.

Rank 0 takes its deadline from GRADSYNC_TIMEOUT_S.  Prints one JSON record
with the error rank 0 got and how long it took.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from gradsync.client import Client, GradsyncError


def main() -> int:
    if int(os.environ["RANK"]) != 0:
        return 0  # the absent rank: exits without ever connecting
    with Client() as client:
        array = np.ones(16, dtype=np.float32)
        started = time.monotonic()
        record: dict[str, object] = {"rank": client.rank}
        try:
            client.all_reduce(array)
            record["error"] = None
        except GradsyncError as exc:
            record["error"] = type(exc).__name__
            record["message"] = str(exc)
            record["details"] = exc.details
        record["elapsed_s"] = time.monotonic() - started
        record["unchanged"] = bool(np.array_equal(array, np.ones(16, dtype=np.float32)))
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
