"""The codec lane: compressed runs' encodes and decodes off the loop, each after
the earlier ones on its element range, on one or several threads.

Real thread pools and a real event loop; the jobs record where and in which
order they ran.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from gradsync.daemon.run.codec_lane import OFFLOAD_BYTES, CodecLane
from gradsync.protocol.errors import PeerLostError, ProtocolError

BIG = OFFLOAD_BYTES


def run_lane(body, lanes: int = 1):  # type: ignore[no-untyped-def]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="lane-test")
    try:
        return asyncio.run(asyncio.wait_for(body(pool), 10))
    finally:
        pool.shutdown(wait=True)


def test_jobs_and_follow_ups_keep_submission_order_small_ones_inline_only_when_idle() -> None:
    async def body(pool: concurrent.futures.Executor) -> None:
        loop = asyncio.get_running_loop()
        lane = CodecLane(loop, pool, loop.create_future())
        ran: list[tuple[str, int, str]] = []
        followed: list[int] = []

        def job(number: int, seconds: float) -> object:
            def work() -> int:
                time.sleep(seconds)
                ran.append(("job", number, threading.current_thread().name))
                return number
            return work

        lane.submit(job(0, 0.0), followed.append, 10)  # idle and small: inline, at once
        assert followed == [0] and ran[0][2] == threading.current_thread().name
        lane.submit(job(1, 0.05), followed.append, BIG)  # off the loop
        lane.submit(job(2, 0.0), followed.append, 10)  # small, but behind job 1: queued
        lane.submit(job(3, 0.0), followed.append, BIG)
        assert followed == [0]
        await lane.settle()
        assert [number for _, number, _ in ran] == [0, 1, 2, 3]
        assert all(thread.startswith("lane-test") for _, _, thread in ran[1:]), ran
        assert followed == [0, 1, 2, 3]
        lane.submit(job(4, 0.0), followed.append, 10)  # idle again: inline
        assert followed[-1] == 4

    run_lane(body)


def test_a_failed_follow_up_fails_the_run_and_skips_the_rest() -> None:
    async def body(pool: concurrent.futures.Executor) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        lane = CodecLane(loop, pool, done)
        followed: list[int] = []

        def send(number: int) -> None:
            if number == 1:
                raise PeerLostError("peer tcp://10.0.0.2:5555 lost", {})
            followed.append(number)

        for number in range(3):
            lane.submit(lambda number=number: number, send, BIG)
        await lane.settle()
        assert followed == [0]
        assert isinstance(lane.error, PeerLostError)
        with pytest.raises(PeerLostError, match="lost"):
            done.result()

    run_lane(body)


def test_a_job_that_is_a_bug_fails_the_run_as_a_protocol_error() -> None:
    async def body(pool: concurrent.futures.Executor) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        lane = CodecLane(loop, pool, done)

        def broken() -> None:
            raise ValueError("operands could not be broadcast")

        lane.submit(broken, lambda _: None, BIG)
        await lane.settle()
        with pytest.raises(ProtocolError, match=r"coding a slice failed.*broadcast"):
            done.result()

    run_lane(body)


def test_without_a_pool_everything_runs_inline() -> None:
    async def body(_: concurrent.futures.Executor) -> None:
        loop = asyncio.get_running_loop()
        lane = CodecLane(loop, None, loop.create_future())
        followed: list[int] = []
        lane.submit(lambda: 7, followed.append, 10 * BIG)
        assert followed == [7]
        await lane.settle()

    run_lane(body)


def test_after_the_run_failed_elsewhere_no_follow_up_runs() -> None:
    """An abort fails the run's `done` while encodes are queued: one already
    running finishes (the buffer is settled), those waiting for it skip their
    work, none is sent, and nothing submitted afterwards runs."""
    async def body(pool: concurrent.futures.Executor) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        lane = CodecLane(loop, pool, done)
        worked: list[int] = []
        sent: list[int] = []
        for number in range(3):  # all on the same elements: one after another
            lane.submit(lambda number=number: worked.append(number), sent.append, BIG, (0, 10))
        done.set_exception(PeerLostError("job aborted", {}))
        await lane.settle()
        assert worked in ([], [0]) and sent == [] and not lane.busy
        lane.submit(lambda: worked.append(3), sent.append, 10)
        assert 3 not in worked and sent == []
        done.exception()

    run_lane(body)


def test_jobs_on_overlapping_spans_keep_submission_order_disjoint_ones_run_at_once() -> None:
    """Four threads: jobs on disjoint ranges run side by side; a job whose range
    overlaps earlier ones starts only once all of those have finished, and the
    jobs on any one element run in the order they were submitted."""
    async def body(pool: concurrent.futures.Executor) -> None:
        loop = asyncio.get_running_loop()
        lane = CodecLane(loop, pool, loop.create_future())
        lock = threading.Lock()
        events: list[tuple[str, int]] = []
        running: set[int] = set()
        most = [0]
        touched: dict[int, list[int]] = {}

        def job(number: int, lo: int, hi: int, seconds: float) -> object:
            def work() -> int:
                with lock:
                    events.append(("start", number))
                    running.add(number)
                    most[0] = max(most[0], len(running))
                    for element in range(lo, hi):
                        touched.setdefault(element, []).append(number)
                time.sleep(seconds)
                with lock:
                    running.discard(number)
                    events.append(("end", number))
                return number
            return work

        spans = [(0, 10, 0.05), (10, 20, 0.05), (20, 30, 0.05),  # disjoint: together
                 (5, 15, 0.0),  # after 0 and 1
                 (14, 25, 0.01),  # after 3 (and 1, 2)
                 (0, 30, 0.0),  # after everything
                 (40, 50, 0.0)]  # free: at once
        followed: list[int] = []
        for number, (lo, hi, seconds) in enumerate(spans):
            lane.submit(job(number, lo, hi, seconds), followed.append, BIG, (lo, hi))
        await lane.settle()
        assert not lane.busy and sorted(followed) == list(range(len(spans)))
        assert most[0] >= 3, events  # the disjoint ones overlapped in time
        order = {event: index for index, event in enumerate(events)}
        for later, (lo, hi, _) in enumerate(spans):
            for earlier, (lo2, hi2, _) in enumerate(spans[:later]):
                if lo < hi2 and lo2 < hi:
                    assert order[("end", earlier)] < order[("start", later)], (earlier, later)
        for element, numbers in touched.items():
            assert numbers == sorted(numbers), (element, numbers)

    run_lane(body, lanes=4)


def test_a_failure_while_others_wait_drops_them_and_settles() -> None:
    """With several threads, a job that raises fails the run; a job waiting on its
    range skips its work, the one running elsewhere finishes, `settle` returns."""
    async def body(pool: concurrent.futures.Executor) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        lane = CodecLane(loop, pool, done)
        worked: list[int] = []

        def broken() -> None:
            time.sleep(0.02)
            raise ValueError("bad slice")

        def slow() -> None:
            time.sleep(0.05)
            worked.append(1)

        lane.submit(broken, lambda _: None, BIG, (0, 10))
        lane.submit(slow, lambda _: None, BIG, (10, 20))
        lane.submit(lambda: worked.append(2), lambda _: None, BIG, (5, 12))
        await lane.settle()
        assert worked == [1] and not lane.busy
        with pytest.raises(ProtocolError, match="bad slice"):
            done.result()

    run_lane(body, lanes=2)
