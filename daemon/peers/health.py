"""Link health: noticing that a peer came up, died, stopped answering or is cut off.

A monitor on each DEALER turns handshake success into state `up` (once a
ping has come back: `confirm`) and disconnection into `lost`; a peer killed
is noticed at once (its kernel closes the TCP connection).  A peer that goes
silent (power off, a cut link, a frozen host) is the failure detector's to
judge (daemon/core/failure_detector.py): its decisions are made there, from
what this module tells it, and carried out here (`liveness`).

Heartbeats have their own path.  Besides its DEALER (control messages, link
probes and, while no data stream is open, slices), every link has a second
DEALER, `live`, that carries only heartbeat pings (every `ping_ivl_s`, 0.1 s)
and the detector's questions about suspects (ASK), so they never wait behind
data in a queue of ours or ZeroMQ's, or in the peer's TCP stream; its packets
ask for low delay (IP TOS).  The peer's ROUTER answers on the same
connection.  Anything from the peer counts as heard: its answers on either
DEALER, anything on our ROUTER (its own heartbeats included), data stream
messages.  The DEALER still pings once a second (its answers carry the
peer's data stream offers).  With `--failure-detector timeout` the heartbeats
go once a second and no one is suspected or asked about: a silent peer is
declared at `peer_timeout_s`.

ZeroMQ's own heartbeats (ZMTP) and TCP keepalive and `TCP_USER_TIMEOUT` run
on every connection with the upper bound, `peer_timeout_s`: the kernel and
libzmq end a connection silent that long in any case.  A link not connected
(`idle`: links.py opens it on first use) has none of this, and is not judged.

`LinkHealth` owns these state changes of each `Link`; what a change means
beyond the link's state (probes, waiting sends, the daemon's events) is the
links' business, told through `on_up` and `on_lost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, Literal

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gradsync.daemon.core.failure_detector import (
    Action,
    Ask,
    DetectorKind,
    DetectorTimings,
    FailureDetector,
    Refuted,
    Stalled,
    Verdict,
)
from gradsync.daemon.peers.endpoints import TcpEndpoint
from gradsync.daemon.peers.link_counters import LinkCounters
from gradsync.daemon.peers.probe import LinkStats
from gradsync.daemon.peers.socket_io import LoopSocket
from gradsync.daemon.peers.wire import ASK, CUT, PING, encode_header
from gradsync.protocol.peer import MAX_WHY, Probe

log = logging.getLogger("gradsync.daemon.peers")

#: `idle`: no connection made yet (a link opened on first use, links.py).
PeerState = Literal["idle", "connecting", "up", "lost"]

_RECONNECT_IVL_MS = 100
_RECONNECT_IVL_MAX_MS = 1000
_MAX_TTL_MS = 6_553_500  # the ZMTP PING carries the TTL in deciseconds, 16 bits
#: The DEALER (not `live`) pings this often: its answers carry data stream offers.
_DEALER_PING_IVL_S = 1.0
#: Heartbeats waiting in ZeroMQ's queue of the `live` DEALER, at most (a stale one
#: is worth nothing: drop, don't queue).
_LIVE_QUEUE = 16
#: IP TOS "low delay" on heartbeat packets (pfifo_fast and the like send them first).
_IPTOS_LOWDELAY = 0x10
#: The routing id of a link's `live` DEALER: this daemon's endpoint and this.
LIVE_ID_SUFFIX = b"#live"
#: A peer declared unreachable (alive, behind a cut) is told why this long before
#: its link is dropped here (and its data streams closed): where our messages still
#: reach it, it should read our words before it sees its streams end.
_CUT_NOTICE_S = 0.1
#: A new connection's confirming ping goes again after this long unanswered (doubling).
_CONFIRM_FIRST_S = 0.02
_CONFIRM_MAX_S = 0.5
DEALER_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_MONITOR_STOPPED
)
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


@dataclasses.dataclass(eq=False)
class Link:
    """Our side of the connection to one peer."""

    name: str
    endpoint: TcpEndpoint
    server_key: bytes | None
    dealer: LoopSocket | None = None
    #: The heartbeat path: pings and questions about suspects only.
    live: LoopSocket | None = None
    monitor: zmq.asyncio.Socket | None = None
    state: PeerState = "connecting"
    stats: LinkStats | None = None
    #: Resolved when the current `up` period ends; replaced when the link comes up.
    down: asyncio.Future[None] | None = None
    pongs: dict[int, asyncio.Future[None]] = dataclasses.field(default_factory=dict)
    seq: Iterator[int] = dataclasses.field(default_factory=itertools.count)
    tasks: list[asyncio.Task[None]] = dataclasses.field(default_factory=list)
    probe: asyncio.Task[None] | None = None
    #: Pinging a new connection until it answers (`LinkHealth.confirm`), then up.
    confirming: asyncio.Task[None] | None = None
    #: `time.monotonic()` when anything last arrived from the peer (message or pong).
    last_heard: float | None = None
    #: ... and when an answer last came back on `live` (while it does not, as when
    #: the peer's ROUTER still holds a connection of ours from before a cut, the
    #: heartbeats take the DEALER too).
    live_heard: float = 0.0
    #: The peer said goodbye (it is shutting down): its link ending is no failure.
    leaving: bool = False
    #: Heartbeated and judged by the failure detector now (`LinkHealth.watched`).
    watched: bool = False
    #: Why the link is being declared lost (the detector's verdict), while it is.
    lost_why: str | None = None
    #: Opened on first use rather than at start (links.py `PeerLinks._open`): until it
    #: is up or given up on, messages wait in `waiting` and the peer counts as reachable.
    on_demand: bool = False
    #: What was sent before an on-demand link came up: frames, whether tracked, and
    #: the future that hands on ZeroMQ's answer once they are sent.
    waiting: list[tuple[list[Any], bool, asyncio.Future[Any]]] = dataclasses.field(
        default_factory=list)
    #: Gives up on an on-demand link that does not come up in time.
    give_up: asyncio.TimerHandle | None = None
    #: `time.monotonic()` when a message was last sent to the peer (0: never).
    last_sent: float = 0.0
    #: `time.monotonic()` when the link was last closed for being quiet (links.py).
    closed_at: float | None = None
    #: What `gradsync doctor` reads (`facts`): why the last handshake failed (a
    #: monitor event's name, None once one succeeds), the last message refused for
    #: its protocol version, why our last data stream to the peer failed, and where
    #: the peer's last probe answer said its data streams listen (HOST:PORT).
    handshake_error: str | None = None
    version_error: str | None = None
    stream_error: str | None = None
    data_address: str | None = None

    def facts(self, stream_open: bool) -> dict[str, str | None]:
        """The link's troubles and data address, for the statistics snapshot (a
        stream error is stale once a stream is open)."""
        return {"handshake_error": self.handshake_error, "version_error": self.version_error,
                "stream_error": None if stream_open else self.stream_error,
                "data_address": self.data_address}


class LinkHealth:
    """Watches the links of one daemon: monitor events, heartbeats, the failure
    detector's verdicts, up and lost."""

    def __init__(
        self,
        endpoint: str,
        peer_timeout_s: float,
        heartbeat_ivl_s: float,
        counters: LinkCounters,
        *,
        warn_once: Callable[..., None],
        on_up: Callable[[Link], None],
        on_lost: Callable[[Link], None],
        closed: Callable[[], bool],
        detector: DetectorKind = "adaptive",
        neighbours: frozenset[str] | None = None,
    ) -> None:
        """`endpoint`: this daemon's name on the pings; `peer_timeout_s`: the upper
        bound; `heartbeat_ivl_s`: ZeroMQ's own heartbeats; `detector`: `adaptive`,
        or `timeout` (the upper bound alone: DetectorTimings); `counters`: the links'
        (`handshake_failed`, `peer_lost`, `peer_suspected` and `peer_unreachable`
        are counted here); `on_up(link)` and `on_lost(link)` follow each change of
        state; `closed()` says whether the links are closing (no reconnecting then);
        `neighbours`: the peers heartbeated even when no job uses them (None: every
        peer; daemon/core/watching.py)."""
        self._endpoint = endpoint
        self._peer_timeout_s = peer_timeout_s
        self._heartbeat_ivl_s = heartbeat_ivl_s
        self.neighbours = neighbours
        #: The peers this daemon's jobs use now (the cluster core's, once wired in).
        self.in_use: Callable[[], Collection[str]] = frozenset
        #: Connects a link not connected yet (`idle`) that is to be watched now.
        self.open: Callable[[Link], None] = lambda link: None
        self.detector = FailureDetector(
            DetectorTimings.for_timeout(peer_timeout_s, detector), time.monotonic)
        self._counters = counters
        self._warn_once = warn_once
        self._on_up = on_up
        self._on_lost = on_lost
        self._closed = closed

    def configure(self, sock: zmq.Socket[Any]) -> None:
        """The options by which a peer socket notices a dead peer and comes back."""
        ivl_ms = max(1, round(self._heartbeat_ivl_s * 1000))
        timeout_ms = max(1, round(self._peer_timeout_s * 1000) - ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, min(_MAX_TTL_MS, max(100, ivl_ms + timeout_ms)))
        sock.setsockopt(zmq.HANDSHAKE_IVL, max(1000, round(self._peer_timeout_s * 1000)))
        sock.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_IVL_MAX_MS)
        # The kernel gives up on a connection whose data stays unacknowledged (a cut
        # link) or whose keepalive probes go unanswered, within about the peer timeout.
        idle_s = max(1, round(self._peer_timeout_s / 2))
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, idle_s)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, max(1, round(idle_s / 3)))
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
        sock.setsockopt(zmq.TCP_MAXRT, max(1, round(self._peer_timeout_s * 1000)))

    @staticmethod
    def configure_live(sock: zmq.Socket[Any]) -> None:
        """What a `live` DEALER has besides `configure`: a short queue, low delay."""
        sock.setsockopt(zmq.SNDHWM, _LIVE_QUEUE)
        sock.setsockopt(zmq.TOS, _IPTOS_LOWDELAY)

    def heard(self, link: Link) -> None:
        """Something came from the link's peer."""
        link.last_heard = time.monotonic()
        self.detector.heard(link.name)

    def heard_age_s(self, link: Link) -> float | None:
        """Seconds since anything last came from the link's peer (None: nothing yet)."""
        last = link.last_heard
        return None if last is None else time.monotonic() - last

    def witness_age_s(self, peer: str) -> float | None:
        """For a peer's question: seconds since `peer` was last heard, if its link is up."""
        return self.detector.heard_age(peer)

    def witness_said(self, witness: Link, about: str, heard_s: float | None) -> None:
        """A peer's answer to our question about the suspect `about`."""
        self.detector.witness_said(about, witness.name, heard_s)

    async def watch(self, link: Link) -> None:
        """Follow the DEALER's monitor events: handshake → confirm → up, disconnect → lost."""
        assert link.monitor is not None
        while True:
            event = parse_monitor_message(await link.monitor.recv_multipart())
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.handshake_error = None
                self._stop_confirming(link)
                link.confirming = asyncio.get_running_loop().create_task(
                    self.confirm(link), name=f"peer-confirm {link.name}")
            elif kind == zmq.EVENT_DISCONNECTED:
                self._stop_confirming(link)
                if link.state == "up":
                    self.mark_lost(link)
            elif kind & _HANDSHAKE_FAILED:
                self._counters.add("handshake_failed")
                link.handshake_error = zmq.Event(kind).name
                self._warn_once(
                    f"handshake:{link.name}",
                    "handshake with peer %s failed (%s): is our key in its authorized "
                    "folder, and its key the one recorded for it in ours?",
                    link.name, zmq.Event(kind).name,
                )
            elif kind == zmq.EVENT_MONITOR_STOPPED:
                return

    async def confirm(self, link: Link) -> None:
        """Declare the link up once a ping has come back over its new connection.

        A message sent on the DEALER the instant libzmq reports its handshake can
        vanish.  Seen with a restarted peer daemon, in about one restart in five:
        the one control message sent as its link came up was taken by ZeroMQ and
        never arrived, while the probe's pings sent 3 ms later all did (where in
        libzmq it goes is not pinned down).  A round trip proves that what is sent
        from now on arrives; up is declared after one, so nothing is posted before.
        """
        assert link.dealer is not None
        loop = asyncio.get_running_loop()
        wait_s = _CONFIRM_FIRST_S
        while True:
            seq = next(link.seq)
            answered: asyncio.Future[None] = loop.create_future()
            link.pongs[seq] = answered
            link.dealer.try_send([encode_header(self._endpoint, Probe(PING, seq).to_wire())])
            try:
                await asyncio.wait_for(answered, wait_s)
            except TimeoutError:
                wait_s = min(2 * wait_s, _CONFIRM_MAX_S)
                continue
            finally:
                link.pongs.pop(seq, None)
            link.confirming = None
            self.mark_up(link)
            return

    @staticmethod
    def _stop_confirming(link: Link) -> None:
        if link.confirming is not None:
            link.confirming.cancel()
            link.confirming = None

    async def liveness(self, links: Mapping[str, Link]) -> None:
        """Every `ping_ivl_s`: carry out what the detector decided, then send the
        heartbeats (and, once a second, a ping on each DEALER)."""
        ping_ivl_s = self.detector.timings.ping_ivl_s
        dealer_every = max(1, round(_DEALER_PING_IVL_S / ping_ivl_s))
        for tick in itertools.count(1):
            await asyncio.sleep(ping_ivl_s)
            for action in self.detector.tick():
                self._act(links, action)
            now = time.monotonic()
            in_use = None if self.neighbours is None else set(self.in_use())
            if in_use is not None:
                for name in in_use:
                    link = links.get(name)
                    if link is not None and link.state == "idle":
                        self.open(link)
            for link in links.values():
                if link.state != "up" or not self._watch(link, in_use):
                    continue
                ping = [encode_header(self._endpoint, Probe(PING, next(link.seq)).to_wire())]
                # Sent without blocking: a ping that does not fit in the queue is skipped.
                if link.live is not None:
                    link.live.try_send(ping)
                live_quiet = now - link.live_heard > 5 * ping_ivl_s
                if (tick % dealer_every == 0 or live_quiet) and link.dealer is not None:
                    link.dealer.try_send(ping)

    def watched(self, name: str, in_use: Collection[str] | None) -> bool:
        """Whether the peer is heartbeated now: a ring neighbour, or used by a job."""
        return self.neighbours is None or name in self.neighbours or (
            name in (self.in_use() if in_use is None else in_use))

    def _watch(self, link: Link, in_use: Collection[str] | None) -> bool:
        """Heartbeat the peer and have the detector judge it, or neither: a peer
        heartbeated again is judged from now (its silence meanwhile was ours)."""
        watched = self.watched(link.name, in_use)
        if watched and not link.watched:
            self.detector.watch(link.name)
        elif link.watched and not watched:
            self.detector.forget(link.name)
        link.watched = watched
        return watched

    def _act(self, links: Mapping[str, Link], action: Action) -> None:
        """Carry out one decision of the failure detector."""
        if isinstance(action, Ask):
            if action.first:
                self._counters.add("peer_suspected")
                log.info("peer %s silent for %.1fs: suspected%s", action.peer,
                            action.silent_s, f"; asking {', '.join(action.witnesses)}"
                            if action.witnesses else " (no other peer to ask)")
            for name in action.witnesses:
                witness = links[name]
                if witness.state == "idle":
                    self.open(witness)  # its answer comes to a later question
                ask = [encode_header(self._endpoint,
                                     Probe(ASK, next(witness.seq), about=action.peer).to_wire())]
                sock = witness.live if witness.live is not None else witness.dealer
                if sock is not None:
                    sock.try_send(ask)
        elif isinstance(action, Refuted):
            log.info("peer %s spoke again after %.1fs of silence: no longer suspected",
                     action.peer, action.silent_s)
        elif isinstance(action, Stalled):
            # Longer than a peer waits, and the peer may have given up on us, with the
            # connection we made to it still standing and its messages queued here
            # saying all is well: nothing else would tell us.
            for link in links.values():
                if link.state == "up":
                    log.warning("this daemon did not run for %.1fs (stopped?): peer %s "
                                "may have given up on it", action.stalled_s, link.name)
                    self.drop_link(link)
        elif isinstance(action, Verdict):
            link = links[action.peer]
            if link.state != "up":
                return
            link.lost_why = action.describe(self._endpoint)
            if action.kind == "unreachable":
                self._counters.add("peer_unreachable")
            # Where our messages still reach it (a one-way cut), the peer hears why,
            # and ends the link on its side with our words.
            cut = [encode_header(self._endpoint, Probe(
                CUT, next(link.seq), why=link.lost_why[:MAX_WHY]).to_wire())]
            for sock in (link.live, link.dealer):
                if sock is not None:
                    sock.try_send(cut)
            if action.kind == "lost":
                self.drop_link(link)
            else:
                asyncio.get_running_loop().call_later(_CUT_NOTICE_S, self._drop_if_up, link)

    def _drop_if_up(self, link: Link) -> None:
        if link.state == "up" and not self._closed():
            self.drop_link(link)

    def declared_by(self, link: Link, why: str) -> None:
        """The link's peer declared this daemon lost or unreachable (a CUT), while we
        still hear it: the network between us is cut one way.  End the link too."""
        if link.state != "up":
            return
        link.lost_why = f"it no longer hears {self._endpoint}: {why}"
        self._counters.add("peer_unreachable")
        self.drop_link(link)

    def drop_link(self, link: Link) -> None:
        """Declare a link lost ourselves, and connect afresh (it comes up again, and
        its jobs can re-form, once the peer answers a new handshake)."""
        self.mark_lost(link)
        if link.dealer is not None and not self._closed():
            for sock in (link.dealer, link.live):
                if sock is not None:
                    with contextlib.suppress(zmq.ZMQError):
                        sock.sock.disconnect(link.name)
            # Not at once: the peer's router must be rid of our old connection first.
            # Without ROUTER_HANDOVER it refuses a newcomer under a routing id still in
            # use, and keeps it, heartbeats and all: up for us, deaf to what we send.
            asyncio.get_running_loop().call_later(
                _RECONNECT_IVL_MAX_MS / 1000, self._connect_again, link)

    def _connect_again(self, link: Link) -> None:
        if link.dealer is not None and not self._closed():
            for sock in (link.dealer, link.live):
                if sock is not None:
                    sock.sock.connect(link.name)

    def mark_up(self, link: Link) -> None:
        if link.state == "up":
            return
        link.state = "up"
        link.leaving = False
        link.last_heard = time.monotonic()  # its answer to `confirm` just came
        link.down = asyncio.get_running_loop().create_future()
        link.watched = False
        self._watch(link, None)
        log.info("peer %s is up", link.name)
        self._on_up(link)

    def mark_lost(self, link: Link) -> None:
        """The link is lost: `link.lost_why` says why if the detector decided."""
        link.state = "lost"
        link.watched = False
        self.detector.forget(link.name)
        self._counters.add("peer_lost")
        if link.leaving:
            log.info("peer %s left: it shut down", link.name)
        else:
            link.lost_why = link.lost_why or "its connection closed"
            log.warning("peer %s lost: %s", link.name, link.lost_why)
        self._on_lost(link)
        link.lost_why = None
