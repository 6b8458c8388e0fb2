"""ZAP handler: decides which CURVE clients may connect to the peer ROUTER.

libzmq asks the handler bound at `inproc://zeromq.zap.01` of the socket's
context about every CURVE handshake (RFC 27).  Only keys of the authorised set
pass; everything else is refused before a single message reaches our code, and
counted.  The accepted key becomes the connection's User-Id, which the links
read back from each message to learn which peer really sent it.

Each `PeerLinks` owns its own zmq context, so several can run in one process
(tests) without fighting over the inproc endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils import z85

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_VERSION = b"1.0"

log = logging.getLogger("gradsync.daemon.peers")


class ZapHandler:
    """Answers ZAP requests from an asyncio task: CURVE with an authorised key, or no."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        authorized: set[bytes],
        on_reject: Callable[[str, str], None],
    ) -> None:
        """`authorized` holds Z85 public keys; `on_reject(address, reason)` counts refusals."""
        self._authorized = {z85.decode(key) for key in authorized}
        self._on_reject = on_reject
        self._socket = context.socket(zmq.REP)
        self._socket.linger = 0
        self._socket.bind(ZAP_ENDPOINT)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve(), name="zap")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._socket.close(linger=0)

    def decide(self, request: list[bytes]) -> list[bytes]:
        """The reply frames for one ZAP request."""
        request_id = request[1] if len(request) > 1 else b""
        if len(request) < 6 or request[0] != _ZAP_VERSION:
            return self._refuse(request_id, b"400", "malformed ZAP request", "?")
        address = request[3].decode("utf-8", errors="replace")
        mechanism, credentials = request[5], request[6:]
        if mechanism != b"CURVE" or len(credentials) != 1:
            return self._refuse(request_id, b"400", f"mechanism {mechanism!r} refused", address)
        key = credentials[0]
        if key not in self._authorized:
            text = z85.encode(key).decode("ascii") if len(key) == 32 else "?"
            return self._refuse(request_id, b"400", f"key {text} not authorized", address)
        return [_ZAP_VERSION, request_id, b"200", b"OK", z85.encode(key), b""]

    def _refuse(self, request_id: bytes, status: bytes, reason: str, address: str) -> list[bytes]:
        self._on_reject(address, reason)
        return [_ZAP_VERSION, request_id, status, reason.encode(), b"", b""]

    async def _serve(self) -> None:
        while True:
            request = await self._socket.recv_multipart()
            await self._socket.send_multipart(self.decide(request))
