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
from gradsync.daemon.run.executor import ScheduleRun
from gradsync.daemon.run.receives import ChunkPool
from gradsync.protocol.dtypes import ReduceOp
from gradsync.protocol.errors import CollectiveError, ProtocolError

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


# (star has no later step a slice could arrive early for)
@pytest.mark.parametrize("algorithm", ["ring", "rhd", "tree"])
@pytest.mark.parametrize("daemons", [3, 4, 5])
def test_a_run_needs_a_peer_exactly_while_its_slices_are_still_to_come(
    algorithm: str, daemons: int
) -> None:
    """When a daemon leaves the job, the others decide from `needs_from` whether
    they can still finish.  It must be true exactly while some of the elements a
    run receives from that daemon have not arrived, whatever the arrival order:
    slices kept early for a later step count as arrived."""
    async def main() -> None:
        count = 10_007
        wire, _ = make_runs(algorithm, daemons, count, asyncio.get_running_loop())
        schedules = build_schedules(algorithm, daemons, count)
        total = {(src, me): sum(recv.stop - recv.start for step in schedule.steps
                                for recv in step.recvs if recv.peer == src)
                 for me, schedule in enumerate(schedules) for src in range(daemons)}
        arrived = dict.fromkeys(total, 0)
        shuffle = random.Random(daemons * 17 + len(algorithm))
        for run in wire.runs:
            run.start()
        kept_early = 0
        while wire.queue:
            source, target, header, payload = wire.queue[shuffle.randrange(len(wire.queue))]
            if header["step"] > wire.runs[target].step:
                kept_early += 1
            wire.deliver(wire.queue.index((source, target, header, payload)))
            arrived[source, target] += len(payload) // 8
            for (src, me), wanted in total.items():
                if src != me:
                    assert wire.runs[me].needs_from(src) == (arrived[src, me] < wanted), (
                        src, me, wire.runs[me].step)
        assert kept_early > 0  # the case this test is about happened
        assert all(run.done.done() and run.done.exception() is None for run in wire.runs)

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


def feed(placement: Any, data: bytes, rng: random.Random, upto: int | None = None) -> int:
    """Write `data` (from where the placement stands) into its windows, in pieces of
    random, unaligned sizes, as a stream receiver would; stop after `upto` bytes.
    Every other piece is first offered to `absorb`, as opened records are."""
    start = len(data) - placement.remaining
    stop = len(data) if upto is None else min(len(data), start + upto)
    position = start
    while position < stop:
        if rng.random() < 0.5:
            piece = memoryview(data)[position : min(stop, position + rng.randint(1, 300_000))]
            taken = placement.absorb(piece)
            assert 0 <= taken <= piece.nbytes
            position += taken
            if taken:
                continue
        window = placement.window()
        assert 0 < window.nbytes <= placement.remaining
        count = min(window.nbytes, stop - position, rng.randint(1, 70_000))
        window[:count] = data[position : position + count]
        placement.advance(count)
        position += count
    return position - start


@pytest.mark.parametrize("algorithm", ["ring", "rhd", "tree"])
def test_slices_placed_as_they_arrive_give_the_exact_sum(algorithm: str) -> None:
    """Slices of the current step are placed (copies straight into the buffer,
    reductions chunk by chunk) and filled in odd-sized pieces, several at once,
    between ordinary deliveries: the result is exact.  The runs share one pool of
    reduce chunks: a chunk goes back only once its placement is done with it."""

    async def main() -> None:
        daemons, count = 3, 150_001  # slices of 512 KiB: reductions in several chunks
        wire = Wire()
        chunks = ChunkPool()
        buffers = [np.arange(count, dtype=np.float64) * (d + 1) + d for d in range(daemons)]
        for me, schedule in enumerate(build_schedules(algorithm, daemons, count)):
            wire.runs.append(ScheduleRun(
                schedule, buffers[me], ReduceOp.SUM, wire.sender(me), 512 * 1024,
                asyncio.get_running_loop(), chunks=chunks,
            ))
        want = sum(np.arange(count, dtype=np.float64) * (d + 1) + d for d in range(daemons))
        rng = random.Random(len(algorithm))
        for run in wire.runs:
            run.start()
        filling: list[tuple[int, int, dict[str, Any], bytes, Any]] = []
        placed = {True: 0, False: 0}
        most_at_once = 0
        while wire.queue or filling:
            if filling and (not wire.queue or rng.random() < 0.5):
                index = rng.randrange(len(filling))
                source, target, header, payload, placement = filling[index]
                feed(placement, payload, rng, upto=rng.randint(1, 300_000))
                if placement.remaining == 0:
                    filling.pop(index)
                    wire.runs[target].deliver(
                        source, header["step"], header["t"], header["off"], placement)
                continue
            source, target, header, payload = wire.queue.pop(rng.randrange(len(wire.queue)))
            placement = wire.runs[target].place(
                source, header["step"], header["t"], header["off"], len(payload))
            if placement is None:
                wire.runs[target].deliver(
                    source, header["step"], header["t"], header["off"], payload)
            else:
                placed[placement.expected.reduce] += 1
                filling.append((source, target, header, payload, placement))
                most_at_once = max(most_at_once, sum(
                    1 for *_, filled in filling if filled.expected.reduce))
        assert placed[True] > 0 and placed[False] > 0, placed
        # Reused: no more chunks made than placements ever filled at once.
        assert 0 < chunks.made <= most_at_once, (chunks.made, most_at_once, placed)
        for run, buffer in zip(wire.runs, buffers, strict=True):
            assert run.done.done() and run.done.exception() is None
            np.testing.assert_array_equal(buffer, want)

    asyncio.run(main())


def test_a_placed_slice_is_reserved_and_a_failed_run_stops_writing() -> None:
    """A slice placed once cannot be placed or delivered again; once the run
    fails, the rest of a placed payload is read and dropped, not written."""

    async def main() -> None:
        count = 40_000
        wire, buffers = make_runs("ring", 2, count, asyncio.get_running_loop())
        for run in wire.runs:
            run.start()
        source, target, header, payload = next(m for m in wire.queue if m[1] == 1)
        wire.queue.clear()
        run = wire.runs[target]
        address = (source, header["step"], header["t"], header["off"])
        placement = run.place(*address, len(payload))
        assert placement is not None
        assert run.place(*address, len(payload)) is None
        with pytest.raises(ProtocolError, match="unexpected slice"):
            run.deliver(*address, payload)
        # A range overlapping one claimed before, at another offset, is refused too:
        # accepting it would count elements twice and end the step with some missing.
        itemsize = buffers[target].itemsize
        overlapping = (source, header["step"], header["t"], header["off"] + 1)
        assert run.place(*overlapping, 4 * itemsize) is None
        with pytest.raises(ProtocolError, match="unexpected slice"):
            run.deliver(*overlapping, payload[: 4 * itemsize])
        # A slice for a step past the schedule's end is refused, not kept for later.
        with pytest.raises(ProtocolError, match="of a 2-step schedule"):
            run.deliver(source, run.steps, 0, 0, payload)
        # Misfits are left to the ordinary path, which rejects them.
        assert run.place(source, header["step"] + 1, header["t"], header["off"], 8) is None
        assert run.place(source, header["step"], header["t"], header["off"] + 1, 7) is None
        rng = random.Random(5)
        feed(placement, payload, rng, upto=len(payload) // 3)
        run.fail(CollectiveError("a peer went away"))
        before = buffers[target].copy()
        feed(placement, payload, rng)
        assert placement.remaining == 0
        np.testing.assert_array_equal(buffers[target], before)
        run.deliver(source, header["step"], header["t"], header["off"], placement)  # moot now
        with pytest.raises(CollectiveError):
            run.done.result()

    asyncio.run(main())
