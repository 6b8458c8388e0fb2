"""The codec lane: compressed runs' encodes and decodes off the loop, in order.

A real one-thread pool and a real event loop; the jobs record where and in
which order they ran.
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


def run_lane(body):  # type: ignore[no-untyped-def]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lane-test")
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
    """An abort fails the run's `done` while encodes are queued: they finish (the
    buffer is settled) but none is sent."""
    async def body(pool: concurrent.futures.Executor) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        lane = CodecLane(loop, pool, done)
        worked: list[int] = []
        sent: list[int] = []
        for number in range(3):
            lane.submit(lambda number=number: worked.append(number), sent.append, BIG)
        done.set_exception(PeerLostError("job aborted", {}))
        await lane.settle()
        assert worked == [0, 1, 2] and sent == [] and not lane.busy
        done.exception()

    run_lane(body)
