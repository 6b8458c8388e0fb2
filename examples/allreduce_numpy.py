"""Data-parallel linear regression on numpy, synchronised by gradsync.

Run it on two local ranks (a private daemon is started and stopped for you):

    gradsync launch --nproc-per-node 2 examples/allreduce_numpy.py

Every rank generates the same data set from one seed and keeps its own shard
of the rows.  Each step it computes the gradient of the mean squared error on
its shard, writes it into an array that lives in the daemon's shared memory
(`Client.empty`, so the allreduce copies nothing), averages it across ranks
with `all_reduce(op="avg")`, and takes an SGD step.  At the end each rank
checks that

- its weights are bit-identical to every other rank's (all-reduced `min` and
  `max` equal its own), and
- they equal, to float32 tolerance, what single-process full-batch gradient
  descent reaches on the whole data set;

and exits 1 if not.  Options: `--steps N`, `--samples N`, `--features N`,
`--lr X`, `--seed N`.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from gradsync.client import Client


def make_data(seed: int, samples: int, features: int) -> tuple[np.ndarray, np.ndarray]:
    """The full data set; every rank builds the same one from the seed."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, features))
    true_weights = rng.uniform(-2.0, 2.0, features)
    y = x @ true_weights + 0.1 * rng.standard_normal(samples)
    return x.astype(np.float32), y.astype(np.float32)


def shard(rank: int, world_size: int, samples: int) -> slice:
    """This rank's rows: contiguous, sizes differing by at most one."""
    base, extra = divmod(samples, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def reference_weights(
    x: np.ndarray, y: np.ndarray, steps: int, lr: float
) -> np.ndarray:
    """Full-batch gradient descent in one process, in float64."""
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    weights = np.zeros(x.shape[1])
    for _ in range(steps):
        weights -= lr * (x64.T @ (x64 @ weights - y64)) / len(y64)
    return weights


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    x, y = make_data(args.seed, args.samples, args.features)

    with Client() as client:
        rank, world = client.rank, client.world_size
        rows = shard(rank, world, args.samples)
        x_mine, y_mine = x[rows], y[rows]
        if rank == 0:
            print(
                f"gradsync example: {world} rank(s), {args.samples} samples x "
                f"{args.features} features, daemon pid {client.daemon_pid} at {client.daemon}",
                flush=True,
            )

        # One shared-memory buffer carries the gradient and, in its last slot,
        # the loss, so each step costs one collective.  Both are scaled by
        # world/samples rather than 1/len(shard): the rank average is then the
        # exact full-data mean even when shards differ in size.
        sync = client.empty(args.features + 1, np.float32)
        gradient, loss = sync[:-1], sync[-1:]
        scale = np.float32(world / args.samples)
        weights = np.zeros(args.features, np.float32)

        started = time.perf_counter()
        for step in range(args.steps):
            residual = x_mine @ weights - y_mine
            np.matmul(x_mine.T, residual, out=gradient)
            gradient *= scale
            loss[0] = 0.5 * scale * np.dot(residual, residual)
            client.all_reduce(sync, op="avg")
            weights -= np.float32(args.lr) * gradient
            if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {loss[0]:.6f}", flush=True)
        elapsed = time.perf_counter() - started

        # Identical everywhere: the element-wise min and max over ranks are ours.
        low = client.empty(args.features, np.float32)
        high = client.empty(args.features, np.float32)
        low[...] = weights
        high[...] = weights
        client.all_reduce(low, op="min")
        client.all_reduce(high, op="max")
        identical = bool(np.array_equal(low, weights) and np.array_equal(high, weights))

    expected = reference_weights(x, y, args.steps, args.lr)
    error = float(np.max(np.abs(weights - expected)))
    matches = bool(np.allclose(weights, expected, rtol=1e-4, atol=1e-4))
    if rank == 0:
        print(
            f"{args.steps} steps in {elapsed:.3f}s "
            f"({elapsed / max(args.steps, 1) * 1e6:.0f} us/step)",
            flush=True,
        )
    if not identical:
        print(f"rank {rank}: FAIL: weights differ between ranks", file=sys.stderr)
    if not matches:
        print(
            f"rank {rank}: FAIL: weights differ from single-process gradient descent "
            f"(max abs error {error:.2e})",
            file=sys.stderr,
        )
    if identical and matches and rank == 0:
        print(
            f"OK: weights identical on all {world} ranks and equal to single-process "
            f"full-batch gradient descent (max abs error {error:.1e})",
            flush=True,
        )
    return 0 if identical and matches else 1


if __name__ == "__main__":
    sys.exit(main())
