"""Rank program: every op x dtype x shape x buffer kind against a numpy reference."""

from __future__ import annotations

import json
import sys

from reference_data import cases, matches, np_dtype

from gradsync.client import Client

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64"]
OPS = ["sum", "avg", "min", "max", "prod", "band", "bor", "bxor"]
SHAPES = [(), (0,), (2, 0, 3), (1,), (7,), (16, 16, 16), (1_000_003,)]
def main() -> int:
    kinds = sys.argv[1].split(",") if len(sys.argv) > 1 else ["empty", "ordinary"]
    failures = 0
    checked = 0
    with Client() as client:
        for case in cases(client.world_size, DTYPES, OPS, SHAPES):
            mine = case.inputs[client.rank]
            for kind in kinds:
                if kind == "empty":
                    buffer = client.empty(case.shape, np_dtype(case.dtype))
                    buffer[...] = mine
                else:
                    buffer = mine.copy()
                client.all_reduce(buffer, op=case.op)
                checked += 1
                if not matches(buffer, case.expected, case.op, case.dtype):
                    failures += 1
                    print(json.dumps({"fail": [kind, case.dtype, case.op, list(case.shape)]}),
                          flush=True)
    print(json.dumps({"rank": client.rank, "checked": checked, "failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
