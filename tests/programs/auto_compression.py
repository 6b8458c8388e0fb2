"""Rank program: allreduces with `auto` compression, as asked in the call or by
`GRADSYNC_COMPRESSION` (mode `env`), and whether the results were exact.

Arguments: modes (comma-separated: `auto`, `auto:bf16`, `auto:fp8`, `env`),
element count, allreduces per mode.  Two daemons, one rank each: an exact
float32 allreduce is then `x0 + x1` rounded once, so a result that equals it
ran uncompressed (bf16 and fp8 round the sums).  Prints one record per mode
(exact or not, a digest) and a last one that says all went through.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

from gradsync.client import Client


def main() -> int:
    modes, count, rounds = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
    with Client() as client:
        assert client.world_size == 2, "two daemons, one rank each"
        inputs = [np.random.default_rng(r).standard_normal(count).astype(np.float32)
                  for r in range(2)]
        exact = inputs[0] + inputs[1]
        buffer = client.empty(count, np.float32)
        for mode in modes:
            exacts = []
            for _ in range(rounds):
                buffer[:] = inputs[client.rank]
                if mode == "env":
                    client.all_reduce(buffer)  # GRADSYNC_COMPRESSION decides
                else:
                    client.all_reduce(buffer, compression=mode)
                exacts.append(bool(np.array_equal(buffer, exact)))
            print(json.dumps({"mode": mode, "exact": exacts,
                              "digest": hashlib.sha256(buffer.tobytes()).hexdigest()}),
                  flush=True)
        print(json.dumps({"done": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
