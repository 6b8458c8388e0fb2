"""Link health: noticing that a peer came up, died or stopped answering.

ZMTP heartbeats run on every connection: a DEALER pings every
`heartbeat_ivl_s` and drops the connection when nothing came back for
`peer_timeout_s - heartbeat_ivl_s` after a ping, so a peer killed, stopped or
cut off is noticed within `peer_timeout_s` (a killed one at once: its kernel
closes the TCP connection).  A monitor on each DEALER turns handshake success
into state `up` and disconnection into `lost`.  The heartbeats are answered
by the peer's ZeroMQ I/O thread, so they prove that the peer's process and
network are alive, not that its event loop is: per-step deadlines of the
collectives cover a peer that is alive but stuck.

Besides ZeroMQ's heartbeats (invisible to us), each DEALER sends a small PING
every `liveness_ivl_s` (at most one second) while its link is up, answered by
the peer's router: `heard_age_s` is the time since anything last came from
the peer, so it also shows a peer whose event loop has stopped; a peer silent
for longer than `peer_timeout_s` is dropped and connected afresh.

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
from collections.abc import Callable, Iterator
from typing import Any, Literal

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gradsync.daemon.peers.endpoints import TcpEndpoint
from gradsync.daemon.peers.link_counters import LinkCounters
from gradsync.daemon.peers.probe import LinkStats
from gradsync.daemon.peers.socket_io import LoopSocket
from gradsync.daemon.peers.wire import PING, encode_header
from gradsync.protocol.peer import Probe

log = logging.getLogger("gradsync.daemon.peers")

PeerState = Literal["connecting", "up", "lost"]

_RECONNECT_IVL_MS = 100
_RECONNECT_IVL_MAX_MS = 1000
_MAX_TTL_MS = 6_553_500  # the ZMTP PING carries the TTL in deciseconds, 16 bits
_MAX_LIVENESS_IVL_S = 1.0
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
    #: The peer said goodbye (it is shutting down): its link ending is no failure.
    leaving: bool = False
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
    """Watches the links of one daemon: monitor events, liveness pings, up and lost."""

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
    ) -> None:
        """`endpoint`: this daemon's name on the pings; `counters`: the links'
        (`handshake_failed` and `peer_lost` are counted here); `on_up(link)` and
        `on_lost(link)` follow each change of state; `closed()` says whether the
        links are closing (no reconnecting then)."""
        self._endpoint = endpoint
        self._peer_timeout_s = peer_timeout_s
        self._heartbeat_ivl_s = heartbeat_ivl_s
        self._liveness_ivl_s = min(heartbeat_ivl_s, _MAX_LIVENESS_IVL_S)
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

    def heard_age_s(self, link: Link) -> float | None:
        """Seconds since anything last came from the link's peer (None: nothing yet)."""
        last = link.last_heard
        return None if last is None else time.monotonic() - last

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

    async def keep_alive(self, link: Link) -> None:
        """Ping the peer every `liveness_ivl_s` while the link is up.

        Sent without blocking (a ping that does not fit in the queue is skipped)
        and answered by the peer's router; the answer only refreshes
        `last_heard`, so no waiter is kept.
        """
        assert link.dealer is not None
        # A peer's heartbeats drop us after this much silence following one of their
        # pings (and fail the collectives we share); never below two of our ticks.
        given_up_s = max(self._peer_timeout_s - self._heartbeat_ivl_s, 2 * self._liveness_ivl_s)
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(self._liveness_ivl_s)
            now = time.monotonic()
            # The longest this daemon may not have run (SIGSTOP, a frozen VM): since the
            # last tick, not beyond the sleep, which would miss up to one sleep of it.
            # Longer than a peer waits, and the peer may have given up on us, with the
            # connection we made to it still standing (its own heartbeats' phase) and its
            # messages queued here saying all is well: nothing else would tell us.
            stalled_s = now - last_tick
            last_tick = now
            if link.state != "up":
                continue
            if stalled_s > given_up_s:
                log.warning("this daemon did not run for up to %.1fs (stopped?): peer %s "
                            "may have given up on it", stalled_s, link.name)
                self.drop_link(link)
                continue
            # ZeroMQ's own heartbeats cannot get out behind a full send queue on a cut
            # link: our pings' answers (and anything else the peer sends) are the test.
            heard_s = now - link.last_heard if link.last_heard is not None else 0.0
            if heard_s > self._peer_timeout_s:
                log.warning("peer %s silent for %.1fs (peer timeout %gs)", link.name,
                            heard_s, self._peer_timeout_s)
                self.drop_link(link)
                continue
            header = encode_header(self._endpoint, Probe(PING, next(link.seq)).to_wire())
            link.dealer.try_send([header])

    def drop_link(self, link: Link) -> None:
        """Declare a link lost ourselves, and connect afresh (it comes up again, and
        its jobs can re-form, once the peer answers a new handshake)."""
        self.mark_lost(link)
        if link.dealer is not None and not self._closed():
            with contextlib.suppress(zmq.ZMQError):
                link.dealer.sock.disconnect(link.name)
            # Not at once: the peer's router must be rid of our old connection first.
            # Without ROUTER_HANDOVER it refuses a newcomer under a routing id still in
            # use, and keeps it, heartbeats and all: up for us, deaf to what we send.
            asyncio.get_running_loop().call_later(
                _RECONNECT_IVL_MAX_MS / 1000, self._connect_again, link)

    def _connect_again(self, link: Link) -> None:
        if link.dealer is not None and not self._closed():
            link.dealer.sock.connect(link.name)

    def mark_up(self, link: Link) -> None:
        if link.state == "up":
            return
        link.state = "up"
        link.leaving = False
        link.last_heard = time.monotonic()  # its answer to `confirm` just came
        link.down = asyncio.get_running_loop().create_future()
        log.info("peer %s is up", link.name)
        self._on_up(link)

    def mark_lost(self, link: Link) -> None:
        link.state = "lost"
        self._counters.add("peer_lost")
        if link.leaving:
            log.info("peer %s left: it shut down", link.name)
        else:
            log.warning(
                "peer %s lost: connection closed or silent for %gs", link.name,
                self._peer_timeout_s,
            )
        self._on_lost(link)
