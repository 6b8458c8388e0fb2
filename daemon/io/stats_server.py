"""The read-only statistics endpoint: REQ/REP snapshots and a PUB stream.

Requests arrive on a ROUTER (REQ clients see plain REQ/REP), so a `trace`
request records in the background while `stats` requests are still answered.

`--stats ipc://PATH` (default: the client socket's path + `.stats`) answers a
msgpack request `{"v": PROTOCOL_VERSION, "kind": "stats"}` with one snapshot and anything
else with an error; PATH + `.pub` (for `tcp://HOST:PORT`: the next port)
publishes a snapshot every second for `gradsync top`.  Nothing received here
can change the daemon.

An `ipc://` endpoint is guarded by its file mode.  A `tcp://` endpoint is
reachable from the network, so it sits behind the daemon's CURVE keys (the
same `curve_secret` and `curve_authorized` as the peer links): only a reader
whose public key is in the authorised folder gets an answer, others are
refused by a ZAP handler and counted (`stats_rejected_keys`).  Without keys a
`tcp://` endpoint needs `--insecure`, and the daemon says so in its log.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

import msgpack
import zmq
import zmq.asyncio

from gradsync.daemon.config import ConfigError, DaemonConfig
from gradsync.daemon.peers.keys import load_authorized, load_secret
from gradsync.daemon.peers.zap import ZapHandler
from gradsync.protocol import messages
from gradsync.protocol.codec import MAX_FRAME_BYTES, decode_body, is_number
from gradsync.protocol.endpoint import MAX_SOCKET_PATH, stats_stream_endpoint
from gradsync.protocol.errors import ProtocolError

if TYPE_CHECKING:
    from gradsync.daemon.io.service import GradsyncService

log = logging.getLogger("gradsync.daemon.stats")

PUBLISH_INTERVAL_S = 1.0
MAX_TRACE_S = 600.0
#: Messages queued per connection: requests waiting for an answer, and replies or
#: snapshots a slow reader has not taken yet (the PUB drops new ones beyond it).
_RECEIVE_QUEUE = 64
#: `gradsync top` subscribes to everything (an empty prefix).  libzmq keeps
#: subscriptions in a trie it walks recursively, one level per byte: a long one
#: would be a deep recursion in the daemon.
_MAX_SUBSCRIPTION_BYTES = 1024
_SEND_QUEUE = 16


def stats_endpoints(stats: str | None, socket_endpoint: str) -> tuple[str, str] | None:
    """(request endpoint, PUB endpoint), or None when the default path would be too long."""
    base = stats or socket_endpoint + ".stats"
    if base.startswith("ipc://") and len(base) - len("ipc://") + len(".pub") > MAX_SOCKET_PATH:
        return None
    return base, stats_stream_endpoint(base)


_ZAP_DOMAIN = b"gradsync-stats"


@dataclasses.dataclass(frozen=True)
class StatsCurve:
    """The keys a `tcp://` stats endpoint serves with: ours, and who may read."""

    public_key: bytes
    secret_key: bytes
    authorized: frozenset[bytes]


def stats_curve(config: DaemonConfig, endpoint: str) -> StatsCurve | None:
    """The CURVE keys for `endpoint`; None for `ipc://` or an `--insecure` daemon.

    Raises ConfigError when a `tcp://` endpoint would otherwise be open to anyone.
    """
    if not endpoint.startswith("tcp://"):
        return None
    if config.curve_secret and config.curve_authorized:
        if config.insecure:
            raise ConfigError("pass either CURVE keys or --insecure, not both")
        secret = load_secret(config.curve_secret)
        assert secret.secret_key is not None  # load_secret guarantees it
        return StatsCurve(secret.public_key, secret.secret_key,
                          frozenset(load_authorized(config.curve_authorized)))
    if config.insecure:
        return None
    raise ConfigError(
        f"the stats endpoint {endpoint} is reachable over the network: pass --curve-secret "
        "FILE and --curve-authorized DIR (readers need a key in DIR), or --insecure"
    )


class StatsServer:
    """Serves snapshots of `service` (and its peer links, if any)."""

    def __init__(
        self, endpoints: tuple[str, str], service: GradsyncService, links: Any,
        curve: StatsCurve | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.service = service
        self.links = links
        self.curve = curve
        self._context = zmq.asyncio.Context()
        self._zap: ZapHandler | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._tracing: asyncio.Task[None] | None = None

    def snapshot(self) -> dict[str, Any]:
        return self.service.stats.snapshot(self.service, self.links)

    async def start(self, group_access: bool) -> None:
        self._rep = self._context.socket(zmq.ROUTER)
        self._pub = self._context.socket(zmq.PUB)
        for sock in (self._rep, self._pub):
            sock.setsockopt(zmq.LINGER, 0)
            # Requests and subscriptions are a few bytes: a bigger frame drops the
            # connection, and bounded queues keep a flood from piling up in memory.
            sock.setsockopt(zmq.MAXMSGSIZE,
                            MAX_FRAME_BYTES if sock is self._rep else _MAX_SUBSCRIPTION_BYTES)
            sock.setsockopt(zmq.RCVHWM, _RECEIVE_QUEUE)
            sock.setsockopt(zmq.SNDHWM, _SEND_QUEUE)
            if self.curve is not None:
                sock.curve_server = True
                sock.curve_publickey = self.curve.public_key
                sock.curve_secretkey = self.curve.secret_key
                sock.zap_domain = _ZAP_DOMAIN
        if self.curve is not None:
            self._zap = ZapHandler(self._context, set(self.curve.authorized), self._rejected)
            self._zap.start()
        elif self.endpoints[0].startswith("tcp://"):
            log.warning("statistics at %s are INSECURE: anyone who can reach the port can "
                        "read them (--insecure)", self.endpoints[0])
        old_umask = os.umask(0o117 if group_access else 0o177)
        try:
            self._rep.bind(self.endpoints[0])
            self._pub.bind(self.endpoints[1])
        finally:
            os.umask(old_umask)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._serve()), loop.create_task(self._publish())]
        log.info("statistics at %s (requests) and %s (stream)", *self.endpoints)

    def _rejected(self, address: str, reason: str) -> None:
        self.service.state.stats_endpoint.stats_rejected_keys += 1
        log.warning("refused a statistics reader from %s: %s", address, reason)

    async def _serve(self) -> None:
        """Answer REQ clients through a ROUTER, so a trace does not hold up the others."""
        while True:
            frames = await self._receive_envelope()
            if len(frames) != 3 or frames[1] != b"":
                self.service.state.stats_endpoint.malformed += 1
                continue  # not a REQ envelope: nothing sensible to answer
            route, body = frames[0], frames[2]
            try:
                request = messages.check_header(decode_body(body))
                if request["kind"] == "stats":
                    reply = messages.ok_reply(request["id"], snapshot=self.snapshot())
                elif request["kind"] == "trace":
                    self._start_trace(route, request)
                    continue
                else:
                    raise ProtocolError(
                        f"the stats endpoint is read-only: it answers 'stats' and 'trace', "
                        f"not {messages.clip(request['kind'])}"
                    )
            except ProtocolError as exc:
                self.service.state.stats_endpoint.malformed += 1
                reply = messages.error_reply(-1, exc.code, exc.message)
            await self._answer(route, reply)

    async def _receive_envelope(self) -> list[bytes]:
        """One message's frames, keeping no more than a REQ envelope's three.

        MAXMSGSIZE bounds each frame, not their number: the frames past the
        third are read and dropped one by one, so a message of thousands of
        frames costs no memory here (it is counted as malformed).
        """
        frames = [await self._rep.recv()]
        while self._rep.getsockopt(zmq.RCVMORE):
            frame = await self._rep.recv()
            if len(frames) <= 3:
                frames.append(frame)
        return frames

    async def _answer(self, route: bytes, reply: dict[str, Any]) -> None:
        await self._rep.send_multipart([route, b"", msgpack.packb(reply, use_bin_type=True)])

    def _start_trace(self, route: bytes, request: dict[str, Any]) -> None:
        """Check a trace request and record in the background; one trace at a time."""
        seconds = request.get("seconds")
        if not is_number(seconds) or not 0 < seconds <= MAX_TRACE_S:
            raise ProtocolError(f"trace needs 0 < seconds <= {MAX_TRACE_S}")
        if self._tracing is not None and not self._tracing.done():
            raise ProtocolError("a trace is already recording; try again when it ends")
        self._tracing = asyncio.get_running_loop().create_task(
            self._trace(route, request["id"], float(seconds))
        )

    async def _trace(self, route: bytes, request_id: int, seconds: float) -> None:
        """Record collective phases for `seconds`, then answer with them."""
        self.service.trace.start(seconds)
        try:
            await asyncio.sleep(seconds)
        finally:
            events = self.service.trace.take()
        await self._answer(route, messages.ok_reply(
            request_id, pid=os.getpid(), events=events, dropped=self.service.trace.dropped
        ))

    async def _publish(self) -> None:
        while True:
            await asyncio.sleep(PUBLISH_INTERVAL_S)
            await self._pub.send(msgpack.packb(self.snapshot(), use_bin_type=True))

    async def close(self) -> None:
        tasks = [*self._tasks, *([self._tracing] if self._tracing is not None else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._zap is not None:
            await self._zap.close()
        self._context.destroy(linger=0)
        for endpoint in self.endpoints:
            if endpoint.startswith("ipc://"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(endpoint[len("ipc://"):])
