"""Rank program for test_bucketer: `GradientBucketer` against a numpy reference.

Modes (argv[1]):

- `average`: several steps over a layout of mixed dtypes and sizes (with a
  zero-size and a 0-d array) and a small bucket cap, so there are several
  buckets; from the second step on, some arrays are written straight into
  their `slot()`.  Every rank derives every rank's inputs and checks the
  results against the numpy average.  Prints one JSON record.
- `misuse`: a later step that adds a different name, shape or too few arrays
  must fail with `InvalidArgumentError`, naming what the layout expects.
- `disagree`: rank 1 adds the same shapes as rank 0 in another order; the first
  `wait()` must raise `MismatchError` on every rank.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

from gradsync.client import Client, InvalidArgumentError, MismatchError
from gradsync.client.bucketer import GradientBucketer

#: name, shape, dtype: in "backward" order
LAYOUT: list[tuple[str, tuple[int, ...], str]] = [
    ("head.weight", (7, 5), "float32"),
    ("head.bias", (5,), "float32"),
    ("unused", (0,), "float32"),
    ("mid.weight", (300,), "float64"),
    ("mid.norm", (64, 33), "float32"),
    ("mid.bias", (33,), "float64"),
    ("embed.weight", (1000,), "float32"),
    ("scale", (), "float32"),
]
CAP_BYTES = 1024
STEPS = 3


def gradient(rank: int, step: int, index: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Rank `rank`'s gradient for one array at one step (any rank can compute it)."""
    count = int(np.prod(shape, dtype=np.int64))
    values = np.sin(np.arange(count) * 0.37 + rank * 1.3 + step * 0.7 + index) * (rank + 1)
    return values.astype(dtype).reshape(shape)


def emit(record: dict[str, Any]) -> None:
    os.write(sys.stdout.fileno(), (json.dumps(record) + "\n").encode())


def average(client: Client) -> dict[str, Any]:
    bucketer = GradientBucketer(client, bucket_cap_bytes=CAP_BYTES)
    failures: list[str] = []
    in_flight_before_wait: list[int] = []
    steps: list[dict[str, Any]] = []
    for step in range(STEPS):
        arrays = {}
        for index, (name, shape, dtype) in enumerate(LAYOUT):
            grad = gradient(client.rank, step, index, shape, dtype)
            if step >= 1 and name in ("mid.norm", "scale"):
                target = bucketer.slot(name)  # written in place: no copy either way
                target[...] = grad
                grad = target
            arrays[name] = grad
            bucketer.add(name, grad)
        in_flight_before_wait.append(bucketer.in_flight)
        stats = bucketer.wait()
        steps.append({"buckets": stats.buckets, "bytes": stats.bytes,
                      "comm_s": stats.comm_s, "hidden_share": stats.hidden_share})
        for index, (name, shape, dtype) in enumerate(LAYOUT):
            expected = np.mean(
                [gradient(r, step, index, shape, dtype).astype(np.float64)
                 for r in range(client.world_size)], axis=0,
            )
            got = arrays[name]
            tolerance = 1e-6 if dtype == "float32" else 1e-12
            if got.shape != shape or not np.allclose(got, expected, rtol=tolerance,
                                                     atol=tolerance):
                failures.append(f"step {step} {name}: {got!r} != {expected!r}")
            if not np.array_equal(bucketer.result(name), got):
                failures.append(f"step {step} {name}: result() differs from the array")
    return {
        "rank": client.rank,
        "failures": failures,
        "bucket_sizes": bucketer.bucket_sizes,
        "layout": [[e.name, e.bucket, e.offset] for e in bucketer.layout],
        "in_flight_before_wait": in_flight_before_wait,
        "steps": steps,
    }


def misuse(client: Client) -> dict[str, Any]:
    bucketer = GradientBucketer(client, bucket_cap_bytes=CAP_BYTES)
    a, b = np.ones(4, np.float32), np.ones((2, 3), np.float32)
    bucketer.add("a", a)
    bucketer.add("b", b)
    bucketer.wait()
    errors: dict[str, str] = {}
    for case, wrong in {
        "order": ("b", b),
        "shape": ("a", np.ones(5, np.float32)),
        "dtype": ("a", np.ones(4, np.float64)),
    }.items():
        try:
            bucketer.add(*wrong)
        except InvalidArgumentError as exc:
            errors[case] = str(exc)
        bucketer.add("a", a)  # the refused add changed nothing: the step goes on
        bucketer.add("b", b)
        bucketer.wait()
    bucketer.add("a", a)
    try:
        bucketer.wait()
    except InvalidArgumentError as exc:
        errors["missing"] = str(exc)
    bucketer.add("b", b)  # completes the step
    bucketer.wait()
    try:
        bucketer.add("a", a)
        bucketer.add("b", b)
        bucketer.add("c", a)
    except InvalidArgumentError as exc:
        errors["extra"] = str(exc)
    bucketer.wait()
    return {"rank": client.rank, "errors": errors, "steps": bucketer.steps,
            "a": a.tolist()}


def disagree(client: Client) -> dict[str, Any]:
    bucketer = GradientBucketer(client, bucket_cap_bytes=CAP_BYTES)
    names = ["x", "y"] if client.rank == 0 else ["y", "x"]
    for name in names:
        bucketer.add(name, np.ones(8, np.float32))
    try:
        bucketer.wait()
    except MismatchError as exc:
        return {"rank": client.rank, "error": type(exc).__name__, "message": str(exc)}
    return {"rank": client.rank, "error": None}


def main() -> int:
    mode = sys.argv[1]
    with Client() as client:
        record = {"average": average, "misuse": misuse, "disagree": disagree}[mode](client)
    emit(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
