"""ScheduleRun, the executor of inter-daemon schedules, run in one event loop.

Every daemon's run lives in the same process; a message is a plain call of the
receiving run's `deliver`, in an order the test picks (shuffled, or holding
some messages back), so the executor's handling of slices that arrive early,
late or out of order is checked exactly, without sockets.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import pytest

from gradsync.daemon.algorithms import build_schedules
from gradsync.daemon.executor import ScheduleRun
from gradsync.protocol.dtypes import ReduceOp

SLICE_BYTES = 4096


class Wire:
    """Messages in flight between the runs: (sender, receiver, header, payload)."""

    def __init__(self) -> None:
        self.queue: list[tuple[int, int, dict[str, Any], bytes]] = []
        #: (daemon, what, step) in the order things happened.
        self.events: list[tuple[int, str, int]] = []
        self.runs: list[ScheduleRun] = []

    def sender(self, me: int) -> Any:
        def send(peer: int, header: dict[str, Any], payload: Any, zero_copy: bool) -> None:
            self.events.append((me, "send", header["step"]))
            self.queue.append((me, peer, header, bytes(payload)))

        return send

    def deliver(self, index: int) -> None:
        source, target, header, payload = self.queue.pop(index)
        self.events.append((target, "recv", header["step"]))
        self.runs[target].deliver(source, header["step"], header["t"], header["off"], payload)


def make_runs(
    algorithm: str, daemons: int, count: int, loop: asyncio.AbstractEventLoop
) -> tuple[Wire, list[np.ndarray]]:
    wire = Wire()
    buffers = [np.arange(count, dtype=np.float64) * (d + 1) + d for d in range(daemons)]
    for me, schedule in enumerate(build_schedules(algorithm, daemons, count)):
        wire.runs.append(ScheduleRun(
            schedule, buffers[me], ReduceOp.SUM, wire.sender(me), SLICE_BYTES, loop,
        ))
    return wire, buffers


@pytest.mark.parametrize("algorithm", ["ring", "rhd", "tree", "star"])
@pytest.mark.parametrize("daemons", [2, 3, 4, 5])
def test_any_arrival_order_gives_the_exact_sum(algorithm: str, daemons: int) -> None:
    async def main() -> None:
        count = 10_007  # uneven: many slices of 4 KiB, short tails
        wire, buffers = make_runs(algorithm, daemons, count, asyncio.get_running_loop())
        want = sum(np.arange(count, dtype=np.float64) * (d + 1) + d for d in range(daemons))
        shuffle = random.Random(daemons * 31 + len(algorithm))
        for run in wire.runs:
            run.start()
        while wire.queue:
            wire.deliver(shuffle.randrange(len(wire.queue)))
        for run, buffer in zip(wire.runs, buffers, strict=True):
            assert run.done.done() and run.done.exception() is None
            np.testing.assert_array_equal(buffer, want)

    asyncio.run(main())


def test_a_ring_forwards_each_reduced_slice_before_its_step_ends() -> None:
    """Step 2's slice j leaves as soon as step 1's slice j is reduced, not after
    all of step 1: the steps overlap on the wire."""

    async def main() -> None:
        count = 8 * SLICE_BYTES // 8  # 8 slices of float64 per daemon in all
        wire, buffers = make_runs("ring", 2, count, asyncio.get_running_loop())
        for run in wire.runs:
            run.start()
        slices_per_step = len(wire.queue) // 2
        assert slices_per_step > 1
        # Daemon 0 gets one slice of step 0 (of several): it forwards that one at once.
        first = next(i for i, m in enumerate(wire.queue) if m[1] == 0)
        sent_before = sum(1 for e in wire.events if e == (0, "send", 1))
        wire.deliver(first)
        assert wire.runs[0].step == 0  # the step is not over
        assert sum(1 for e in wire.events if e == (0, "send", 1)) == sent_before + 1
        while wire.queue:
            wire.deliver(0)
        assert all(run.done.done() for run in wire.runs)
        np.testing.assert_array_equal(buffers[0], buffers[1])

    asyncio.run(main())
