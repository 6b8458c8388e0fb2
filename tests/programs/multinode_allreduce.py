"""Rank program: allreduce across daemons for every algorithm, against numpy.

Inputs are small integers, so sum/min/max/prod are exact in every dtype and
only avg is compared with a tolerance.  Each rank derives every rank's input.
"""

from __future__ import annotations

import json
import sys

import ml_dtypes
import numpy as np

from gradsync.client import Client

ALGORITHMS = ["ring", "tree", "rhd", "star", "auto"]
OPS = ["sum", "avg", "min", "max", "prod"]
DTYPES = ["float32", "int32", "bfloat16", "float64"]
COUNTS = [0, 1, 7, 1000, 300_001]
AVG_RTOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-6, "float64": 1e-12}


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def make_input(rank: int, case: int, count: int, dtype: str, op: str) -> np.ndarray:
    index = np.arange(count, dtype=np.int64)
    if op == "prod":
        values = np.array([1, 2, 1, -1, 1, 1], dtype=np.int64)[(index * 5 + rank + case) % 6]
    else:
        values = (index * (rank + 3) + case * 7 + rank * 11) % 9 - 4
    return values.astype(np_dtype(dtype))


def reference(inputs: list[np.ndarray], op: str) -> np.ndarray:
    acc = inputs[0].copy()
    with np.errstate(all="ignore"):
        for x in inputs[1:]:
            if op in ("sum", "avg"):
                np.add(acc, x, out=acc)
            elif op == "prod":
                np.multiply(acc, x, out=acc)
            elif op == "min":
                np.minimum(acc, x, out=acc)
            else:
                np.maximum(acc, x, out=acc)
    if op == "avg":
        return (acc.astype(np.float64) / len(inputs)).astype(acc.dtype)
    return acc


def main() -> int:
    algorithms = sys.argv[1].split(",") if len(sys.argv) > 1 else ALGORITHMS
    failures = checked = 0
    with Client() as client:
        world = client.world_size
        case = 0
        for algorithm in algorithms:
            for dtype in DTYPES:
                for op in OPS:
                    if op == "avg" and dtype.startswith("int"):
                        continue
                    for count in COUNTS:
                        case += 1
                        mine = make_input(client.rank, case, count, dtype, op)
                        if case % 2:
                            buffer = client.empty(count, np_dtype(dtype))
                            buffer[...] = mine
                        else:
                            buffer = mine.copy()
                        client.all_reduce(buffer, op=op, algorithm=algorithm)
                        expected = reference(
                            [make_input(r, case, count, dtype, op) for r in range(world)], op
                        )
                        checked += 1
                        if op == "avg":
                            ok = np.allclose(buffer.astype(np.float64), expected.astype(np.float64),
                                             rtol=AVG_RTOL[dtype], atol=AVG_RTOL[dtype])
                        else:
                            ok = np.array_equal(buffer, expected)
                        if not ok:
                            failures += 1
                            print(json.dumps({"fail": [algorithm, dtype, op, count]}), flush=True)
    print(json.dumps({"rank": client.rank, "checked": checked, "failures": failures}), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
