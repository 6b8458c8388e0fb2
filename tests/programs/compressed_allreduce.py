"""Rank program: compressed allreduce (and reduce-scatter) across daemons.

Arguments: formats, algorithms, counts (comma-separated).  Each case prints one
JSON record: a digest of the result's bytes (the test compares them across
ranks), and on rank 0 (the others' bytes are the same, by their digests) how
many finite elements break the error bound of compression_bounds.py, how many
non-finite or -0.0 elements came out wrong, and how many results are not
bfloat16 values (bf16 over 2+ daemons: every element must be one, since every
sum crossed the wire).  The other ranks make only their own input.  First the bad
arguments, which must raise InvalidArgumentError before anything is sent.
"""

from __future__ import annotations

import hashlib
import json
import sys

import ml_dtypes
import numpy as np
from compression_bounds import error_bound, make_inputs, rank_input

from gradsync.client import Client
from gradsync.protocol.errors import InvalidArgumentError


def bad_arguments(client: Client) -> list[str]:
    """Each bad call's error message (the test checks them)."""
    messages = []
    calls = [
        lambda: client.all_reduce(np.ones(8, np.int32), compression="bf16"),
        lambda: client.all_reduce(np.ones(8, np.float32), op="max", compression="fp8"),
        lambda: client.all_reduce(np.ones(8, np.float32), compression="int4"),
        lambda: client.all_reduce(np.ones(8, np.float16), compression="bf16"),
        lambda: client.all_reduce(np.ones(8, np.float32), error_feedback=True),
        lambda: client.reduce_scatter(np.ones(1, np.int64), np.ones(client.world_size, np.int64),
                                      compression="bf16"),
    ]
    for call in calls:
        try:
            call()
        except InvalidArgumentError as exc:
            messages.append(exc.message)
        else:
            messages.append("no error")
    return messages


def check(result: np.ndarray, inputs: list[np.ndarray], fmt: str, daemons: int,
          avg: bool) -> dict[str, int]:
    stacked = np.stack([x.astype(np.float64) for x in inputs])
    exact = stacked.sum(axis=0) / (len(inputs) if avg else 1)
    finite = np.isfinite(stacked).all(axis=0)
    wide = result.astype(np.float64)
    with np.errstate(all="ignore"):
        over = np.abs(wide - exact) > error_bound(fmt, inputs, daemons, avg)
    out_of_bound = int(np.count_nonzero(over & finite))
    specials = 0
    if result.size > 10:
        specials += int(not np.signbit(result[7]) or result[7] != 0)  # -0.0 stays -0.0
        specials += int(not np.isnan(result[9]))  # +inf + -inf
        specials += int(np.isfinite(result[3]) or np.isfinite(result[5]))
        if fmt == "bf16":
            specials += int(result[3] != np.inf or not np.isnan(result[5]))
    not_bf16 = 0
    if fmt == "bf16" and daemons > 1 and not avg:
        values = result[finite].astype(np.float32)
        not_bf16 = int(np.count_nonzero(
            values.astype(ml_dtypes.bfloat16).astype(np.float32) != values))
    return {"over": out_of_bound, "specials": specials, "not_bf16": not_bf16}


def main() -> int:
    formats, algorithms, counts = (arg.split(",") for arg in sys.argv[1:4])
    daemons = int(sys.argv[4])
    with Client() as client:
        print(json.dumps({"bad": bad_arguments(client)}), flush=True)
        number = 0
        for fmt in formats:
            for algorithm in algorithms:
                for dtype in ("float32", "float64"):
                    for op in ("sum", "avg"):
                        for count in map(int, counts):
                            number += 1
                            checks = client.rank == 0
                            inputs = (make_inputs(client.world_size, count, dtype, number)
                                      if checks else [])
                            buffer = (inputs[0].copy() if checks else rank_input(
                                client.world_size, count, dtype, number, client.rank))
                            client.all_reduce(buffer, op=op, algorithm=algorithm,
                                              compression=fmt)
                            record = (check(buffer, inputs, fmt, daemons, op == "avg")
                                      if checks else {})
                            print(json.dumps({
                                "case": [fmt, algorithm, dtype, op, count],
                                "digest": hashlib.sha256(buffer.tobytes()).hexdigest(),
                                **record}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
