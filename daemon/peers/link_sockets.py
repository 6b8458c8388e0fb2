"""The ZeroMQ sockets of the peer links: one ROUTER in, two DEALERs per peer out
(messages, and heartbeats alone: `health.py`).

What every peer socket shares (heartbeats, limits, queue bounds, no linger),
CURVE on both ends with the ZAP handler that admits the authorised keys
(`zap.py`), each DEALER's monitor (its events drive `health.py`), and closing
all of it at once.  The sockets that carry messages use the blocking API,
driven by the event loop through `LoopSocket` (`socket_io.py`); the ZAP
handler and the monitors keep zmq.asyncio (a few messages each).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import zmq
import zmq.asyncio

from gradsync.daemon.errors import ConfigError
from gradsync.daemon.peers.endpoints import TcpEndpoint
from gradsync.daemon.peers.health import DEALER_EVENTS, LIVE_ID_SUFFIX, Link, LinkHealth
from gradsync.daemon.peers.keys import PeerKeys
from gradsync.daemon.peers.link_counters import LinkCounters
from gradsync.daemon.peers.socket_io import LoopSocket
from gradsync.daemon.peers.zap import ZapHandler
from gradsync.protocol.errors import DaemonShuttingDownError

log = logging.getLogger("gradsync.daemon.peers")

_ZAP_DOMAIN = "gradsync-peers"
#: Messages ZeroMQ queues per peer connection and direction.
_PEER_QUEUE = 256


class LinkSockets:
    """The zmq context of one daemon's peer links, and every socket in it."""

    def __init__(
        self,
        listen: TcpEndpoint,
        endpoint: str,
        links: Mapping[str, Link],
        keys: PeerKeys | None,
        health: LinkHealth,
        counters: LinkCounters,
        *,
        max_payload_bytes: int,
        io_threads: int,
    ) -> None:
        """`endpoint` is this daemon's routing id on the DEALERs; `keys`, None on
        insecure links, our CURVE key pair and the keys the ZAP handler admits."""
        self._listen = listen
        self._endpoint = endpoint
        self._links = links
        self._keys = keys
        self._health = health
        self._counters = counters
        self._max_payload_bytes = max_payload_bytes
        self._io_threads = io_threads
        self._ipv6 = listen.is_ipv6 or any(link.endpoint.is_ipv6 for link in links.values())
        self._context: zmq.asyncio.Context | None = None
        #: The blocking-API view of `_context` (the same libzmq context).
        self._sockets: zmq.Context[Any] | None = None
        self._zap: ZapHandler | None = None
        self._router: LoopSocket | None = None
        self._monitors = itertools.count()

    def _configure(self, sock: zmq.Socket[Any]) -> None:
        """Options every peer socket shares: heartbeats (`health.py`), limits, no linger."""
        sock.setsockopt(zmq.LINGER, 0)
        self._health.configure(sock)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_payload_bytes)
        # Explicit bounds on what ZeroMQ queues per connection (a full receive queue
        # stops reading the TCP socket; a full send queue leaves the rest in our backlog).
        sock.setsockopt(zmq.RCVHWM, _PEER_QUEUE)
        sock.setsockopt(zmq.SNDHWM, _PEER_QUEUE)
        if self._ipv6:
            sock.setsockopt(zmq.IPV6, 1)

    def bind(
        self, loop: asyncio.AbstractEventLoop, on_frames: Callable[[list[zmq.Frame]], None]
    ) -> LoopSocket:
        """Start the ZAP handler (CURVE) and bind the ROUTER, read by `on_frames`.

        Raises `ConfigError` if the ROUTER cannot bind; `close()` then cleans up.
        """
        self._context = context = zmq.asyncio.Context(self._io_threads)
        if self._keys is None:
            log.warning(
                "peer links on %s are INSECURE: no authentication, no encryption; "
                "anyone who can reach this port can send to this daemon", self._endpoint,
            )
        else:
            self._zap = ZapHandler(context, self._keys.authorized, self._rejected)
            self._zap.start()
        sockets: zmq.Context[Any] = zmq.Context.shadow(context.underlying)
        self._sockets = sockets
        router = sockets.socket(zmq.ROUTER)
        self._configure(router)
        # No ROUTER_HANDOVER: a second connection claiming a live peer's routing id
        # would take the id over mid-message, and libzmq 4.3 aborts the whole process
        # on that (`!_more` in fq.cpp, `!_io_error` in stream_engine_base.cpp) when the
        # message has many frames.  Without it the newcomer is refused while the old
        # connection lives; a restarted peer gets in once heartbeats drop its old one.
        if self._keys is not None:
            router.curve_server = True
            router.curve_publickey, router.curve_secretkey = self._keys.secret
            router.zap_domain = _ZAP_DOMAIN.encode()
        try:
            router.bind(str(self._listen))
        except zmq.ZMQError as exc:
            router.close(linger=0)
            raise ConfigError(f"cannot listen for peers on {self._listen}: {exc}") from None
        self._router = LoopSocket(router, loop, on_frames, "the peer router")
        return self._router

    def connect(
        self,
        loop: asyncio.AbstractEventLoop,
        link: Link,
        on_frames: Callable[[Link, list[zmq.Frame]], None],
        on_live_frames: Callable[[Link, list[zmq.Frame]], None],
        delay_s: float = 0.0,
    ) -> None:
        """Connect the link's DEALER, read by `on_frames`, with a monitor on it, and
        its heartbeat DEALER (`live`, read by `on_live_frames`: `health.py`);
        `delay_s` later where the peer's router may still hold our last connection
        (it refuses a newcomer under a routing id in use)."""
        assert self._context is not None and self._sockets is not None
        dealer = self._dealer(link, self._endpoint.encode())
        live = self._dealer(link, self._endpoint.encode() + LIVE_ID_SUFFIX)
        self._health.configure_live(live)
        link.live = LoopSocket(live, loop, lambda frames: on_live_frames(link, frames),
                               f"the heartbeat link to {link.name}")
        # Each connection its own: a closed link's monitor may hold its address a while.
        monitor_address = f"inproc://gradsync-monitor-{id(link):x}-{next(self._monitors)}"
        dealer.monitor(monitor_address, DEALER_EVENTS)
        link.monitor = self._context.socket(zmq.PAIR)
        link.monitor.connect(monitor_address)
        link.dealer = LoopSocket(
            dealer, loop, lambda frames: on_frames(link, frames), f"the link to {link.name}"
        )
        if delay_s > 0:
            loop.call_later(delay_s, self._connect_now, link, live, dealer)
        else:
            self._connect_now(link, live, dealer)

    @staticmethod
    def _connect_now(link: Link, *sockets: zmq.Socket[Any]) -> None:
        if link.dealer is not None and link.dealer.sock is sockets[-1]:  # not closed since
            for sock in sockets:
                sock.connect(link.name)

    def _dealer(self, link: Link, routing_id: bytes) -> zmq.Socket[Any]:
        """A DEALER to the link's peer, not yet connected."""
        assert self._sockets is not None
        dealer: zmq.Socket[Any] = self._sockets.socket(zmq.DEALER)
        self._configure(dealer)
        dealer.setsockopt(zmq.IMMEDIATE, 1)  # queue only on live connections: no stale sends
        dealer.setsockopt(zmq.ROUTING_ID, routing_id)
        if self._keys is not None:
            dealer.curve_publickey, dealer.curve_secretkey = self._keys.secret
            dealer.curve_serverkey = link.server_key
        return dealer

    def disconnect(self, link: Link, error: Exception) -> None:
        """Close one link's sockets (linger 0): its DEALERs and their monitor."""
        if link.dealer is not None:
            with contextlib.suppress(zmq.ZMQError):
                link.dealer.sock.disable_monitor()
            link.dealer.close(error)
        if link.live is not None:
            link.live.close(error)
        if link.monitor is not None:
            link.monitor.close(linger=0)
        link.dealer = link.live = link.monitor = None

    async def close(self) -> None:
        """Stop the ZAP handler, close every socket (linger 0) and the context."""
        if self._zap is not None:
            await self._zap.close()
        closed = DaemonShuttingDownError("peer links are closed")
        for link in self._links.values():
            self.disconnect(link, closed)
        if self._router is not None:
            self._router.close(closed)
        if self._context is not None:
            self._context.destroy(linger=0)

    def _rejected(self, address: str, reason: str) -> None:
        """A CURVE handshake the ZAP handler refused: count it, warn once per address."""
        self._counters.count(
            "rejected_keys", f"zap:{address}", "refused a peer connection from %s: %s",
            address, reason,
        )
