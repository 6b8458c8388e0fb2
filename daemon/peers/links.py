"""Links between peer daemons over ZeroMQ TCP: one ROUTER in, one DEALER per peer out.

Every daemon binds a ROUTER on its `listen` endpoint and connects one DEALER
to each other peer, with the DEALER's routing id set to its own endpoint.  A
message from A to B travels A.DEALER → B.ROUTER, so B learns the sender from
the connection; only link probes are answered back along the same connection.

Which links are connected.  With a few daemons (up to 2N+1, N the ring
neighbours watched on either side: daemon/core/watching.py), all of them, at
start.  Past that, a daemon connects at start to its ring neighbours only; a
link to any other peer is `idle` until first used (`_open`): the first message
to it, or a job that starts to use it.  What is sent meanwhile waits in the
link, and goes out once it is up; one that does not come up within
`open_deadline_s` is given up on and its peer declared lost.  Such a link
closes again once quiet for `link_idle_s`, unless a job uses its peer or has
it as a member (`keep_open`).  So a daemon holds O(log M) links at rest, not M.

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

Health.  A monitor on each DEALER (handshake → `up`, disconnection → `lost`),
heartbeats on a path of their own and a failure detector (suspicion, questions
to other peers, local health; at most `peer_timeout_s`) notice a peer that
dies, stops answering or is cut off: see `health.py`.  When a link comes
up, its latency and bandwidth are measured (`link_stats`).

`PeerLinks` checks the settings, starts and stops the rest, and is what the
daemon calls: sending, and what it knows of each link.  The rest, each in its
module: the sockets, CURVE and the ZAP handler in `link_sockets.py` (the
handler itself in `zap.py`); which peer is which in `link_table.py` (the key
files in `keys.py`); the counters in `link_counters.py`; framing and sending
in `outgoing.py`; checking and handing on what arrives in `incoming.py`; the
data streams in `data_plane.py` (sealed on CURVE links: `stream_crypto.py`).
The daemon hears what happens through one `PeerEvents` object (`events.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, cast

import zmq

from gradsync.daemon.core.watching import ring_neighbours
from gradsync.daemon.errors import ConfigError
from gradsync.daemon.peers.data_plane import DataPlane
from gradsync.daemon.peers.events import PeerEvents
from gradsync.daemon.peers.health import Link, LinkHealth, PeerState
from gradsync.daemon.peers.incoming import IncomingMessages
from gradsync.daemon.peers.link_counters import Counter, LinkCounters
from gradsync.daemon.peers.link_settings import LinkSettings
from gradsync.daemon.peers.link_sockets import LinkSockets
from gradsync.daemon.peers.link_table import LinkTable
from gradsync.daemon.peers.outgoing import MessageFramer, Payload, raise_down, send_frames
from gradsync.daemon.peers.probe import LinkStats, bulk_payload, measure_link
from gradsync.daemon.peers.stream import StreamSender, message_head
from gradsync.daemon.peers.wire import (
    BULK,
    BYE,
    MAX_PAYLOAD_FRAMES,
    PING,
    check_kinds,
    encode_header,
)
from gradsync.protocol.codec import MAX_FRAME_BYTES
from gradsync.protocol.errors import (
    DaemonShuttingDownError,
    InvalidArgumentError,
    PeerLostError,
)
from gradsync.protocol.peer import CONTROL_KINDS, Probe

#: How long a daemon that shuts down waits for its peers to answer its goodbye.
_GOODBYE_TIMEOUT_S = 1.0
#: A link closed for being quiet connects again no sooner than this after.
_RECONNECT_AFTER_S = 1.0

log = logging.getLogger("gradsync.daemon.peers")


class PeerLinks:
    """The peer-link layer of one daemon: connect, send, receive, watch health.

    Build it with the `PeerEvents` that hears what happens (messages, links
    up and lost, broken streams; see `events.py`), `await start()`, then
    `await send(peer, header, payloads)`; `await close()` at the end.  Peers
    are named by the endpoint strings given in `peers`.
    """

    def __init__(self, settings: LinkSettings, *, events: PeerEvents) -> None:
        """Check the settings and load the keys; nothing is bound before `start()`.

        `events` hears of each accepted message, of links that come up or are
        lost and of broken data streams, and may place a stream message's
        payloads before they arrive.  Raises `ConfigError` (`KeyFileError` for
        key files) with a message naming the setting when something cannot work.
        """
        settings.check()
        self.settings = settings
        self._listen = settings.listen_endpoint()
        #: Which peer is which; raises ConfigError for bad or doubled `peers`.
        self._table = LinkTable(settings.listen, self._listen, settings.peers)
        #: This daemon's name among peers, and its routing id on every DEALER.
        self.endpoint: str = self._table.endpoint
        self._links = self._table.links
        curve = self.curve = settings.curve
        self.insecure = settings.insecure
        if self._links and curve is None and not self.insecure:
            raise ConfigError(
                "peer links need CURVE keys: pass --curve-secret FILE and "
                "--curve-authorized DIR (create keys with `gradsync keygen`), or pass "
                "--insecure to run unauthenticated and unencrypted on a trusted network"
            )
        self._kinds = check_kinds(settings.kinds)
        self._stream_kinds = frozenset(settings.stream_kinds)
        self._bulk_kinds = frozenset(settings.bulk_kinds)
        if not self._stream_kinds <= self._kinds:
            raise InvalidArgumentError("stream_kinds must be among kinds")
        self._data: DataPlane | None = None
        self._data_port = settings.data_port
        self._data_advertise = settings.advertised_data_endpoint()
        self._peer_timeout_s = float(settings.peer_timeout_s)
        self._heartbeat_ivl_s = settings.heartbeat_s
        self._probe_rounds = settings.probe_rounds
        self._probe_bytes = settings.probe_bytes
        self._max_payload_bytes = max_payload_bytes = settings.max_payload_bytes
        self._events = events
        keys = self._table.load_keys(curve) if curve is not None and self._links else None
        self._counters = LinkCounters()
        self._health = self._link_health(settings)
        self._sockets = LinkSockets(
            self._listen, self.endpoint, self._links, keys, self._health, self._counters,
            max_payload_bytes=max_payload_bytes, io_threads=settings.io_threads,
        )
        self._framer = MessageFramer(self.endpoint, self._kinds, max_payload_bytes)
        self._incoming = IncomingMessages(
            self._table, self._counters, events, self._health, kinds=self._kinds,
            stream_kinds=self._stream_kinds, place_min_bytes=settings.place_min_bytes,
            closed=lambda: self._closed,
        )
        self._changed = asyncio.Event()
        self._liveness: asyncio.Task[None] | None = None
        self._closer: asyncio.Task[None] | None = None
        self._link_idle_s = settings.link_idle_s
        #: The peers whose links stay open however quiet, besides those in use
        #: (ClusterJobs.peers_kept).
        self.keep_open: Callable[[], Collection[str]] = frozenset
        self._started = False
        self._closed = False

    # -- set-up ---------------------------------------------------------------

    def _link_health(self, settings: LinkSettings) -> LinkHealth:
        """Heartbeats and the failure detector, for the ring neighbours and the
        peers jobs use (daemon/core/watching.py): a suspect's own neighbours are
        the witnesses asked first."""
        count = settings.watch_neighbours
        health = LinkHealth(
            self.endpoint, self._peer_timeout_s, self._heartbeat_ivl_s, self._counters,
            warn_once=self._counters.warn_once, on_up=self._link_up, on_lost=self._link_lost,
            closed=lambda: self._closed, detector=settings.failure_detector,
            neighbours=ring_neighbours(self.endpoint, self._links, count),
        )
        everyone = (self.endpoint, *self._links)
        health.detector.watchers = lambda peer: ring_neighbours(peer, everyone, count) or everyone
        return health

    @property
    def counters(self) -> dict[str, int]:
        """The links' counters so far, by name (link_counters.LinkCounts)."""
        return self._counters.as_dict()

    async def start(self) -> None:
        """Bind the ROUTER, connect the DEALERs, start the background tasks."""
        if self._started:
            raise RuntimeError("PeerLinks.start() called twice")
        self._started = True
        if not self._links:
            log.info("no other peers: peer links idle, nothing bound on %s", self._listen)
            return
        loop = asyncio.get_running_loop()
        try:
            router = self._sockets.bind(loop, self._incoming.on_router_frames)
        except ConfigError:
            await self.close()
            raise
        if self._stream_kinds:
            self._start_data_plane(loop)
        self._incoming.attach(router, self._data)
        # Past a few daemons, links open at start to the ring neighbours only; the
        # rest open on first use (`open`): a daemon holds O(log M) links at rest.
        neighbours = self._health.neighbours
        for link in self._links.values():
            if neighbours is None or link.name in neighbours:
                self._connect(loop, link)
            else:
                link.state = "idle"
        self._health.open = self._open
        if neighbours is not None:
            self._closer = loop.create_task(self._close_quiet_links(neighbours),
                                            name="peer-link-closer")
        self._liveness = loop.create_task(self._health.liveness(self._links),
                                          name="peer-liveness")
        timings = self._health.detector.timings
        if timings.adaptive:
            declares = (f"a silent peer is suspected after {timings.suspect_s:g}s or more, "
                        f"declared {timings.confirm_s:g}s later at the earliest, after "
                        f"{self._peer_timeout_s:g}s at most")
        else:
            declares = (f"failure detector 'timeout': a silent peer is declared after "
                        f"{self._peer_timeout_s:g}s")
        log.info("peer links of %s: %d peers, %s; %s (heartbeats every %gs, %s)",
                 self.endpoint, len(self._links), "insecure" if self.insecure else "CURVE",
                 declares, timings.ping_ivl_s,
                 "to every peer" if neighbours is None else
                 f"to {len(neighbours)} ring neighbours and the peers jobs use, the other "
                 "links opened on first use")

    def _connect(self, loop: asyncio.AbstractEventLoop, link: Link) -> None:
        """Connect the link's sockets and follow its monitor (`health.py`); a link
        closed for being quiet a moment ago, only once the peer's router is rid of
        our last connection (as `LinkHealth.drop_link` waits)."""
        since = None if link.closed_at is None else time.monotonic() - link.closed_at
        delay_s = 0.0 if since is None else max(0.0, _RECONNECT_AFTER_S - since)
        self._sockets.connect(loop, link, self._incoming.on_dealer_frames,
                              self._incoming.on_live_frames, delay_s)
        link.tasks.append(
            loop.create_task(self._health.watch(link), name=f"peer-monitor {link.name}"))

    def _open(self, link: Link) -> None:
        """Connect a link not connected yet (`idle`), because something is sent to
        its peer or a job now uses it.  Until it is up, what is sent waits in the
        link, and the peer counts as reachable; one that does not come up within
        `open_deadline_s` is given up on: declared lost, like a silent peer."""
        if link.state != "idle" or self._closed:
            return
        loop = asyncio.get_running_loop()
        self._connect(loop, link)
        link.state, link.on_demand = "connecting", True
        link.give_up = loop.call_later(self.open_deadline_s, self._give_up, link)
        log.info("opening the link to %s (first use)", link.name)

    @property
    def open_deadline_s(self) -> float:
        """How long a link opened on first use may take to come up: as long as the
        failure detector waits, at most, for a silent peer that others still hear."""
        timings = self._health.detector.timings
        return min(self._peer_timeout_s, timings.declare_s + timings.unreachable_extra_s)

    async def _close_quiet_links(self, neighbours: Collection[str]) -> None:
        """Close the links, opened on first use, that have been quiet for
        `link_idle_s` (nothing sent, nothing heard) and that no job keeps: a
        daemon holds links to its ring neighbours and to the peers its jobs use,
        not to every daemon it ever spoke to.  They open again on first use."""
        check_s = max(0.1, min(5.0, self._link_idle_s / 4))
        while True:
            await asyncio.sleep(check_s)
            keep = set(neighbours) | set(self._health.in_use()) | set(self.keep_open())
            quiet_since = time.monotonic() - self._link_idle_s
            for link in self._links.values():
                if (link.state == "up" and link.name not in keep and not link.waiting
                        and max(link.last_sent, link.last_heard or 0.0) < quiet_since):
                    self._close_link(link)

    def _close_link(self, link: Link) -> None:
        """Close a quiet link's sockets; the peer is `idle` again (not lost).  Its
        data streams stay: the next link period finds them open."""
        log.info("closing the link to %s: quiet for %gs and no job uses it",
                 link.name, self._link_idle_s)
        for task in (*link.tasks, link.probe, link.confirming):
            if task is not None:
                task.cancel()
        link.tasks, link.probe, link.confirming = [], None, None
        closed = PeerLostError(f"the link to {link.name} was closed", {"peer": link.name})
        self._end_up_period(link, closed, keep_streams=True)
        self._sockets.disconnect(link, closed)
        link.down = None
        self._health.detector.forget(link.name)
        link.state, link.watched, link.closed_at = "idle", False, time.monotonic()
        self._notify()

    def _give_up(self, link: Link) -> None:
        link.give_up = None
        if link.state == "connecting" and not self._closed:
            link.on_demand = False  # lost: should it come up later, that is news
            link.lost_why = (f"no answer within {self.open_deadline_s:g}s of opening the link "
                             f"({link.handshake_error or 'no handshake'})")
            self._health.mark_lost(link)

    def _start_data_plane(self, loop: asyncio.AbstractEventLoop) -> None:
        """Listen for data streams; without them the slices stay on ZeroMQ."""
        plane = DataPlane(
            loop, self._listen, name=self.endpoint,
            identify=lambda name: self._table.peer_named(name.encode()),
            on_message=self._incoming.on_stream_message, on_event=self._stream_event,
            on_broken=self._stream_broken,
            on_head=self._incoming.on_stream_head,
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

    @property
    def in_use(self) -> Callable[[], Collection[str]]:
        """The peers this daemon's jobs use now: heartbeated whatever their place
        on the ring (daemon/core/watching.py)."""
        return self._health.in_use

    @in_use.setter
    def in_use(self, peers: Callable[[], Collection[str]]) -> None:
        self._health.in_use = peers

    def peer_state(self, peer: str) -> PeerState:
        """`idle` (not connected yet: opened on first use), `connecting` (never up
        yet), `up`, or `lost` (went away, or an opened link never came up)."""
        return self._table.get(peer).state

    def link_stats(self, peer: str) -> LinkStats | None:
        """`(rtt_s, bytes_per_s)` measured when the link last came up, or None yet."""
        return self._table.get(peer).stats

    # -- the core's transport (daemon/core/cluster.py `PeerTransport`) ----------

    def post(
        self, peer: str, header: Mapping[str, Any], payloads: Sequence[Payload] = (),
        zero_copy: bool = False,
    ) -> asyncio.Future[zmq.MessageTracker | None] | None:
        """`send_nowait` for callers that do not wait on the send: a control message
        to a peer that is not up is dropped (it fails its own collectives, and hears
        the announcements again once back); with `zero_copy`, the future tells when
        the payload buffers may be reused."""
        if header["kind"] in CONTROL_KINDS and not self._sendable(self._table.get(peer)):
            return None
        sending = self.send_nowait(peer, header, payloads, track=zero_copy)
        if not zero_copy:
            # Nothing waits on it; keep a failure from being reported as never retrieved.
            sending.add_done_callback(_quiet)
            return None
        return sending

    def is_up(self, peer: str) -> bool:
        return self.peer_state(peer) == "up"

    def reachable(self, peer: str) -> bool:
        """Whether messages to `peer` are expected to arrive: its link is up, or
        not connected yet (opened on first use), or opened so and not given up on."""
        return self._sendable(self._table.get(peer))

    @staticmethod
    def _sendable(link: Link) -> bool:
        return link.state in ("up", "idle") or (link.state == "connecting" and link.on_demand)

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
        stats = [link.stats for link in self._links.values() if link.state != "idle"]
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
        self._table.get(peer)
        return self._data is not None and self._data.sender(peer) is not None

    def stream_state(self, peer: str) -> str | None:
        """How slices go to `peer`: over a "sealed" or "plain" data stream, or
        None while no stream is open (they take ZeroMQ then)."""
        self._table.get(peer)
        sender = None if self._data is None else self._data.sender(peer)
        if sender is None:
            return None
        return "sealed" if sender.sealed else "plain"

    def link_facts(self, peer: str) -> dict[str, str | None]:
        """The link's last handshake, version and data stream troubles (`Link.facts`)."""
        return self._table.get(peer).facts(self.stream_open(peer))

    def detector_facts(self, peer: str) -> dict[str, float | bool | None]:
        """What the failure detector thinks of `peer` now: suspected, the silence
        after which it would be (None: the link is not up or not watched), and
        whether it is heartbeated and judged now (core/watching.py)."""
        detector = self._health.detector
        return {"suspected": detector.suspected(peer),
                "suspect_after_s": detector.suspect_after_s(peer),
                "watched": self._table.get(peer).watched}

    def heard_age_s(self, peer: str) -> float | None:
        """Seconds since anything last came from `peer` (None: nothing yet).

        Stays below `liveness_ivl_s` plus a round trip while the peer's event
        loop answers; grows while the peer is stopped, stuck or cut off.
        """
        return self._health.heard_age_s(self._table.get(peer))

    async def wait_up(
        self, timeout_s: float, peers: Iterable[str] | None = None, measured: bool = True
    ) -> None:
        """Wait until the peers are up (and, if `measured`, their links measured).

        Raises `TimeoutError` naming the peers that are not.
        """
        names = list(self._links if peers is None else peers)
        for name in names:
            self._table.get(name)

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
        link = self._table.get(peer)
        if link.state == "idle":
            self._open(link)
        while link.state == "connecting" and link.on_demand and not self._closed:
            await self._changed.wait()  # up, or given up on (`open_deadline_s`)
        if self._stream_for(link, header) is not None:
            written = self.send_nowait(peer, header, payloads)  # checks and counts it
            down = link.down
            assert down is not None  # send_nowait checked that the link is up
            await asyncio.wait((written, down), return_when=asyncio.FIRST_COMPLETED)
            if not written.done() or written.exception() is not None:
                raise_down(link, down)
            return
        link.last_sent = time.monotonic()
        await send_frames(link, self._framer.frames(header, payloads), wait_sent, self._closed)
        self._counters.sent()

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
        A link not connected yet is opened, and the message waits for it to come up.
        """
        link = self._table.get(peer)
        frames = self._framer.frames(header, payloads)
        if self._closed:
            raise DaemonShuttingDownError("peer links are closed")
        link.last_sent = time.monotonic()
        if link.state == "idle" or (link.state == "connecting" and link.on_demand):
            self._open(link)
            waiting: asyncio.Future[zmq.MessageTracker | None] = (
                asyncio.get_running_loop().create_future())
            link.waiting.append((frames, track, waiting))
            self._counters.sent()
            return waiting
        if link.state != "up" or link.dealer is None:
            raise PeerLostError(
                f"peer {link.name} is {link.state}", {"peer": link.name, "state": link.state}
            )
        stream = self._stream_for(link, header)
        if stream is not None:
            written = stream.send(message_head(frames[0], [f.nbytes for f in frames[1:]]),
                                  frames[1:], bulk=header.get("kind") in self._bulk_kinds)
            self._counters.sent(stream=True, sealed=stream.sealed)
            # Done (with None: no tracker to wait for) once the kernel has it all.
            return cast("asyncio.Future[zmq.MessageTracker | None]", written)
        sending: asyncio.Future[zmq.MessageTracker | None] = link.dealer.send(frames, track)
        self._counters.sent()
        return sending

    def _stream_for(self, link: Link, header: Mapping[str, Any]) -> StreamSender | None:
        """The data stream a message of this kind takes to the link's peer, if any."""
        if self._data is None or header.get("kind") not in self._stream_kinds:
            return None
        return self._data.sender(link.name)

    async def close(self) -> None:
        """Say goodbye to the peers, then stop every task and close every socket at
        once (linger 0); idempotent."""
        if self._closed:
            return
        await self._say_goodbye()
        self._closed = True
        tasks = [task for task in (self._liveness, self._closer) if task is not None]
        for link in self._links.values():
            tasks += link.tasks
            tasks += [task for task in (link.probe, link.confirming) if task is not None]
            self._end_up_period(link, DaemonShuttingDownError("peer links are closed"))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._data is not None:
            await self._data.close(DaemonShuttingDownError("peer links are closed"))
        await self._sockets.close()
        self._notify()

    async def _say_goodbye(self, timeout_s: float = _GOODBYE_TIMEOUT_S) -> None:
        """Tell every peer that is up that we leave, and wait (briefly) for each
        answer: a peer that has it before our streams close logs our leaving as
        such, not as a broken stream and a lost peer."""

        async def bye(link: Link) -> None:
            seq = next(link.seq)
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            link.pongs[seq] = waiter
            try:
                await send_frames(link, [encode_header(self.endpoint, Probe(BYE, seq).to_wire())],
                                  False, False)
                await waiter
            finally:
                link.pongs.pop(seq, None)

        up = [link for link in self._links.values() if link.state == "up"]
        if not up:
            return
        results = await asyncio.gather(
            *(asyncio.wait_for(bye(link), timeout_s) for link in up), return_exceptions=True
        )
        for link, result in zip(up, results, strict=True):
            if isinstance(result, BaseException):
                log.info("peer %s did not answer our goodbye (%s)", link.name,
                         type(result).__name__)

    def _stream_event(self, counter: Counter, peer: str, reason: str) -> None:
        """A data stream refused or broken: counted, and a warning unless the peer
        said goodbye (its streams end as it shuts down)."""
        link = self._links.get(peer)
        if link is not None and counter == "stream_failed":
            link.stream_error = reason
        if link is not None and link.leaving:
            self._counters.add(counter)
            log.info("peer %s: %s (it is shutting down)", peer, reason)
            return
        self._counters.stream_event(counter, peer, reason)

    # -- link health (health.py) and broken data streams -----------------------

    def _stream_broken(self, peer: str, why: str) -> None:
        """A data stream broke and may have lost a message (`data_plane.py`): tell the daemon."""
        if not self._closed:
            # Streams break at the peer's end too when it declared us (a cut it sees
            # first): what our own detector suspects says whom the cut is between.
            suspicion = self._health.detector.suspicion(peer)
            if suspicion is not None:
                why = f"{why}; it is suspected here: {suspicion.describe(self.endpoint)}"
            self._call(self._events.stream_broken, peer, why)

    def _link_up(self, link: Link) -> None:
        """The link just came up (`LinkHealth.mark_up`): send what waited for it,
        measure it, tell the daemon, unless it was opened on first use: its peer
        was reachable all along and missed nothing, and the daemon would only
        send again what waited in the link."""
        if link.give_up is not None:
            link.give_up.cancel()
            link.give_up = None
        news, link.on_demand = not link.on_demand, False
        waiting, link.waiting = link.waiting, []
        for frames, track, future in waiting:
            assert link.dealer is not None
            _hand_on(link.dealer.send(frames, track), future)
        if link.probe is not None:
            link.probe.cancel()
        link.probe = asyncio.get_running_loop().create_task(
            self._measure(link), name=f"peer-probe {link.name}"
        )
        self._notify()
        if news:
            self._call(self._events.peer_up, link.name)

    def _link_lost(self, link: Link) -> None:
        """The link was just lost (`LinkHealth.mark_lost`): fail what waits on it."""
        self._end_up_period(link, PeerLostError(f"peer {link.name} lost", {"peer": link.name}))
        if link.probe is not None:
            link.probe.cancel()
            link.probe = None
        self._notify()
        self._call(self._events.peer_lost, link.name, link.lost_why or "")

    def _end_up_period(self, link: Link, exc: Exception, keep_streams: bool = False) -> None:
        """Wake whatever waits on the link: pending sends and probe answers; close
        its data streams unless `keep_streams` (a quiet link closed: `_close_link`)."""
        if link.dealer is not None:
            link.dealer.fail_backlog(exc)
        if self._data is not None and not keep_streams:
            self._data.drop(link.name, exc)
        if link.give_up is not None:
            link.give_up.cancel()
            link.give_up = None
        waiting, link.waiting = link.waiting, []
        for _, _, future in waiting:
            if not future.done():
                future.set_exception(exc)
                future.exception()
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
                await send_frames(link, [header, *payload], False, self._closed)
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


def _hand_on(source: asyncio.Future[Any], target: asyncio.Future[Any]) -> None:
    """Settle `target` as `source` settles."""

    def settle(done: asyncio.Future[Any]) -> None:
        if target.done():
            return
        if done.cancelled():
            target.cancel()
        elif done.exception() is not None:
            target.set_exception(cast(BaseException, done.exception()))
        else:
            target.set_result(done.result())

    source.add_done_callback(settle)


def _quiet(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
