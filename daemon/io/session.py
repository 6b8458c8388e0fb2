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
import os
import socket
import struct
from typing import TYPE_CHECKING, cast

from gradsync.protocol import messages
from gradsync.protocol.codec import FrameReader, Message, encode_frame
from gradsync.protocol.errors import GradsyncError, ProtocolError, VersionMismatchError

if TYPE_CHECKING:
    from gradsync.daemon.io.service import GradsyncService

log = logging.getLogger("gradsync.daemon.session")

_session_ids = itertools.count(1)
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


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
        self.peer_pidfd: int | None = None
        #: The client's pid as the kernel reports it (SO_PEERCRED), not as it claims.
        self.peer_pid: int | None = None
        #: The client's user id (SO_PEERCRED).
        self.peer_uid: int | None = None

    def describe(self) -> str:
        if self.job_name is None:
            return f"session {self.session_id}"
        return f"rank {self.rank} (pid {self.pid}) of job {self.job_name!r}"

    # -- asyncio.Protocol ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.service.session_opened(self)
        self._watch_peer_process()

    def _watch_peer_process(self) -> None:
        """Notice the client process exiting even if a forked child keeps its socket open.

        End-of-file is the usual death notice; a pidfd of the peer (from
        SO_PEERCRED) covers the case where a child inherited the connection.
        """
        assert self.transport is not None
        sock = self.transport.get_extra_info("socket")
        if sock is None or not hasattr(os, "pidfd_open"):
            return
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
            pid, uid, _ = _CREDS.unpack(creds)
            self.peer_pid = pid
            self.peer_uid = uid
            self.peer_pidfd = os.pidfd_open(pid)
        except OSError:
            return
        asyncio.get_running_loop().add_reader(self.peer_pidfd, self._peer_exited)

    def _peer_exited(self) -> None:
        self._stop_watching()
        if self.transport is not None:
            log.debug("%s: client process exited", self.describe())
            self.transport.abort()

    def _stop_watching(self) -> None:
        if self.peer_pidfd is not None:
            asyncio.get_running_loop().remove_reader(self.peer_pidfd)
            os.close(self.peer_pidfd)
            self.peer_pidfd = None

    def data_received(self, data: bytes) -> None:
        try:
            bodies = self.reader.feed(data)
        except ProtocolError as exc:
            # The length prefix is garbage: the stream cannot be resynchronised.
            self.service.state.requests.malformed += 1
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
            self.service.state.requests.malformed += 1
            self.reply_error(-1, exc)
            log.warning("%s: %s", self.describe(), exc.message)
            self.close()
            return
        except ProtocolError as exc:
            self.service.state.requests.malformed += 1
            self.reply_error(-1, exc)
            log.debug("%s sent a bad message: %s", self.describe(), exc.message)
            return
        self.outstanding.add(message["id"])
        self.service.handle(self, message)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_watching()
        self.transport = None
        self.service.session_closed(self)

    # -- replies ------------------------------------------------------------

    def reply(self, message: Message) -> None:
        self.outstanding.discard(message["id"])
        if self.transport is None or self.transport.is_closing():
            return
        try:
            frame = encode_frame(message)
        except (ProtocolError, OverflowError, ValueError, TypeError) as exc:
            # Details echoing huge or exotic values: answer without them.
            log.warning("reply to %s did not encode (%s); sending it without details",
                        self.describe(), exc)
            frame = encode_frame(messages.error_reply(
                message["id"], str(message.get("code", "error")),
                str(message.get("message", "reply could not be encoded"))[:1024], {},
            ))
        self.transport.write(frame)

    def reply_error(self, request_id: int, error: GradsyncError) -> None:
        self.reply(messages.error_reply(request_id, error.code, error.message, error.details))

    def complete(
        self, request_id: int, error: GradsyncError | None, timing: dict[str, float] | None = None
    ) -> None:
        """Answer a collective once; later answers for the same id are dropped.

        `timing` (seconds of CLOCK_MONOTONIC, comparable across processes of this
        machine) lets a client see when its collective really ran.
        """
        if request_id not in self.outstanding:
            return
        if error is None:
            self.reply(messages.ok_reply(request_id, **({"timing": timing} if timing else {})))
        else:
            self.reply_error(request_id, error)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
