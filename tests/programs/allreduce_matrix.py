"""Rank program: every op x dtype x shape x buffer kind against a numpy reference.

Inputs are small integers (or powers of two for prod), so sums, products,
min and max are exact in every dtype and the check is equality; only avg,
which divides, is compared with a dtype-sized tolerance.  Every rank derives
every other rank's input, so each checks the full result itself.
"""

from __future__ import annotations

import json
import sys

import ml_dtypes
import numpy as np

from gradsync.client import Client

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64"]
OPS = ["sum", "avg", "min", "max", "prod"]
SHAPES = [(), (0,), (2, 0, 3), (1,), (7,), (16, 16, 16), (1_000_003,)]
AVG_RTOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-6, "float64": 1e-12}


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def make_input(rank: int, case: int, shape: tuple[int, ...], dtype: str, op: str) -> np.ndarray:
    count = int(np.prod(shape))
    index = np.arange(count, dtype=np.int64)
    if op == "prod":
        values = np.array([1, 2, 1, -1, 1], dtype=np.int64)[(index * 3 + rank + case) % 5]
        if dtype in ("uint8",):
            values = np.abs(values)
    else:
        values = (index * (rank + 3) + case * 7 + rank * 11) % 9 - 4
        if dtype == "uint8":
            values = values + 4
    return values.astype(np_dtype(dtype)).reshape(shape)


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
    kinds = sys.argv[1].split(",") if len(sys.argv) > 1 else ["empty", "ordinary"]
    failures = 0
    checked = 0
    with Client() as client:
        world = client.world_size
        case = 0
        for kind in kinds:
            for dtype in DTYPES:
                for op in OPS:
                    if op == "avg" and dtype not in AVG_RTOL:
                        continue
                    for shape in SHAPES:
                        case += 1
                        mine = make_input(client.rank, case, shape, dtype, op)
                        if kind == "empty":
                            buffer = client.empty(shape, np_dtype(dtype))
                            buffer[...] = mine
                        else:
                            buffer = mine.copy()
                        client.all_reduce(buffer, op=op)
                        inputs = [make_input(r, case, shape, dtype, op) for r in range(world)]
                        expected = reference(inputs, op)
                        checked += 1
                        if buffer.shape != shape:
                            ok = False
                        elif op == "avg":
                            ok = np.allclose(
                                buffer.astype(np.float64), expected.astype(np.float64),
                                rtol=AVG_RTOL[dtype], atol=AVG_RTOL[dtype],
                            )
                        else:
                            ok = np.array_equal(buffer, expected)
                        if not ok:
                            failures += 1
                            print(json.dumps({"fail": [kind, dtype, op, list(shape)]}), flush=True)
    print(json.dumps({"rank": client.rank, "checked": checked, "failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
