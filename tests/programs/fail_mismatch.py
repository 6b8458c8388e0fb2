"""Rank program: two ranks submit one key with different count, dtype or op.

Rank 0 reduces an array from `empty()` (in shared memory), rank 1 an ordinary
array (staged through a scratch segment), so both buffer kinds are checked to
stay untouched by a refused collective.  Afterwards a matching all_reduce must
still work.  Prints one JSON record.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from gradsync.client import Client, GradsyncError

#: what -> per-rank (dtype, count, op)
CASES = {
    "count": [("float32", 4, "sum"), ("float32", 5, "sum")],
    "dtype": [("float32", 4, "sum"), ("float64", 4, "sum")],
    "op": [("float32", 4, "sum"), ("float32", 4, "max")],
}


def main() -> int:
    what = sys.argv[1]
    with Client() as client:
        dtype, count, op = CASES[what][client.rank]
        values = np.arange(count, dtype=dtype) + 10 * (client.rank + 1)
        if client.rank == 0:
            buffer = client.empty(count, dtype)
            buffer[...] = values
        else:
            buffer = values.copy()
        record: dict[str, object] = {"rank": client.rank}
        try:
            client.all_reduce(buffer, op=op)
            record["error"] = None
        except GradsyncError as exc:
            record["error"] = type(exc).__name__
            record["message"] = str(exc)
            record["details"] = exc.details
        record["unchanged"] = bool(np.array_equal(buffer, values))
        after = np.full(8, client.rank + 1, dtype=np.float32)
        client.all_reduce(after)
        record["after_ok"] = bool(np.array_equal(after, np.full(8, 3, dtype=np.float32)))
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
