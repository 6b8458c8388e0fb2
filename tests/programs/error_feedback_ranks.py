"""Rank program: error feedback over many steps, compressed reduce-scatter, wire bytes.

Arguments: format, steps.  The same input every step on the same daemon
buffer, so each step's rounding is the same: without error feedback the sum of
the results drifts from the exact sum by `steps` roundings, with it by about
one (the residual still held).  Prints both drifts, the daemon's statistics
(residual bytes held, bytes per peer on the wire and before compression) and
how far a compressed reduce-scatter lies from its exact result.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from gradsync.client import Client
from gradsync.client.cli.stats import fetch_snapshot

COUNT = 50_000


def drift(client: Client, fmt: str, steps: int, feedback: bool, exact: np.ndarray) -> float:
    """Largest |sum of the results - steps x exact| over the elements, relative to |exact|."""
    buffer = client.empty(COUNT, np.float32)
    mine = np.random.default_rng(client.rank).standard_normal(COUNT).astype(np.float32)
    total = np.zeros(COUNT)
    for _ in range(steps):
        buffer[:] = mine
        client.all_reduce(buffer, compression=fmt, error_feedback=feedback)
        total += buffer
    return float(np.max(np.abs(total - steps * exact)) / np.max(np.abs(exact)))


def main() -> int:
    fmt, steps = sys.argv[1], int(sys.argv[2])
    with Client() as client:
        inputs = [np.random.default_rng(r).standard_normal(COUNT).astype(np.float32)
                  for r in range(client.world_size)]
        exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
        without = drift(client, fmt, steps, False, exact)
        held = client.empty(COUNT, np.float32)  # kept alive: its residual is counted
        held[:] = inputs[client.rank]
        client.all_reduce(held, compression=fmt, error_feedback=True)
        with_feedback = drift(client, fmt, steps, True, exact)
        snapshot = fetch_snapshot(os.environ["GRADSYNC_DAEMON"] + ".stats", 10.0)
        world = client.world_size
        scatter_in = np.concatenate(inputs)  # every rank's input: world x COUNT
        mine = np.random.default_rng(client.rank).standard_normal(world * COUNT)
        out = np.empty(COUNT, np.float32)
        scatter = client.empty(world * COUNT, np.float32)  # daemon memory: feedback applies
        scatter[:] = mine
        client.reduce_scatter(out, scatter, compression=fmt, error_feedback=True)
        everyone = [np.random.default_rng(r).standard_normal(world * COUNT).astype(np.float32)
                    for r in range(world)]
        want = np.sum(everyone, axis=0, dtype=np.float64)[client.rank * COUNT:][:COUNT]
        del scatter_in
        print(json.dumps({
            "without": without, "with": with_feedback,
            "error_feedback": snapshot["error_feedback"], "peers": snapshot["peers"],
            "scatter_error": float(np.max(np.abs(out - want)) / np.max(np.abs(want))),
        }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
