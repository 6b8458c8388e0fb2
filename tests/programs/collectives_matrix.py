"""Rank program: every collective, root, size, dtype and buffer kind against numpy.

argv[1]: comma-separated collectives (default all); argv[2]: "group" to also
run everything inside sub-groups (see main).
"""

from __future__ import annotations

import json
import sys

import numpy as np
from reference_data import make_input, matches, np_dtype, op_applies, reference

from gradsync.client import Client

KINDS = ["broadcast", "reduce", "all_gather", "reduce_scatter", "gather", "scatter",
         "all_to_all", "barrier"]
DTYPES = ["float32", "int64", "bfloat16"]
CHUNKS = [0, 1, 7, 100_003]
#: The ops a reducing collective takes turns with, case by case (those its dtype has).
REDUCE_OPS = {"reduce": ["max", "band", "bxor"], "reduce_scatter": ["sum", "bor", "bxor"]}


def reduce_op(kind: str, dtype: str, case: int) -> str:
    ops = [op for op in REDUCE_OPS[kind] if op_applies(op, dtype)]
    return ops[case % len(ops)]


def run_kind(client: Client, kind: str, dtype: str, c: int, case: int, root: int,
             empty: bool) -> bool:
    """One collective; True when this rank's result equals the reference."""
    world, rank = client.world_size, client.rank
    dt = np_dtype(dtype)

    def buffer(n: int, values: np.ndarray | None = None) -> np.ndarray:
        array = client.empty(n, dt) if empty else np.empty(n, dt)
        array[...] = 0 if values is None else values
        return array

    def inputs(n: int, op: str = "sum") -> list[np.ndarray]:
        return [make_input(r, case, (n,), dtype, op) for r in range(world)]

    if kind == "broadcast":
        everyone = inputs(c)
        array = buffer(c, everyone[rank])
        client.broadcast(array, src=root)
        return matches(array, everyone[root], "sum", dtype)
    if kind == "reduce":
        op = reduce_op(kind, dtype, case)
        everyone = inputs(c, op)
        array = buffer(c, everyone[rank])
        client.reduce(array, dst=root, op=op)
        expected = reference(everyone, op) if rank == root else everyone[rank]
        return matches(array, expected, op, dtype)
    if kind == "all_gather":
        everyone = inputs(c)
        output = buffer(world * c)
        client.all_gather(output, buffer(c, everyone[rank]))
        return matches(output, np.concatenate(everyone), "sum", dtype)
    if kind == "reduce_scatter":
        op = reduce_op(kind, dtype, case)
        everyone = inputs(world * c, op)
        output = buffer(c)
        client.reduce_scatter(output, buffer(world * c, everyone[rank]), op=op)
        expected = reference(everyone, op)[rank * c : (rank + 1) * c]
        return matches(output, expected, op, dtype)
    if kind == "gather":
        everyone = inputs(c)
        output = buffer(world * c) if rank == root else None
        client.gather(output, buffer(c, everyone[rank]), dst=root)
        return output is None or matches(output, np.concatenate(everyone), "sum", dtype)
    if kind == "scatter":
        source = make_input(root, case, (world * c,), dtype, "sum")
        output = buffer(c)
        client.scatter(output, buffer(world * c, source) if rank == root else None, src=root)
        return matches(output, source[rank * c : (rank + 1) * c], "sum", dtype)
    if kind == "all_to_all":
        everyone = inputs(world * c)
        output = buffer(world * c)
        client.all_to_all(output, buffer(world * c, everyone[rank]))
        expected = np.concatenate([everyone[j][rank * c : (rank + 1) * c] for j in range(world)])
        return matches(output, expected, "sum", dtype)
    if kind == "barrier":
        client.barrier()
        return True
    raise ValueError(kind)


def run_all(client: Client, kinds: list[str], tag: str) -> tuple[int, int]:
    checked = failures = 0
    case = 0
    for kind in kinds:
        roots = range(client.world_size) if kind in ("broadcast", "reduce", "gather",
                                                      "scatter") else [0]
        for dtype in DTYPES:
            for c in CHUNKS:
                for root in roots:
                    case += 1
                    ok = run_kind(client, kind, dtype, c, case, root, empty=case % 2 == 0)
                    checked += 1
                    if not ok:
                        failures += 1
                        print(json.dumps({"fail": [tag, kind, dtype, c, root]}), flush=True)
    return checked, failures


def main() -> int:
    kinds = sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] else KINDS
    with Client() as client:
        checked, failures = run_all(client, kinds, "world")
        if len(sys.argv) > 2 and sys.argv[2] == "group" and client.world_size >= 3:
            # Two groups used concurrently from different ranks: the odd ranks (in
            # reverse order) and the first two ranks; rank 1 is in both.
            odd = list(range(client.world_size))[1::2][::-1]
            first_two = [0, 1]
            groups = [client.new_group(odd), client.new_group(first_two)]
            for name, group in zip(("odd", "first_two"), groups, strict=True):
                if group is not None:
                    more_checked, more_failures = run_all(group, kinds, name)
                    checked += more_checked
                    failures += more_failures
            client.barrier()
    print(json.dumps({"rank": client.rank, "checked": checked, "failures": failures}),
          flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
