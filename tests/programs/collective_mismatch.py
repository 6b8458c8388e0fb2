"""Rank program: collectives whose ranks disagree fail with MismatchError, then work goes on."""

from __future__ import annotations

import json
import sys

import numpy as np

from gradsync.client import Client, MismatchError


def attempt(name: str, call: object) -> dict[str, object]:
    try:
        call()  # type: ignore[operator]
    except MismatchError as exc:
        return {name: exc.message}
    return {name: None}


def main() -> int:
    with Client() as client:
        rank, world = client.rank, client.world_size
        array = np.full(8, rank, np.float32)
        before = array.copy()
        results = attempt("root", lambda: client.broadcast(array, src=rank % 2))
        results["untouched"] = bool((array == before).all())
        size = 4 + rank % 2
        results |= attempt("size", lambda: client.all_gather(
            np.empty(world * size, np.int64), np.full(size, rank, np.int64)))
        client.barrier()
        output = np.empty(world, np.int64)
        client.all_gather(output, np.array([rank], np.int64))
        results["after"] = output.tolist()
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
