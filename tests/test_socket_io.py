"""LoopSocket: ZeroMQ sockets driven by the event loop, over real sockets.

High-water marks of one message force the backlog path; the tests check that
nothing is lost or reordered, and that waiting sends fail cleanly when the
socket closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pytest
import zmq
from cluster import free_ports

from gradsync.daemon.peers.socket_io import DRAIN_BATCH, LoopSocket
from gradsync.protocol.errors import DaemonShuttingDownError

pytestmark = pytest.mark.timeout(30)

T = TypeVar("T")


def run(coro: Awaitable[T], timeout_s: float = 20.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


@contextlib.asynccontextmanager
async def looped_pair(
    hwm: int, on_receive: Callable[[list[zmq.Frame]], None]
) -> AsyncIterator[LoopSocket]:
    """A sender LoopSocket connected over TCP to a receiving one; tiny queues on both."""
    loop = asyncio.get_running_loop()
    context: zmq.Context[Any] = zmq.Context()
    a, b = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    for sock in (a, b):
        sock.linger = 0
        sock.sndhwm = sock.rcvhwm = hwm
        sock.setsockopt(zmq.SNDBUF, 4096)
        sock.setsockopt(zmq.RCVBUF, 4096)
    port = a.bind_to_random_port("tcp://127.0.0.1")
    b.connect(f"tcp://127.0.0.1:{port}")
    sender = LoopSocket(a, loop, lambda frames: None, "sender")
    receiver = LoopSocket(b, loop, on_receive, "receiver")
    try:
        yield sender
    finally:
        sender.close(DaemonShuttingDownError("closed"))
        receiver.close(DaemonShuttingDownError("closed"))
        context.destroy(linger=0)


async def wait_for_count(items: list[Any], count: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(items) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


def test_sends_beyond_the_high_water_mark_wait_in_order_and_all_arrive() -> None:
    async def main() -> None:
        received: list[bytes] = []
        async with looped_pair(1, lambda frames: received.append(frames[1].bytes)) as sender:
            count, payload = 300, bytes(64 * 1024)
            sends = [sender.send([str(i).encode(), payload]) for i in range(count)]
            assert sender.backlog > 0  # the queue filled: the rest waited
            await asyncio.wait_for(asyncio.gather(*sends), 10)
            await wait_for_count(received, count)
            assert received == [payload] * count
            assert sender.backlog == 0

    run(main())


def test_messages_arrive_in_send_order() -> None:
    async def main() -> None:
        order: list[int] = []
        async with looped_pair(2, lambda frames: order.append(int(frames[0].bytes))) as sender:
            count = 3 * DRAIN_BATCH + 5  # several drains, each cut at DRAIN_BATCH
            await asyncio.gather(*(sender.send([str(i).encode()]) for i in range(count)))
            await wait_for_count(order, count)
            assert order == list(range(count))

    run(main())


def test_closing_fails_waiting_sends_and_refuses_new_ones() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        context: zmq.Context[Any] = zmq.Context()
        a = context.socket(zmq.DEALER)
        a.linger = 0
        a.sndhwm = 1
        a.setsockopt(zmq.IMMEDIATE, 1)
        a.connect(f"tcp://127.0.0.1:{free_ports(1)[0]}")  # nobody listens: nothing can leave
        sender = LoopSocket(a, loop, lambda frames: None, "sender")
        try:
            waiting = sender.send([b"never sent"])
            assert not waiting.done() and sender.backlog == 1
            assert not sender.try_send([b"dropped"])  # a probe never waits
            sender.close(DaemonShuttingDownError("closed"))
            with pytest.raises(DaemonShuttingDownError):
                await waiting
            with pytest.raises(zmq.ZMQError):
                await sender.send([b"after close"])
        finally:
            context.destroy(linger=0)

    run(main())
