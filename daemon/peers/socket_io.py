"""A ZeroMQ socket driven directly by the event loop: no future per message.

`zmq.asyncio` creates a future, registers events and schedules callbacks for
every send and receive; on the peer links, where a collective moves dozens of
slices of a MiB or two per operation and the daemon's CPU is the bottleneck,
that bookkeeping cost as much as the reduction itself.  `LoopSocket` keeps the
socket's blocking API, always with `NOBLOCK`: a reader callback on the
socket's file descriptor drains every message that is ready and hands each to
a plain callback, and a send goes out at once unless ZeroMQ's queue is full,
in which case it waits, in order, in a backlog that is flushed when the
socket signals again.

ZeroMQ's descriptor is edge-like: it signals that the socket's state *may*
have changed, and any send, receive or `EVENTS` query consumes the signal.
So after each send we query `EVENTS` and, if messages are waiting, schedule a
drain ourselves; a drain that stops early (to let other callbacks run) also
schedules the next one.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger("gradsync.daemon.peers")

#: Messages handled per drain before other callbacks get a turn.
DRAIN_BATCH = 64


class LoopSocket:
    """One blocking-API ZeroMQ socket, read and written from the event loop."""

    def __init__(
        self,
        sock: zmq.Socket[Any],
        loop: asyncio.AbstractEventLoop,
        on_frames: Callable[[list[zmq.Frame]], None],
        name: str,
    ) -> None:
        self.sock = sock
        self.name = name
        self._loop = loop
        self._on_frames = on_frames
        self._fd = int(sock.getsockopt(zmq.FD))
        self._backlog: collections.deque[tuple[list[Any], bool, asyncio.Future[Any]]] = (
            collections.deque()
        )
        self._scheduled = False
        self._closed = False
        loop.add_reader(self._fd, self._service)
        # A fresh pipe counts its reader as awake, so the first messages raise no
        # signal: look once now (and the drain keeps looking while it finds any).
        self._schedule()

    @property
    def backlog(self) -> int:
        """Messages waiting for room in ZeroMQ's queue."""
        return len(self._backlog)

    # -- sending --------------------------------------------------------------

    def send(self, frames: list[Any], track: bool = False) -> asyncio.Future[Any]:
        """Queue a message, in order with every earlier one; never blocks.

        The future is done once ZeroMQ took the message: its result is the
        `MessageTracker` of the last frame when `track` is set, else None.
        """
        sending: asyncio.Future[Any] = self._loop.create_future()
        if self._closed:
            sending.set_exception(zmq.ZMQError(zmq.ENOTSOCK, "socket closed"))
            return sending
        if not self._backlog and self._send_now(frames, track, sending):
            return sending
        self._backlog.append((frames, track, sending))
        self._recheck()
        return sending

    def try_send(self, frames: list[Any]) -> bool:
        """Send at once if there is room and nothing is waiting; else drop it."""
        if self._closed or self._backlog:
            return False
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            return False
        finally:
            self._recheck()
        return True

    def _send_now(self, frames: list[Any], track: bool, sending: asyncio.Future[Any]) -> bool:
        """Try one send; False if ZeroMQ's queue is full (the message is not sent)."""
        try:
            tracker = self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False, track=track)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            sending.set_exception(exc)
        else:
            sending.set_result(tracker)
        self._recheck()
        return True

    def _recheck(self) -> None:
        """A send or receive consumes the descriptor's signal: look at the state ourselves."""
        try:
            events = int(self.sock.getsockopt(zmq.EVENTS))
        except zmq.ZMQError:
            return
        if events & zmq.POLLIN or (self._backlog and events & zmq.POLLOUT):
            self._schedule()

    def fail_backlog(self, error: Exception) -> None:
        """Give up on every waiting message (the connection is gone)."""
        while self._backlog:
            _, _, sending = self._backlog.popleft()
            if not sending.done():
                sending.set_exception(error)
                sending.exception()  # retrieved: nobody may be waiting

    def _flush(self) -> None:
        while self._backlog:
            frames, track, sending = self._backlog[0]
            if sending.cancelled():
                self._backlog.popleft()
                continue
            if not self._send_now(frames, track, sending):
                return
            self._backlog.popleft()

    # -- receiving ------------------------------------------------------------

    def _schedule(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self._loop.call_soon(self._service)

    def _service(self) -> None:
        """Flush the backlog, then drain up to `DRAIN_BATCH` received messages."""
        self._scheduled = False
        if self._closed:
            return
        self._flush()
        for _ in range(DRAIN_BATCH):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            except zmq.ZMQError as exc:
                log.warning("receiving on %s failed: %s", self.name, exc)
                return
            try:
                self._on_frames(frames)
            except Exception:
                log.exception("handling a message received on %s failed", self.name)
            if self._closed:
                return
        else:
            self._schedule()  # more may be waiting; let other callbacks run first
            return
        if self._backlog:
            self._recheck()  # the receive may have swallowed a "writable again" signal

    # -- end ------------------------------------------------------------------

    def close(self, error: Exception) -> None:
        """Stop reading, fail waiting sends with `error`, close the socket (linger 0)."""
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._fd)
        self.fail_backlog(error)
        self.sock.close(linger=0)
