"""Run the schedules of all daemons of one collective in lockstep on numpy arrays.

The reference semantics for the executor: at each step every daemon's sends
copy their ranges out of its buffer first, then every daemon applies its
receives in the order its step lists them.  The rules of `schedule.py` are
checked before anything runs, so a bad schedule fails with an error naming the
daemon, step and range instead of a wrong sum.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from gradsync.daemon.algorithms.schedule import Schedule, ScheduleError, check_schedules
from gradsync.protocol.dtypes import ReduceOp, parse_reduce_op
from gradsync.protocol.reduction import UFUNCS

#: A pairwise reduce op: a numpy ufunc, or any ``f(accumulated, incoming) -> result``.
Combine = Callable[[np.ndarray, np.ndarray], np.ndarray]



@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """Every daemon's buffer after the collective, and the bytes it sent and received."""

    outputs: list[np.ndarray]
    bytes_sent: list[int]
    bytes_received: list[int]


def resolve_op(op: str | ReduceOp | Combine) -> Combine:
    """A reduce op by name ("sum", "max", ...) or a callable used as is.

    "avg" is refused: between daemons it is a sum, divided once at the end.
    """
    if callable(op):
        return op
    parsed = parse_reduce_op(op)
    if parsed is ReduceOp.AVG:
        raise ValueError("'avg' is not pairwise: simulate 'sum' and divide the result")
    return UFUNCS[parsed]


def simulate(
    schedules: Sequence[Schedule],
    inputs: Sequence[np.ndarray],
    op: str | ReduceOp | Combine = "sum",
) -> SimulationResult:
    """Execute `schedules` (one per daemon, in rank order) over copies of `inputs`."""
    check_schedules(schedules)
    if len(inputs) != len(schedules):
        raise ValueError(f"{len(inputs)} inputs for {len(schedules)} schedules")
    count = schedules[0].count
    for rank, array in enumerate(inputs):
        if array.ndim != 1 or array.shape[0] != count or array.dtype != inputs[0].dtype:
            raise ValueError(
                f"input {rank} is {array.dtype}{list(array.shape)}, "
                f"expected {inputs[0].dtype}[{count}]"
            )
    combine = resolve_op(op)
    buffers = [np.array(array, copy=True) for array in inputs]
    itemsize = buffers[0].itemsize if buffers else 0
    sent = [0] * len(schedules)
    received = [0] * len(schedules)
    for number in range(len(schedules[0].steps)):
        # In flight: (source, destination) -> payloads in send order.
        in_flight: dict[tuple[int, int], list[np.ndarray]] = {}
        for schedule in schedules:
            buffer = buffers[schedule.rank]
            for send in schedule.steps[number].sends:
                payload = buffer[send.start : send.stop].copy()
                in_flight.setdefault((schedule.rank, send.peer), []).append(payload)
                sent[schedule.rank] += payload.nbytes
        for schedule in schedules:
            buffer = buffers[schedule.rank]
            for recv in schedule.steps[number].recvs:
                queue = in_flight.get((recv.peer, schedule.rank))
                if not queue:
                    raise ScheduleError(
                        f"daemon {schedule.rank}, step {number}: nothing arrived from "
                        f"{recv.peer} for [{recv.start}, {recv.stop})"
                    )
                payload = queue.pop(0)
                target = buffer[recv.start : recv.stop]
                if recv.reduce:
                    _combine_into(combine, target, payload)
                else:
                    target[...] = payload
                received[schedule.rank] += recv.count * itemsize
    return SimulationResult(buffers, sent, received)


def _combine_into(combine: Combine, target: np.ndarray, payload: np.ndarray) -> None:
    if isinstance(combine, np.ufunc):
        combine(target, payload, out=target)
    else:
        target[...] = combine(target, payload)
