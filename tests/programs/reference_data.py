"""Inputs and numpy reference results shared by the allreduce rank programs.

Inputs are small integers (or ±1, 2 for prod), so sums, products, min and max
are exact in every dtype and results can be compared for equality; only avg,
which divides, needs a tolerance (`AVG_RTOL`).  The bitwise ops (integers only)
get bit patterns over the dtype's full width, so a lost high bit shows.  Every
rank can derive every other rank's input, so each checks the full result itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

import ml_dtypes
import numpy as np

AVG_RTOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-6, "float64": 1e-12}
BITWISE = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


def op_applies(op: str, dtype: str) -> bool:
    """Whether the daemon defines `op` for `dtype`: no avg of integers, no bits of floats."""
    if op == "avg":
        return dtype in AVG_RTOL
    if op in BITWISE:
        return dtype not in AVG_RTOL
    return True


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def make_input(rank: int, case: int, shape: tuple[int, ...], dtype: str, op: str) -> np.ndarray:
    count = int(np.prod(shape))
    index = np.arange(count, dtype=np.int64)
    if op in BITWISE:
        # A multiplicative hash of (rank, case, index), wrapping in 64 bits; the
        # cast keeps the low bits, so every bit of every width varies.
        with np.errstate(over="ignore"):
            mixed = (index.astype(np.uint64) + np.uint64(rank * 1_000_003 + case * 7919 + 1)
                     ) * np.uint64(0x9E3779B97F4A7C15)
        return (mixed ^ (mixed >> np.uint64(29))).astype(np_dtype(dtype)).reshape(shape)
    if op == "prod":
        values = np.array([1, 2, 1, -1, 1], dtype=np.int64)[(index * 3 + rank + case) % 5]
        if dtype == "uint8":
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
            elif op in BITWISE:
                BITWISE[op](acc, x, out=acc)
            elif op == "min":
                np.minimum(acc, x, out=acc)
            else:
                np.maximum(acc, x, out=acc)
    if op == "avg":
        return (acc.astype(np.float64) / len(inputs)).astype(acc.dtype)
    return acc


def matches(result: np.ndarray, expected: np.ndarray, op: str, dtype: str) -> bool:
    if result.shape != expected.shape:
        return False
    if op == "avg":
        tolerance = AVG_RTOL[dtype]
        return bool(np.allclose(result.astype(np.float64), expected.astype(np.float64),
                                rtol=tolerance, atol=tolerance))
    return bool(np.array_equal(result, expected))


class Case(NamedTuple):
    """One (dtype, op, shape) of a matrix: every rank's input and the numpy result."""

    number: int
    dtype: str
    op: str
    shape: tuple[int, ...]
    inputs: list[np.ndarray]
    expected: np.ndarray


def cases(world: int, dtypes: Iterable[str], ops: Iterable[str],
          shapes: Iterable[tuple[int, ...]]) -> Iterator[Case]:
    """Every (dtype, op, shape) the daemon defines, numbered from 1; the reference
    is computed once per case, for all the buffers or algorithms a program tries."""
    ops, shapes = list(ops), list(shapes)
    number = 0
    for dtype in dtypes:
        for op in ops:
            if not op_applies(op, dtype):
                continue
            for shape in shapes:
                number += 1
                inputs = [make_input(r, number, shape, dtype, op) for r in range(world)]
                yield Case(number, dtype, op, shape, inputs, reference(inputs, op))
