"""Rank program: allreduces around the fast path's size limit, every op x dtype.

argv[1] is the daemon's fast_path_bytes.  For each dtype the element counts
straddle the limit (limit/itemsize - 1, limit/itemsize, + 1) besides 0 and 1,
so some cases run on the fast page and the rest over the socket.  Each
result is checked against the numpy reference, and a digest of all results
is printed, so the test can check that ranks, and the two paths, agree bit
for bit.
"""

from __future__ import annotations

import hashlib
import json
import sys

from reference_data import make_input, matches, np_dtype, op_applies, reference

from gradsync.client import Client

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64"]
OPS = ["sum", "avg", "min", "max", "prod", "band", "bor", "bxor"]


def main() -> int:
    limit = int(sys.argv[1])
    failures, checked, small = 0, 0, 0
    digest = hashlib.blake2b(digest_size=16)
    with Client() as client:
        world = client.world_size
        case = 0
        for dtype in DTYPES:
            itemsize = np_dtype(dtype).itemsize
            edge = limit // itemsize
            for op in OPS:
                if not op_applies(op, dtype):
                    continue
                for count in (0, 1, edge - 1, edge, edge + 1):
                    case += 1
                    shape = (count,)
                    mine = make_input(client.rank, case, shape, dtype, op)
                    buffer = client.empty(shape, np_dtype(dtype)) if case % 2 else mine.copy()
                    buffer[...] = mine
                    client.all_reduce(buffer, op=op)
                    expected = reference(
                        [make_input(r, case, shape, dtype, op) for r in range(world)], op
                    )
                    checked += 1
                    small += count * itemsize <= limit
                    digest.update(buffer.tobytes())
                    if not matches(buffer, expected, op, dtype):
                        failures += 1
                        print(json.dumps({"fail": [dtype, op, count]}), flush=True)
    print(json.dumps({"rank": client.rank, "checked": checked, "small": small,
                      "failures": failures, "digest": digest.hexdigest()}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
