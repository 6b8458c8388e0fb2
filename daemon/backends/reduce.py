"""Reduction kernels over the local ranks' shared-memory slots.

The result is computed into rank 0's slot and copied to the others, one
cache-sized chunk at a time, so each chunk is read from memory once per rank
and written once per rank: the floor for an in-place allreduce.  numpy
releases the GIL inside ufuncs, so disjoint ranges run in parallel threads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gradsync.protocol.dtypes import ReduceOp
from gradsync.protocol.reduction import UFUNCS as _UFUNCS

#: Elements per chunk are chosen so one chunk of every slot stays in L2.
CHUNK_BYTES = 128 * 1024



def chunk_elements(itemsize: int) -> int:
    return max(1, CHUNK_BYTES // itemsize)


def reduce_range(slots: Sequence[np.ndarray], op: ReduceOp, start: int, stop: int) -> None:
    """Reduce elements [start, stop) of every slot and write the result to all of them."""
    if len(slots) < 2 or start >= stop:
        return
    ufunc = _UFUNCS[op]
    ranks = len(slots)
    step = chunk_elements(slots[0].itemsize)
    first, rest = slots[0], slots[1:]
    # Overflow to inf or integer wrap-around is the caller's arithmetic, as in NCCL.
    with np.errstate(all="ignore"):
        _reduce_chunks(first, rest, ufunc, op is ReduceOp.AVG, ranks, start, stop, step)


def _reduce_chunks(
    first: np.ndarray,
    rest: Sequence[np.ndarray],
    ufunc: np.ufunc,
    average: bool,
    ranks: int,
    start: int,
    stop: int,
    step: int,
) -> None:
    for begin in range(start, stop, step):
        end = min(begin + step, stop)
        acc = first[begin:end]
        for slot in rest:
            ufunc(acc, slot[begin:end], out=acc)
        if average:
            np.divide(acc, ranks, out=acc)
        for slot in rest:
            np.copyto(slot[begin:end], acc)


def split_ranges(count: int, itemsize: int, parts: int) -> list[tuple[int, int]]:
    """Cut [0, count) into at most `parts` chunk-aligned ranges of similar size."""
    if count == 0:
        return []
    step = chunk_elements(itemsize)
    chunks = -(-count // step)
    parts = max(1, min(parts, chunks))
    per_part = -(-chunks // parts)
    ranges = []
    for part in range(parts):
        begin = part * per_part * step
        end = min(count, (part + 1) * per_part * step)
        if begin < end:
            ranges.append((begin, end))
    return ranges


def combine_into(target: np.ndarray, source: np.ndarray, op: ReduceOp) -> None:
    """target ← target op source, elementwise (avg combines as sum)."""
    with np.errstate(all="ignore"):
        _UFUNCS[op](target, source, out=target)


def reduce_into_first(slots: Sequence[np.ndarray], start: int, stop: int, op: ReduceOp) -> None:
    """Combine elements [start, stop) of every slot into the first one only.

    The node-level half of a multi-node allreduce: the result in slot 0 then
    goes to the peer daemons; `broadcast_from_first` writes the final value back.
    """
    ufunc = _UFUNCS[op]
    step = chunk_elements(slots[0].itemsize)
    first, rest = slots[0], slots[1:]
    with np.errstate(all="ignore"):
        for begin in range(start, stop, step):
            end = min(begin + step, stop)
            acc = first[begin:end]
            for slot in rest:
                ufunc(acc, slot[begin:end], out=acc)


def broadcast_from_first(
    slots: Sequence[np.ndarray], start: int, stop: int, divide_by: int = 1
) -> None:
    """Optionally divide slot 0's range (avg), then copy it into every other slot."""
    step = chunk_elements(slots[0].itemsize)
    first, rest = slots[0], slots[1:]
    with np.errstate(all="ignore"):
        for begin in range(start, stop, step):
            end = min(begin + step, stop)
            acc = first[begin:end]
            if divide_by != 1:
                np.divide(acc, divide_by, out=acc)
            for slot in rest:
                np.copyto(slot[begin:end], acc)
