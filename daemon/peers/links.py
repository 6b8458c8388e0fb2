"""Links between peer daemons over ZeroMQ TCP: one ROUTER in, one DEALER per peer out.

Every daemon binds a ROUTER on its `listen` endpoint and connects one DEALER
to each other peer, with the DEALER's routing id set to its own endpoint.  A
message from A to B travels A.DEALER → B.ROUTER, so B learns the sender from
the connection; only link probes are answered back along the same connection.

Keys (CURVE).  Each daemon has one keypair, written by
`gradsync keygen DIR --name NAME --endpoint tcp://HOST:PORT`; it serves its
ROUTER with it and presents it as client key on its DEALERs.  Every daemon's
authorised folder holds the public `NAME.key` of every daemon of the cluster.
A DEALER must know its peer's server key before connecting, and peers are
given by endpoint, so each public certificate records its daemon's endpoint in
its metadata (`endpoint = "tcp://HOST:PORT"`); the key of peer P is the one
whose recorded endpoint is the same socket as P (same port, a common address).
Why not one cluster-wide server key: any node holding it could impersonate any
other, and removing a node from the cluster would mean re-keying all of them.
Here each node only ever holds its own secret, a node is removed by deleting
its public key, and a received message counts as from peer P only if the key
the ZAP handler accepted (libzmq's User-Id) is the one recorded for P.

Health.  ZMTP heartbeats, a monitor on each DEALER (handshake → `up`,
disconnection → `lost`) and our own liveness pings notice a peer that dies or
stops answering within `peer_timeout_s`: see `health.py`.  When a link comes
up, its latency and bandwidth are measured (`link_stats`).

The daemon hears what happens through one `PeerEvents` object (`events.py`).
The key files and the matching of peers to keys are in `keys.py`; the ZAP
handler in `zap.py`; the data streams in `data_plane.py` (sealed on CURVE links:
`stream_crypto.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, cast

import zmq
import zmq.asyncio

from gradsync.daemon.errors import ConfigError
from gradsync.daemon.peers.data_plane import DataPlane
from gradsync.daemon.peers.endpoints import TcpEndpoint, parse_tcp_endpoint, same_endpoint
from gradsync.daemon.peers.events import PeerEvents, PeerMessage
from gradsync.daemon.peers.health import DEALER_EVENTS, Link, LinkHealth, PeerState
from gradsync.daemon.peers.keys import CurveConfig, load_peer_keys
from gradsync.daemon.peers.probe import LinkStats, bulk_payload, measure_link
from gradsync.daemon.peers.socket_io import LoopSocket
from gradsync.daemon.peers.stream import PayloadSink, StreamSender, message_head
from gradsync.daemon.peers.wire import (
    BULK,
    MAX_PAYLOAD_FRAMES,
    PING,
    PONG,
    check_kinds,
    decode_header,
    encode_header,
)
from gradsync.daemon.peers.zap import ZapHandler
from gradsync.protocol.codec import MAX_FRAME_BYTES, Message, is_integer
from gradsync.protocol.errors import (
    DaemonShuttingDownError,
    InvalidArgumentError,
    PeerLostError,
    ProtocolError,
)
from gradsync.protocol.peer import CONTROL_KINDS, Probe

log = logging.getLogger("gradsync.daemon.peers")

#: Anything exporting a C-contiguous buffer: bytes, memoryview, a numpy array.
Payload = Any

_ZAP_DOMAIN = "gradsync-peers"
#: Messages ZeroMQ queues per peer connection and direction.
_PEER_QUEUE = 256
_MAX_WARNINGS = 1024
COUNTERS = (
    "sent",  # application messages sent
    "received",  # application messages accepted (handed to the events' `message`)
    "malformed",  # dropped: undecodable header, wrong version, unknown kind, bad fields
    "unknown_peer",  # dropped: sender is not one of our peers
    "rejected_keys",  # CURVE handshakes refused by the ZAP handler
    "handshake_failed",  # our DEALER's handshake with a peer failed
    "peer_lost",  # up → lost transitions
    "stream_sent",  # application messages sent over a data stream
    "stream_received",  # ... and accepted from one
    "stream_encrypted_sent",  # of those, sent over a sealed (AEAD) stream (CURVE links)
    "stream_encrypted_received",  # ... and accepted from one
    "stream_refused",  # incoming data streams closed: bad hello, wrong token, stranger
    "stream_failed",  # data streams that could not open or broke
    "stream_auth_failed",  # sealed streams refused: a hello or record failed authentication
)


def _find_self(
    listen: TcpEndpoint, peers: Sequence[str]
) -> tuple[str | None, list[tuple[str, TcpEndpoint]]]:
    """This daemon's entry in `peers` (if any), and the other peers parsed."""
    me = None
    others: list[tuple[str, TcpEndpoint]] = []
    for text in peers:
        try:
            endpoint = parse_tcp_endpoint(text)
        except ValueError as exc:
            raise ConfigError(f"bad value in 'peers': {exc}") from None
        if same_endpoint(listen, endpoint):
            me = me or text
            continue
        if endpoint.is_wildcard:
            raise ConfigError(f"peer endpoint {text!r} is a wildcard; name a host to connect to")
        for prior_name, prior in others:
            if same_endpoint(prior, endpoint):
                raise ConfigError(f"'peers' lists one daemon twice: {prior_name!r} and {text!r}")
        others.append((text, endpoint))
    return me, others


class PeerLinks:
    """The peer-link layer of one daemon: connect, send, receive, watch health.

    Build it with the `PeerEvents` that hears what happens (messages, links
    up and lost, broken streams; see `events.py`), `await start()`, then
    `await send(peer, header, payloads)`; `await close()` at the end.  Peers
    are named by the endpoint strings given in `peers`.
    """

    def __init__(
        self,
        listen: str,
        peers: Sequence[str],
        curve: CurveConfig | None = None,
        *,
        events: PeerEvents,
        insecure: bool = False,
        kinds: Collection[str] = (),
        stream_kinds: Collection[str] = (),
        peer_timeout_s: float = 10.0,
        heartbeat_ivl_s: float | None = None,
        probe_rounds: int = 5,
        probe_bytes: int = 4 * 1024 * 1024,
        max_payload_bytes: int = 1 << 31,
        io_threads: int = 1,
        place_min_bytes: int = 64 * 1024,
        data_port: int = 0,
        data_advertise: str | None = None,
    ) -> None:
        """Check the settings and load the keys; nothing is bound before `start()`.

        `kinds` are the application message kinds accepted from peers; those
        of `stream_kinds` go over TCP data streams once they are open (see
        `stream.py`): plaintext on `insecure` links, AEAD-sealed on CURVE ones.
        `events` hears of each accepted message, of links that come up or are
        lost and of broken data streams, and may place a stream message's
        payloads before they arrive (only messages of at least `place_min_bytes`).
        The data streams listen on `data_port` of `listen`'s host (0: any free
        port); peers open them at `data_advertise` (`HOST:PORT`) if given, for
        a NAT or port forward in between, else at that host and port.
        Raises `ConfigError` (`KeyFileError` for key files) with a message
        naming the setting when something cannot work.
        """
        try:
            self._listen = parse_tcp_endpoint(listen)
        except ValueError as exc:
            raise ConfigError(f"bad value for 'listen': {exc}") from None
        if not peer_timeout_s > 0:
            raise ConfigError(f"peer_timeout_s must be positive, got {peer_timeout_s!r}")
        heartbeat = peer_timeout_s / 4 if heartbeat_ivl_s is None else heartbeat_ivl_s
        if not 0 < heartbeat < peer_timeout_s:
            raise ConfigError(
                f"heartbeat_ivl_s must be positive and below peer_timeout_s "
                f"({peer_timeout_s}), got {heartbeat_ivl_s!r}"
            )
        if max_payload_bytes < 1024 * 1024:
            raise ConfigError("max_payload_bytes must be at least 1 MiB")
        if probe_rounds < 1 or probe_bytes < 0 or io_threads < 1:
            raise ConfigError(
                "probe_rounds and io_threads must be at least 1, probe_bytes at least 0"
            )
        me, others = _find_self(self._listen, peers)
        if me is None and others and self._listen.is_wildcard:
            raise ConfigError(
                f"listening on {listen} but none of 'peers' is this daemon: list this "
                "daemon's own address in 'peers' (the same list on every node)"
            )
        #: This daemon's name among peers, and its routing id on every DEALER.
        self.endpoint: str = me or listen
        if len(self.endpoint.encode()) > 255:
            raise ConfigError(f"endpoint {self.endpoint!r} is longer than 255 bytes")
        self._links = {name: Link(name, endpoint, None) for name, endpoint in others}
        if self._links and curve is None and not insecure:
            raise ConfigError(
                "peer links need CURVE keys: pass --curve-secret FILE and "
                "--curve-authorized DIR (create keys with `gradsync keygen`), or pass "
                "--insecure to run unauthenticated and unencrypted on a trusted network"
            )
        if curve is not None and insecure:
            raise ConfigError("pass either CURVE keys or --insecure, not both")
        self.curve = curve
        self.insecure = insecure
        self._kinds = check_kinds(kinds)
        self._stream_kinds = frozenset(stream_kinds)
        if not self._stream_kinds <= self._kinds:
            raise InvalidArgumentError("stream_kinds must be among kinds")
        self._data: DataPlane | None = None
        if not (is_integer(data_port) and 0 <= data_port < 65536):
            raise ConfigError(f"bad value for 'data_port': {data_port!r} is not a port")
        self._data_port = data_port
        self._data_advertise: TcpEndpoint | None = None
        if data_advertise is not None:
            try:
                self._data_advertise = parse_tcp_endpoint("tcp://" + data_advertise)
            except ValueError as exc:
                raise ConfigError(f"bad value for 'data_advertise': {exc}") from None
        self._accepted = self._kinds | {PING, BULK}
        self._peer_timeout_s = float(peer_timeout_s)
        self._heartbeat_ivl_s = float(heartbeat)
        self._probe_rounds = probe_rounds
        self._probe_bytes = probe_bytes
        self._max_payload_bytes = max_payload_bytes
        self._io_threads = io_threads
        self._events = events
        self._place_min_bytes = place_min_bytes
        #: Per peer, the stream message whose header `_on_stream_head` decoded.
        self._stream_heads: dict[str, tuple[bytes, Message]] = {}
        self._secret: tuple[bytes, bytes] | None = None
        self._authorized: set[bytes] = set()
        self._peer_by_key: dict[bytes, str] = {}
        if curve is not None and self._links:
            keys = load_peer_keys(
                curve, {name: link.endpoint for name, link in self._links.items()}
            )
            self._secret = keys.secret
            self._authorized = keys.authorized
            for name, key in keys.server_keys.items():
                self._links[name].server_key = key
                self._peer_by_key[key] = name
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._health = LinkHealth(
            self.endpoint, self._peer_timeout_s, self._heartbeat_ivl_s, self.counters,
            warn_once=self._warn_once, on_up=self._link_up, on_lost=self._link_lost,
            closed=lambda: self._closed,
        )
        self._by_routing_id: dict[bytes, str | None] = {
            name.encode(): name for name in self._links
        }
        self._context: zmq.asyncio.Context | None = None
        self._router: LoopSocket | None = None
        self._zap: ZapHandler | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()
        self._warned: set[str] = set()
        self._started = False
        self._closed = False

    # -- set-up ---------------------------------------------------------------

    def _configure(self, sock: zmq.Socket[Any]) -> None:
        """Options every peer socket shares: heartbeats (`health.py`), limits, no linger."""
        sock.setsockopt(zmq.LINGER, 0)
        self._health.configure(sock)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_payload_bytes)
        # Explicit bounds on what ZeroMQ queues per connection (a full receive queue
        # stops reading the TCP socket; a full send queue leaves the rest in our backlog).
        sock.setsockopt(zmq.RCVHWM, _PEER_QUEUE)
        sock.setsockopt(zmq.SNDHWM, _PEER_QUEUE)
        if self._listen.is_ipv6 or any(link.endpoint.is_ipv6 for link in self._links.values()):
            sock.setsockopt(zmq.IPV6, 1)

    async def start(self) -> None:
        """Bind the ROUTER, connect the DEALERs, start the background tasks."""
        if self._started:
            raise RuntimeError("PeerLinks.start() called twice")
        self._started = True
        if not self._links:
            log.info("no other peers: peer links idle, nothing bound on %s", self._listen)
            return
        loop = asyncio.get_running_loop()
        self._context = context = zmq.asyncio.Context(self._io_threads)
        if self.insecure:
            log.warning(
                "peer links on %s are INSECURE: no authentication, no encryption; "
                "anyone who can reach this port can send to this daemon", self.endpoint,
            )
        else:
            self._zap = ZapHandler(context, self._authorized, self._rejected)
            self._zap.start()
        # The data sockets use the blocking API, driven by LoopSocket; the ZAP
        # handler and the monitors keep zmq.asyncio (a few messages each).
        sockets: zmq.Context[Any] = zmq.Context.shadow(context.underlying)
        router = sockets.socket(zmq.ROUTER)
        self._configure(router)
        # No ROUTER_HANDOVER: a second connection claiming a live peer's routing id
        # would take the id over mid-message, and libzmq 4.3 aborts the whole process
        # on that (`!_more` in fq.cpp, `!_io_error` in stream_engine_base.cpp) when the
        # message has many frames.  Without it the newcomer is refused while the old
        # connection lives; a restarted peer gets in once heartbeats drop its old one.
        if self._secret is not None:
            router.curve_server = True
            router.curve_publickey, router.curve_secretkey = self._secret
            router.zap_domain = _ZAP_DOMAIN.encode()
        try:
            router.bind(str(self._listen))
        except zmq.ZMQError as exc:
            router.close(linger=0)
            await self.close()
            raise ConfigError(f"cannot listen for peers on {self._listen}: {exc}") from None
        self._router = LoopSocket(router, loop, self._on_router_frames, "the peer router")
        if self._stream_kinds:
            self._start_data_plane(loop)
        for link in self._links.values():
            self._connect(loop, link, sockets)
        log.info(
            "peer links of %s: %d peers, %s, peer timeout %gs (heartbeat every %gs)",
            self.endpoint, len(self._links), "CURVE" if self._secret else "insecure",
            self._peer_timeout_s, self._heartbeat_ivl_s,
        )

    def _start_data_plane(self, loop: asyncio.AbstractEventLoop) -> None:
        """Listen for data streams; without them the slices stay on ZeroMQ."""
        plane = DataPlane(
            loop, self._listen, name=self.endpoint,
            identify=lambda name: self._peer_named(name.encode()),
            on_message=self._on_stream_message, on_event=self._on_stream_event,
            on_broken=self._stream_broken,
            on_head=self._on_stream_head,
            limits=(MAX_FRAME_BYTES, MAX_PAYLOAD_FRAMES, self._max_payload_bytes),
            connect_timeout_s=max(5.0, self._peer_timeout_s),
            dead_after_s=self._peer_timeout_s,
            sealed=not self.insecure,
            port=self._data_port, advertise=self._data_advertise,
        )
        try:
            plane.start()
        except OSError as exc:
            log.warning("no data streams on %s (%s): slices go over ZeroMQ", self._listen, exc)
            return
        self._data = plane
        if self._data_advertise is not None:
            log.info("data streams listen on port %d, advertised to peers as %s:%d",
                     plane.port, self._data_advertise.host, self._data_advertise.port)

    def _connect(
        self, loop: asyncio.AbstractEventLoop, link: Link, sockets: zmq.Context[Any]
    ) -> None:
        assert self._context is not None
        dealer = sockets.socket(zmq.DEALER)
        self._configure(dealer)
        dealer.setsockopt(zmq.IMMEDIATE, 1)  # queue only on live connections: no stale sends
        dealer.setsockopt(zmq.ROUTING_ID, self.endpoint.encode())
        if self._secret is not None:
            dealer.curve_publickey, dealer.curve_secretkey = self._secret
            dealer.curve_serverkey = link.server_key
        monitor_address = f"inproc://gradsync-monitor-{id(link):x}"
        dealer.monitor(monitor_address, DEALER_EVENTS)
        link.monitor = self._context.socket(zmq.PAIR)
        link.monitor.connect(monitor_address)
        dealer.connect(link.name)
        link.dealer = LoopSocket(
            dealer, loop, lambda frames: self._on_dealer_frames(link, frames),
            f"the link to {link.name}",
        )
        link.tasks = [
            loop.create_task(self._health.watch(link), name=f"peer-monitor {link.name}"),
            loop.create_task(self._health.keep_alive(link), name=f"peer-liveness {link.name}"),
        ]

    async def __aenter__(self) -> PeerLinks:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- public API -----------------------------------------------------------

    @property
    def peers(self) -> tuple[str, ...]:
        """The other peers, by the endpoint strings given in `peers`."""
        return tuple(self._links)

    def peer_state(self, peer: str) -> PeerState:
        """`connecting` (never up yet), `up`, or `lost` (was up, then went away)."""
        return self._link(peer).state

    def link_stats(self, peer: str) -> LinkStats | None:
        """`(rtt_s, bytes_per_s)` measured when the link last came up, or None yet."""
        return self._link(peer).stats

    # -- the core's transport (daemon/core/cluster.py `PeerTransport`) ----------

    def post(
        self, peer: str, header: Mapping[str, Any], payloads: Sequence[Payload] = (),
        zero_copy: bool = False,
    ) -> asyncio.Future[zmq.MessageTracker | None] | None:
        """`send_nowait` for callers that do not wait on the send: a control message
        to a peer that is not up is dropped (it fails its own collectives, and hears
        the announcements again once back); with `zero_copy`, the future tells when
        the payload buffers may be reused."""
        if header["kind"] in CONTROL_KINDS and self.peer_state(peer) != "up":
            return None
        sending = self.send_nowait(peer, header, payloads, track=zero_copy)
        if not zero_copy:
            # Nothing waits on it; keep a failure from being reported as never retrieved.
            sending.add_done_callback(_quiet)
            return None
        return sending

    def is_up(self, peer: str) -> bool:
        return self.peer_state(peer) == "up"

    def link_costs(self) -> tuple[float, float] | None:
        """Latency (alpha = rtt/2) and inverse bandwidth (beta) of the least disturbed link.

        Links are probed once as they come up, usually while every daemon is
        starting and probing all its peers at once; that only ever adds time, so
        at four daemons on two cores round trips read 0.2 to 30 ms and rates 0.1
        to 2 GB/s.  The shortest round trip and the best rate are the readings
        least inflated; the job then takes the medians over its daemons.  They
        price a job's first collectives only: later ones use figures fitted to
        the collectives themselves (daemon/core/cost_epochs.py).
        """
        stats = [self.link_stats(peer) for peer in self.peers]
        measured = [s for s in stats if s is not None]
        if not measured or len(measured) < len(stats):
            return None
        alpha = min(s.rtt_s for s in measured) / 2
        beta = 1.0 / max(max(s.bytes_per_s for s in measured), 1.0)
        return alpha, beta

    @property
    def data_port(self) -> int | None:
        """The port our data streams are accepted on (None: no data streams)."""
        return None if self._data is None else self._data.port

    def stream_open(self, peer: str) -> bool:
        """Whether our data stream to `peer` is open (stream kinds then take it)."""
        self._link(peer)
        return self._data is not None and self._data.sender(peer) is not None

    def stream_state(self, peer: str) -> str | None:
        """How slices go to `peer`: over a "sealed" or "plain" data stream, or
        None while no stream is open (they take ZeroMQ then)."""
        self._link(peer)
        sender = None if self._data is None else self._data.sender(peer)
        if sender is None:
            return None
        return "sealed" if sender.sealed else "plain"

    def heard_age_s(self, peer: str) -> float | None:
        """Seconds since anything last came from `peer` (None: nothing yet).

        Stays below `liveness_ivl_s` plus a round trip while the peer's event
        loop answers; grows while the peer is stopped, stuck or cut off.
        """
        return self._health.heard_age_s(self._link(peer))

    async def wait_up(
        self, timeout_s: float, peers: Iterable[str] | None = None, measured: bool = True
    ) -> None:
        """Wait until the peers are up (and, if `measured`, their links measured).

        Raises `TimeoutError` naming the peers that are not.
        """
        names = list(self._links if peers is None else peers)
        for name in names:
            self._link(name)

        def pending() -> list[str]:
            return [
                name for name in names
                if self._links[name].state != "up"
                or (measured and self._links[name].stats is None)
            ]

        deadline = time.monotonic() + timeout_s
        while missing := pending():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                states = ", ".join(f"{name} ({self._links[name].state})" for name in missing)
                raise TimeoutError(f"peers not up after {timeout_s}s: {states}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    async def send(
        self,
        peer: str,
        header: Mapping[str, Any],
        payloads: Sequence[Payload] = (),
        *,
        wait_sent: bool = True,
    ) -> None:
        """Send `header` (with its "kind") and payload frames to `peer`, without copying.

        With `wait_sent`, returns once ZeroMQ let go of the payload buffers (they
        were handed to the kernel): the caller may then overwrite them.  Without,
        it returns once queued, and the buffers must stay untouched until a later
        `wait_sent` send to the same peer returned.  A stream kind on an open
        data stream always returns once the kernel has every byte.  Raises
        `PeerLostError` if the peer is not up or is lost before the message left.
        """
        link = self._link(peer)
        if self._stream_for(link, header) is not None:
            written = self.send_nowait(peer, header, payloads)  # checks and counts it
            down = link.down
            assert down is not None  # send_nowait checked that the link is up
            await asyncio.wait((written, down), return_when=asyncio.FIRST_COMPLETED)
            if not written.done() or written.exception() is not None:
                self._raise_down(link, down)
            return
        await self._send_frames(link, self._frames(header, payloads), wait_sent)
        self.counters["sent"] += 1

    def send_nowait(
        self,
        peer: str,
        header: Mapping[str, Any],
        payloads: Sequence[Payload] = (),
        *,
        track: bool = False,
    ) -> asyncio.Future[zmq.MessageTracker | None]:
        """Queue a message at once, in order with every earlier send to `peer`.

        For callers that must not yield between sends (a schedule's steps).  The
        returned future holds a `MessageTracker` when `track` is set: the payload
        buffers may be overwritten once the future is done and the tracker too.
        Raises `PeerLostError` if the peer is not up; the future fails with it if
        the peer is lost while the message still waits for room in ZeroMQ's queue.
        """
        link = self._link(peer)
        frames = self._frames(header, payloads)
        if self._closed:
            raise DaemonShuttingDownError("peer links are closed")
        if link.state != "up" or link.dealer is None:
            raise PeerLostError(
                f"peer {link.name} is {link.state}", {"peer": link.name, "state": link.state}
            )
        stream = self._stream_for(link, header)
        if stream is not None:
            written = stream.send(message_head(frames[0], [f.nbytes for f in frames[1:]]),
                                  frames[1:])
            self.counters["sent"] += 1
            self.counters["stream_sent"] += 1
            if stream.sealed:
                self.counters["stream_encrypted_sent"] += 1
            # Done (with None: no tracker to wait for) once the kernel has it all.
            return cast("asyncio.Future[zmq.MessageTracker | None]", written)
        sending: asyncio.Future[zmq.MessageTracker | None] = link.dealer.send(frames, track)
        self.counters["sent"] += 1
        return sending

    def _stream_for(self, link: Link, header: Mapping[str, Any]) -> StreamSender | None:
        """The data stream a message of this kind takes to the link's peer, if any."""
        if self._data is None or header.get("kind") not in self._stream_kinds:
            return None
        return self._data.sender(link.name)

    def _frames(self, header: Mapping[str, Any], payloads: Sequence[Payload]) -> list[Any]:
        kind = header.get("kind")
        if kind not in self._kinds:
            raise InvalidArgumentError(f"message kind {kind!r} was not declared in `kinds`")
        frames: list[Any] = [encode_header(self.endpoint, header)]
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

    async def close(self) -> None:
        """Stop every task and close every socket at once (linger 0); idempotent."""
        if self._closed:
            return
        self._closed = True
        tasks = list(self._tasks)
        for link in self._links.values():
            tasks += link.tasks
            if link.probe is not None:
                tasks.append(link.probe)
            self._end_up_period(link, DaemonShuttingDownError("peer links are closed"))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._data is not None:
            await self._data.close(DaemonShuttingDownError("peer links are closed"))
        if self._zap is not None:
            await self._zap.close()
        closed = DaemonShuttingDownError("peer links are closed")
        for link in self._links.values():
            if link.dealer is not None:
                with contextlib.suppress(zmq.ZMQError):
                    link.dealer.sock.disable_monitor()
                link.dealer.close(closed)
            if link.monitor is not None:
                link.monitor.close(linger=0)
        if self._router is not None:
            self._router.close(closed)
        if self._context is not None:
            self._context.destroy(linger=0)
        self._notify()

    # -- sending --------------------------------------------------------------

    def _link(self, peer: str) -> Link:
        try:
            return self._links[peer]
        except KeyError:
            raise InvalidArgumentError(
                f"{peer!r} is not a peer of {self.endpoint}; peers: {', '.join(self._links)}"
            ) from None

    async def _send_frames(self, link: Link, frames: list[Any], wait_sent: bool) -> None:
        """Queue a message on the link's DEALER; give up if the link goes down."""
        if self._closed:
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
                self._raise_down(link, down)
        tracker = sending.result()
        if wait_sent and tracker is not None:
            delay = 0.0
            while not tracker.done:
                await asyncio.sleep(delay)
                delay = min(max(2 * delay, 50e-6), 2e-3)
            if down.done():
                self._raise_down(link, down)

    def _raise_down(self, link: Link, down: asyncio.Future[None]) -> None:
        exc = down.exception() if down.done() and not down.cancelled() else None
        if isinstance(exc, DaemonShuttingDownError):
            raise DaemonShuttingDownError(exc.message)
        raise PeerLostError(
            f"peer {link.name} was lost while sending to it",
            {"peer": link.name, "state": link.state},
        )

    # -- receiving ------------------------------------------------------------

    def _drop(self, counter: str, peer: str, reason: str) -> None:
        """Count a dropped message; warn once per peer and counter."""
        self.counters[counter] += 1
        self._warn_once(f"{counter}:{peer}", "dropped a message from %s: %s", peer, reason)

    def _warn_once(self, key: str, text: str, *args: object) -> None:
        if key in self._warned:
            log.debug(text, *args)
            return
        if len(self._warned) < _MAX_WARNINGS:
            self._warned.add(key)
        log.warning(text, *args)

    def _sender(self, frames: list[zmq.Frame]) -> str | None:
        """Which peer sent a message, or None for a stranger.

        By routing id (the sender's endpoint); under CURVE the key the ZAP
        handler accepted must also be the one recorded for that endpoint, so an
        authorised daemon cannot speak in the name of another.
        """
        peer = self._peer_named(frames[0].bytes)
        if self._secret is not None and peer is not None:
            try:
                user_id = str(frames[1].get("User-Id")).encode()
            except zmq.ZMQError:
                return None
            if self._peer_by_key.get(user_id) != peer:
                return None
        return peer

    def _peer_named(self, routing_id: bytes) -> str | None:
        """The peer a routing id (or stream hello) names, remembered: matching
        a name that is not a peer's own may resolve host names."""
        if routing_id not in self._by_routing_id:
            if len(self._by_routing_id) > _MAX_WARNINGS + len(self._links):
                self._by_routing_id = {name.encode(): name for name in self._links}
            self._by_routing_id[routing_id] = self._match_routing_id(routing_id)
        return self._by_routing_id[routing_id]

    def _match_routing_id(self, routing_id: bytes) -> str | None:
        """The peer whose endpoint is the same socket as the one a routing id names."""
        try:
            endpoint = parse_tcp_endpoint(routing_id.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return None
        for link in self._links.values():
            if same_endpoint(link.endpoint, endpoint):
                return link.name
        return None

    def _on_router_frames(self, frames: list[zmq.Frame]) -> None:
        """One message on the ROUTER: answer a probe, or hand the message on."""
        message = self._accept(frames)
        if message is None:
            return
        self._links[message.peer].last_heard = time.monotonic()
        kind = message.header["kind"]
        if kind in (PING, BULK):
            assert self._router is not None
            answer = Probe(PONG, message.header["seq"])
            if self._data is not None:
                # Over CURVE the answer reaches this peer alone, encrypted: it carries
                # our offer of a sealed stream to it (stream_crypto.py).
                answer = Probe(PONG, answer.seq, **self._data.advert(message.peer))
            pong = encode_header(self.endpoint, answer.to_wire())
            # A probe answer that does not fit is dropped, never waited for.
            self._router.try_send([frames[0], pong])
            return
        self._deliver(message)

    def _deliver(self, message: PeerMessage) -> None:
        """Hand an accepted application message to the events."""
        self.counters["received"] += 1
        self._events.message(message)

    def _stream_header(self, name: str, body: bytes) -> Message:
        """A data stream message's header, checked; raises ProtocolError and co."""
        header = decode_header(body, self._stream_kinds)
        if header["src"] != name:
            raise ProtocolError(f"'src' {header['src'][:80]!r} is not the stream's sender")
        return header

    def _on_stream_head(
        self, peer: str, name: str, body: bytes, sizes: list[int]
    ) -> Sequence[PayloadSink | None] | None:
        """A stream message's header is in: ask the events where its payloads go."""
        if sum(sizes) < self._place_min_bytes:
            return None
        try:
            header = self._stream_header(name, body)
        except (ProtocolError, ValueError, TypeError):
            return None  # dropped, and counted, once the whole message is in
        # One stream per peer: its next message is this one, so decode it once.
        self._stream_heads[peer] = (body, header)
        return self._events.place(peer, header, sizes)

    def _on_stream_message(
        self, peer: str, name: str, body: bytes, payloads: list[memoryview | PayloadSink]
    ) -> None:
        """One message from a data stream (`name`: the sender, as its hello said)."""
        decoded = self._stream_heads.pop(peer, None)
        try:
            header = (decoded[1] if decoded is not None and decoded[0] is body
                      else self._stream_header(name, body))
        except (ProtocolError, ValueError, TypeError) as exc:
            self._drop("malformed", peer, str(exc))
            return
        self._links[peer].last_heard = time.monotonic()
        self.counters["stream_received"] += 1
        if self._data is not None and self._data.sealed:
            self.counters["stream_encrypted_received"] += 1
        self._deliver(PeerMessage(peer, header, list(payloads)))

    def _on_stream_event(self, counter: str, peer: str, reason: str) -> None:
        self.counters[counter] += 1
        self._warn_once(f"{counter}:{peer}", "peer %s: %s", peer, reason)

    def _stream_broken(self, peer: str, why: str) -> None:
        if not self._closed:
            self._call(self._events.stream_broken, peer, why)

    def _accept(self, frames: list[zmq.Frame]) -> PeerMessage | None:
        """Check one message from the ROUTER; count and drop it if it is bad."""
        peer = self._sender(frames) if len(frames) >= 2 else None
        if peer is None:
            label = frames[0].bytes.decode("utf-8", errors="replace")[:80]
            self._drop("unknown_peer", label, "sender is not one of our peers")
            return None
        if len(frames) - 2 > MAX_PAYLOAD_FRAMES:
            self._drop("malformed", peer, f"{len(frames) - 2} payload frames")
            return None
        try:
            header = decode_header(frames[1].bytes, self._accepted)
            if header["src"].encode() != frames[0].bytes:
                raise ProtocolError(f"'src' {header['src'][:80]!r} is not the sender's id")
        except (ProtocolError, ValueError, TypeError) as exc:
            self._drop("malformed", peer, str(exc))
            return None
        return PeerMessage(peer, header, frames[2:])

    def _on_dealer_frames(self, link: Link, frames: list[zmq.Frame]) -> None:
        """An answer to one of our probes, back over the link's DEALER."""
        try:
            header = decode_header(frames[0].bytes, frozenset({PONG}))
            if len(frames) != 1:
                raise ProtocolError("a pong carries no payload")
            pong = Probe.from_wire(header)
        except ProtocolError as exc:
            self._drop("malformed", link.name, str(exc))
            return
        link.last_heard = time.monotonic()
        if self._data is not None and link.state == "up" and not self._closed:
            self._data.offer(link.name, link.endpoint.host, header)
        waiter = link.pongs.pop(pong.seq, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- link health (health.py) and ZAP refusals ---------------------------------

    def _rejected(self, address: str, reason: str) -> None:
        self.counters["rejected_keys"] += 1
        self._warn_once(f"zap:{address}", "refused a peer connection from %s: %s", address, reason)

    def _link_up(self, link: Link) -> None:
        """The link just came up (`LinkHealth.mark_up`): measure it, tell the daemon."""
        if link.probe is not None:
            link.probe.cancel()
        link.probe = asyncio.get_running_loop().create_task(
            self._measure(link), name=f"peer-probe {link.name}"
        )
        self._notify()
        self._call(self._events.peer_up, link.name)

    def _link_lost(self, link: Link) -> None:
        """The link was just lost (`LinkHealth.mark_lost`): fail what waits on it."""
        self._end_up_period(link, PeerLostError(f"peer {link.name} lost", {"peer": link.name}))
        if link.probe is not None:
            link.probe.cancel()
            link.probe = None
        self._notify()
        self._call(self._events.peer_lost, link.name)

    def _end_up_period(self, link: Link, exc: Exception) -> None:
        """Wake whatever waits on the link: pending sends and probe answers."""
        if link.dealer is not None:
            link.dealer.fail_backlog(exc)
        if self._data is not None:
            self._data.drop(link.name, exc)
        if link.down is not None and not link.down.done():
            link.down.set_exception(exc)
            link.down.exception()  # retrieved: no "never retrieved" warning if nobody waits
        for waiter in link.pongs.values():
            if not waiter.done():
                waiter.set_exception(exc)
                waiter.exception()
        link.pongs.clear()

    def _call(self, callback: Callable[..., None], peer: str, *args: Any) -> None:
        try:
            callback(peer, *args)
        except Exception:
            log.exception("peer callback %r failed for %s", callback, peer)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- link measurement -------------------------------------------------------

    async def _measure(self, link: Link) -> None:
        """Measure latency and bandwidth of a link that just came up."""
        timeout_s = max(10.0, self._peer_timeout_s)

        async def round_trip(payload: Sequence[memoryview]) -> None:
            seq = next(link.seq)
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            link.pongs[seq] = waiter
            kind = BULK if payload else PING
            header = encode_header(self.endpoint, Probe(kind, seq).to_wire())
            try:
                await self._send_frames(link, [header, *payload], wait_sent=False)
                await asyncio.wait_for(waiter, timeout_s)
            finally:
                link.pongs.pop(seq, None)

        try:
            stats = await measure_link(
                round_trip, self._probe_rounds, bulk_payload(self._probe_bytes)
            )
        except (PeerLostError, DaemonShuttingDownError):
            return
        except TimeoutError:
            log.warning("could not measure the link to %s: no answer in %gs", link.name, timeout_s)
            return
        link.stats = stats
        log.info(
            "link to %s: rtt %.1f µs, %.1f MB/s",
            link.name, stats.rtt_s * 1e6, stats.bytes_per_s / 1e6,
        )
        self._notify()


def _quiet(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
