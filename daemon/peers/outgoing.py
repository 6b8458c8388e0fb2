"""Sending on the peer links: framing a message, and waiting for it to leave.

A message is framed once (`MessageFramer`): its header encoded with this
daemon's endpoint as `src`, its payloads as memoryviews (never copied),
checked against the limits a peer enforces.  On the ZeroMQ link it then goes
out at once on the link's DEALER or waits, in order, in the DEALER's backlog
while ZeroMQ's queue is full (`socket_io.py`): `send_frames` waits for that
(and, if asked, for ZeroMQ to let go of the buffers) and gives up when the
link goes down meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NoReturn

from gradsync.daemon.peers.health import Link
from gradsync.daemon.peers.wire import MAX_PAYLOAD_FRAMES, encode_header
from gradsync.protocol.errors import DaemonShuttingDownError, InvalidArgumentError, PeerLostError

#: Anything exporting a C-contiguous buffer: bytes, memoryview, a numpy array.
Payload = Any


class MessageFramer:
    """Turns a header and payloads into the frames of one peer message."""

    def __init__(self, endpoint: str, kinds: Collection[str], max_payload_bytes: int) -> None:
        """`endpoint` goes in as `src`; `kinds` are the application kinds declared."""
        self._endpoint = endpoint
        self._kinds = kinds
        self._max_payload_bytes = max_payload_bytes

    def frames(self, header: Mapping[str, Any], payloads: Sequence[Payload]) -> list[Any]:
        """`[header, payload views...]`; raises `InvalidArgumentError` past a limit."""
        kind = header.get("kind")
        if kind not in self._kinds:
            raise InvalidArgumentError(f"message kind {kind!r} was not declared in `kinds`")
        frames: list[Any] = [encode_header(self._endpoint, header)]
        for index, payload in enumerate(payloads):
            view = memoryview(payload)
            if not view.c_contiguous:
                raise InvalidArgumentError(f"payload {index} is not C-contiguous")
            if view.nbytes > self._max_payload_bytes:
                raise InvalidArgumentError(
                    f"payload {index} is {view.nbytes} bytes, above max_payload_bytes "
                    f"({self._max_payload_bytes}); cut it into slices"
                )
            frames.append(view)
        if len(frames) - 1 > MAX_PAYLOAD_FRAMES:
            raise InvalidArgumentError(f"more than {MAX_PAYLOAD_FRAMES} payload frames")
        return frames


async def send_frames(link: Link, frames: list[Any], wait_sent: bool, closed: bool) -> None:
    """Queue a message on the link's DEALER; give up if the link goes down.

    `closed`: the links are closing (`DaemonShuttingDownError`).
    """
    if closed:
        raise DaemonShuttingDownError("peer links are closed")
    down = link.down
    if link.state != "up" or down is None or down.done() or link.dealer is None:
        raise PeerLostError(
            f"peer {link.name} is {link.state}", {"peer": link.name, "state": link.state}
        )
    # Already done when the message fit in the queue at once: the common case.
    sending = link.dealer.send(frames, wait_sent)
    if not sending.done():
        await asyncio.wait((sending, down), return_when=asyncio.FIRST_COMPLETED)
        if not sending.done():
            sending.cancel()
            raise_down(link, down)
    tracker = sending.result()
    if wait_sent and tracker is not None:
        delay = 0.0
        while not tracker.done:
            await asyncio.sleep(delay)
            delay = min(max(2 * delay, 50e-6), 2e-3)
        if down.done():
            raise_down(link, down)


def raise_down(link: Link, down: asyncio.Future[None]) -> NoReturn:
    """Raise why a send to the link's peer failed: the links closed, or the peer lost."""
    exc = down.exception() if down.done() and not down.cancelled() else None
    if isinstance(exc, DaemonShuttingDownError):
        raise DaemonShuttingDownError(exc.message)
    raise PeerLostError(
        f"peer {link.name} was lost while sending to it",
        {"peer": link.name, "state": link.state},
    )
