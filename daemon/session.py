"""One client connection: framing, decoding, replies.

An `asyncio.Protocol` on a Unix stream socket.  Measured on this machine a
64-byte round trip through a uvloop stream server costs about 21 µs (p50)
against about 80 µs through a ZeroMQ ROUTER, and small collectives are bound
by exactly this path, so the client endpoint is a plain Unix socket.
End-of-file on it is also the fastest possible notice that a client died.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import TYPE_CHECKING, cast

from gradsync.protocol import messages
from gradsync.protocol.codec import FrameReader, Message, encode_frame
from gradsync.protocol.errors import GradsyncError, ProtocolError, VersionMismatchError

if TYPE_CHECKING:
    from gradsync.daemon.service import GradsyncService

log = logging.getLogger("gradsync.daemon.session")

_session_ids = itertools.count(1)


class ClientSession(asyncio.Protocol):
    """Protocol instance for one connected client."""

    def __init__(self, service: GradsyncService) -> None:
        self.service = service
        self.session_id = next(_session_ids)
        self.transport: asyncio.Transport | None = None
        self.reader = FrameReader()
        self.job_name: str | None = None
        self.rank: int | None = None
        self.pid: int | None = None
        self.segments: set[int] = set()
        self.outstanding: set[int] = set()
        self.closed_cleanly = False

    def describe(self) -> str:
        if self.job_name is None:
            return f"session {self.session_id}"
        return f"rank {self.rank} (pid {self.pid}) of job {self.job_name!r}"

    # -- asyncio.Protocol ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.service.session_opened(self)

    def data_received(self, data: bytes) -> None:
        try:
            bodies = self.reader.feed(data)
        except ProtocolError as exc:
            # The length prefix is garbage: the stream cannot be resynchronised.
            self.service.counters["malformed"] += 1
            self.reply_error(-1, exc)
            log.warning("%s sent an unframeable stream (%s); closing it", self.describe(), exc)
            self.close()
            return
        for body in bodies:
            self._handle_body(body)

    def _handle_body(self, body: bytes) -> None:
        try:
            message = messages.decode_request(body)
        except VersionMismatchError as exc:
            self.service.counters["malformed"] += 1
            self.reply_error(-1, exc)
            log.warning("%s: %s", self.describe(), exc.message)
            self.close()
            return
        except ProtocolError as exc:
            self.service.counters["malformed"] += 1
            self.reply_error(-1, exc)
            log.debug("%s sent a bad message: %s", self.describe(), exc.message)
            return
        self.outstanding.add(message["id"])
        self.service.handle(self, message)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.service.session_closed(self)

    # -- replies ------------------------------------------------------------

    def reply(self, message: Message) -> None:
        self.outstanding.discard(message["id"])
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode_frame(message))

    def reply_error(self, request_id: int, error: GradsyncError) -> None:
        self.reply(messages.error_reply(request_id, error.code, error.message, error.details))

    def complete(self, request_id: int, error: GradsyncError | None) -> None:
        """Answer a collective once; later answers for the same id are dropped."""
        if request_id not in self.outstanding:
            return
        if error is None:
            self.reply(messages.ok_reply(request_id))
        else:
            self.reply_error(request_id, error)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
