"""The client's socket to its local daemon: requests out, replies matched by id.

There is no reader thread.  Whichever caller waits reads the socket and files
every reply it finds under its request id (a leader/follower scheme); other
waiting threads sleep on a condition until their reply is filed.  This keeps a
small collective at one socket round trip with no thread hand-off.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from gradsync.protocol import messages
from gradsync.protocol.codec import FrameReader, Message, encode_frame
from gradsync.protocol.endpoint import parse_ipc_endpoint
from gradsync.protocol.errors import (
    DaemonLostError,
    DaemonUnavailableError,
    GradsyncError,
    ProtocolError,
    error_from_wire,
)

_RECV_BYTES = 64 * 1024

#: Connections of this process; a forked child closes its copies (see below).
_OPEN_CONNECTIONS: weakref.WeakSet[Connection] = weakref.WeakSet()


def _close_in_child() -> None:
    """A forked child (a DataLoader worker, say) must not keep the parent's socket.

    Otherwise the daemon would not see end-of-file when the parent dies.  The
    child only closes its own descriptor; the parent's connection is untouched.
    """
    for connection in list(_OPEN_CONNECTIONS):
        connection.forget_after_fork()


os.register_at_fork(after_in_child=_close_in_child)


class Connection:
    """A framed request/reply channel to one daemon; safe to share across threads."""

    def __init__(self, endpoint: str, connect_timeout_s: float = 10.0) -> None:
        self.endpoint = endpoint
        try:
            path = parse_ipc_endpoint(endpoint)
        except ValueError as exc:
            raise DaemonUnavailableError(str(exc), {"endpoint": endpoint}) from None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(connect_timeout_s)
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            reason = exc.strerror or type(exc).__name__
            raise DaemonUnavailableError(
                f"no gradsync daemon answers at {endpoint} ({reason}); start one with "
                f"`gradsyncd --socket {endpoint}` or run under `gradsync launch`",
                {"endpoint": endpoint},
            ) from None
        self._sock.settimeout(None)
        self._poller = select.poll()
        self._poller.register(self._sock, select.POLLIN)
        #: A second poller for `daemon_gone` (one poll object must not be polled by
        #: two threads at once, and the reader may be polling the first).
        self._watch = select.poll()
        self._watch.register(self._sock, select.POLLIN)
        _OPEN_CONNECTIONS.add(self)
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._replies: dict[int, Message] = {}
        self._expected: set[int] = set()
        self._reading = False
        self._reader = FrameReader()
        self._dead: GradsyncError | None = None

    # -- sending ------------------------------------------------------------

    def send(self, kind: str, expect_reply: bool = True, **fields: Any) -> int:
        """Send one request; returns its id to wait on."""
        return self.send_message(
            lambda request_id: messages.request(kind, request_id, **fields), expect_reply)

    def send_message(self, build: Callable[[int], Message], expect_reply: bool = True) -> int:
        """Send the request `build(id)` makes for its id (a typed request's
        `to_wire`); returns the id to wait on."""
        with self._send_lock:
            request_id = next(self._ids)
            frame = encode_frame(build(request_id))
            with self._cond:
                if self._dead is not None:
                    raise self._dead
                if expect_reply:
                    self._expected.add(request_id)
            try:
                self._sock.sendall(frame)
            except OSError as exc:
                raise self._fail(
                    f"lost the connection to the gradsync daemon at {self.endpoint} "
                    f"while sending ({exc.strerror or exc})"
                ) from None
        return request_id

    def call(self, kind: str, timeout_s: float | None = None, **fields: Any) -> Message:
        """Send a request and wait for its reply; raise the daemon's error if any."""
        request_id = self.send(kind, **fields)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        reply = self.wait(request_id, deadline)
        if reply is None:
            raise DaemonUnavailableError(
                f"the gradsync daemon at {self.endpoint} did not answer {kind!r} "
                f"within {timeout_s}s",
                {"endpoint": self.endpoint},
            )
        raise_for_error(reply)
        return reply

    def daemon_gone(self) -> bool:
        """Whether the daemon closed this connection: a poll and a peek, no wait."""
        if self._dead is not None:
            return True
        try:
            if not self._watch.poll(0):
                return False
            data = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return not data

    # -- receiving ----------------------------------------------------------

    def wait(self, request_id: int, deadline: float | None) -> Message | None:
        """The reply to `request_id`, or None once `deadline` (monotonic) passes."""
        return self._await(request_id, deadline, block=True)

    def poll(self, request_id: int) -> Message | None:
        """The reply to `request_id` if it has arrived; never blocks for long."""
        return self._await(request_id, None, block=False)

    def _await(self, request_id: int, deadline: float | None, block: bool) -> Message | None:
        with self._cond:
            while True:
                reply = self._replies.pop(request_id, None)
                if reply is not None:
                    self._expected.discard(request_id)
                    return reply
                if self._dead is not None:
                    raise self._dead
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                if self._reading:
                    if not block:
                        return None
                    self._cond.wait(remaining)
                    continue
                self._reading = True
                self._cond.release()
                try:
                    bodies = self._read(remaining if block else 0.0)
                except GradsyncError:
                    bodies = []
                finally:
                    self._cond.acquire()
                    self._reading = False
                    self._cond.notify_all()
                self._file(bodies)
                if not block:
                    reply = self._replies.pop(request_id, None)
                    if reply is not None:
                        self._expected.discard(request_id)
                        return reply
                    if self._dead is not None:
                        raise self._dead
                    return None

    def _read(self, timeout: float | None) -> list[bytes]:
        """Read what the socket has (waiting up to `timeout`); return whole frames."""
        try:
            # The socket stays blocking (senders on other threads rely on it); the
            # wait for readability is a poll with its own timeout.
            if not self._poller.poll(None if timeout is None else max(0, int(timeout * 1000))):
                return []
            data = self._sock.recv(_RECV_BYTES, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return []
        except OSError as exc:
            raise self._fail(
                f"lost the connection to the gradsync daemon at {self.endpoint} "
                f"({exc.strerror or exc})"
            ) from None
        if not data:
            raise self._fail(
                f"the gradsync daemon at {self.endpoint} closed the connection "
                "(it stopped or was killed)"
            )
        try:
            bodies: list[bytes] = self._reader.feed(data)
            return bodies
        except ProtocolError as exc:
            raise self._fail(f"the daemon at {self.endpoint} sent garbage: {exc}") from None

    def _file(self, bodies: list[bytes]) -> None:
        """File decoded replies under their ids (caller holds the condition)."""
        for body in bodies:
            try:
                reply = messages.decode_reply(body)
            except ProtocolError as exc:
                self._mark_dead(exc)
                continue
            reply_id = reply["id"]
            if reply_id == -1 and reply["kind"] == "error":
                # The daemon could not tie its answer to a request: the session is unusable.
                self._mark_dead(_as_error(reply))
            elif reply_id in self._expected:
                self._replies[reply_id] = reply

    @property
    def lost(self) -> DaemonLostError | None:
        """The error that ended the session if the daemon went away (not a close).

        Probes the socket (a poll and a peek, no wait), so a daemon that closed the
        connection while nothing was in flight counts as lost at once.
        """
        if self._dead is None and self.daemon_gone():
            self._fail(f"the gradsync daemon at {self.endpoint} closed the connection "
                       "(it stopped, crashed or restarted)")
        dead = self._dead
        return dead if isinstance(dead, DaemonLostError) else None

    def _fail(self, message: str) -> GradsyncError:
        error = DaemonLostError(message, {"endpoint": self.endpoint})
        with self._cond:
            self._mark_dead(error)
        return self._dead or error

    def _mark_dead(self, error: GradsyncError) -> None:
        if self._dead is None:
            self._dead = error
        self._cond.notify_all()

    def forget_after_fork(self) -> None:
        """In a forked child: drop the inherited socket without telling the daemon."""
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._dead = DaemonUnavailableError(
            "this gradsync connection belongs to the parent process (it was forked)",
            {"endpoint": self.endpoint},
        )
        with contextlib.suppress(OSError):
            self._sock.close()

    def close(self, reason: str = "the client was closed") -> None:
        with self._cond:
            self._mark_dead(DaemonUnavailableError(reason, {"endpoint": self.endpoint}))
        # shutdown() wakes a reader blocked in poll() on another thread (close()
        # alone does not), so an abort ends every waiting Work at once.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()


def _as_error(reply: Message) -> GradsyncError:
    return error_from_wire(reply["code"], reply["message"], reply.get("details") or {})


def raise_for_error(reply: Message) -> None:
    """Raise the exception an error reply carries; do nothing for success."""
    if reply["kind"] == "error":
        raise _as_error(reply)
