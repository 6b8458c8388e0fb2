"""Rank program: allreduce across daemons for every algorithm, against numpy.

Arguments (all optional, comma-separated): algorithms, dtypes, ops; each
defaults to all of them.
"""

from __future__ import annotations

import json
import sys

from reference_data import cases, matches, np_dtype

from gradsync.client import Client

ALGORITHMS = ["ring", "tree", "rhd", "star", "auto"]
OPS = ["sum", "avg", "min", "max", "prod", "band", "bor", "bxor"]
DTYPES = ["float32", "int32", "bfloat16", "float64"]
COUNTS = [0, 1, 7, 1000, 300_001]
def main() -> int:
    algorithms = sys.argv[1].split(",") if len(sys.argv) > 1 else ALGORITHMS
    dtypes = sys.argv[2].split(",") if len(sys.argv) > 2 else DTYPES
    ops = sys.argv[3].split(",") if len(sys.argv) > 3 else OPS
    failures = checked = 0
    with Client() as client:
        for case in cases(client.world_size, dtypes, ops, [(count,) for count in COUNTS]):
            mine = case.inputs[client.rank]
            for turn, algorithm in enumerate(algorithms):
                if (case.number + turn) % 2:  # each algorithm: empty() and ordinary buffers
                    buffer = client.empty(case.shape, np_dtype(case.dtype))
                    buffer[...] = mine
                else:
                    buffer = mine.copy()
                client.all_reduce(buffer, op=case.op, algorithm=algorithm)
                checked += 1
                if not matches(buffer, case.expected, case.op, case.dtype):
                    failures += 1
                    print(json.dumps({"fail": [algorithm, case.dtype, case.op, case.shape[0]]}),
                          flush=True)
    print(json.dumps({"rank": client.rank, "checked": checked, "failures": failures}), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
