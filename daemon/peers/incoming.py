"""Receiving on the peer links: check each message, answer probes, hand the rest on.

Messages arrive four ways: on the ROUTER, from a peer's DEALER (who sent
it is checked by routing id and, under CURVE, by key: `link_table.py`); on a
DEALER, the answers to our own probes (which carry a peer's offer of a data
stream); on its `live` DEALER, the answers to our heartbeats and questions
(`health.py`); and over the data streams (`data_plane.py`).  The link health
hears of each message, whatever it is.  Anything malformed or
from a stranger is counted and dropped here, never raised; the link probes
are answered at once, and the accepted application messages go to the
events' `message`, in order per peer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import zmq

from gradsync.daemon.core.interfaces import PlacedPayload
from gradsync.daemon.peers.data_plane import DataPlane
from gradsync.daemon.peers.events import PeerEvents, PeerMessage
from gradsync.daemon.peers.health import LIVE_ID_SUFFIX, Link, LinkHealth
from gradsync.daemon.peers.link_counters import LinkCounters
from gradsync.daemon.peers.link_table import LinkTable
from gradsync.daemon.peers.socket_io import LoopSocket
from gradsync.daemon.peers.wire import (
    ASK,
    BULK,
    BYE,
    CUT,
    MAX_PAYLOAD_FRAMES,
    PING,
    PONG,
    decode_header,
    encode_header,
)
from gradsync.protocol.codec import Message
from gradsync.protocol.errors import ProtocolError, VersionMismatchError
from gradsync.protocol.peer import Probe

log = logging.getLogger("gradsync.daemon.peers")


class IncomingMessages:
    """What one daemon's peer links do with each message that reaches them."""

    def __init__(
        self,
        table: LinkTable,
        counters: LinkCounters,
        events: PeerEvents,
        health: LinkHealth,
        *,
        kinds: frozenset[str],
        stream_kinds: frozenset[str],
        place_min_bytes: int,
        closed: Callable[[], bool],
    ) -> None:
        """`kinds` are the application kinds accepted, `stream_kinds` those
        accepted over a data stream; only stream messages of at least
        `place_min_bytes` are offered to the events' `place`; `closed()` says
        whether the links are closing (no data stream offers taken then);
        `health` hears of every message, and answers questions about peers."""
        self._table = table
        self._links = table.links
        self._counters = counters
        self._events = events
        self._health = health
        self._endpoint = table.endpoint
        self._accepted = kinds | {PING, BULK, BYE, ASK, CUT}
        self._stream_kinds = stream_kinds
        self._place_min_bytes = place_min_bytes
        self._closed = closed
        self._router: LoopSocket | None = None
        self._data: DataPlane | None = None
        #: Per peer, the stream message whose header `on_stream_head` decoded.
        self._stream_heads: dict[str, tuple[bytes, Message]] = {}

    def attach(self, router: LoopSocket, data: DataPlane | None) -> None:
        """The ROUTER that probes are answered on, and the data streams if any."""
        self._router = router
        self._data = data

    def on_router_frames(self, frames: list[zmq.Frame]) -> None:
        """One message on the ROUTER: answer a probe, or hand the message on."""
        message = self._accept(frames)
        if message is None:
            return
        self._health.heard(self._links[message.peer])
        kind = message.header["kind"]
        if kind == BYE:
            # Its links and streams are about to close: that is a goodbye, not a loss.
            self._links[message.peer].leaving = True
            log.info("peer %s is shutting down", message.peer)
        if kind == CUT:
            try:
                why = Probe.from_wire(message.header).why
            except ProtocolError as exc:
                self._refused(self._links[message.peer], exc)
                return
            assert why is not None
            self._health.declared_by(self._links[message.peer], why)
            return
        if kind == ASK or (kind == PING and frames[0].bytes.endswith(LIVE_ID_SUFFIX)):
            # A heartbeat, or a question about a peer: answered on its own path, at
            # once, and small (no data stream offer).
            assert self._router is not None
            about = message.header.get("about") if kind == ASK else None
            heard_s = None
            if isinstance(about, str):
                heard_s = self._health.witness_age_s(about)
            answer = Probe(PONG, message.header["seq"], about=about,
                           heard_s=None if heard_s is None else min(heard_s, 999.0))
            self._router.try_send([frames[0], encode_header(self._endpoint, answer.to_wire())])
            return
        if kind in (PING, BULK, BYE):
            assert self._router is not None
            answer = Probe(PONG, message.header["seq"])
            if self._data is not None:
                # Over CURVE the answer reaches this peer alone, encrypted: it carries
                # our offer of a sealed stream to it (stream_crypto.py).
                answer = Probe(PONG, answer.seq, **self._data.advert(message.peer))
            pong = encode_header(self._endpoint, answer.to_wire())
            # A probe answer that does not fit is dropped, never waited for.
            self._router.try_send([frames[0], pong])
            return
        self._deliver(message)

    def _deliver(self, message: PeerMessage) -> None:
        """Hand an accepted application message to the events."""
        self._counters.add("received")
        self._events.message(message)

    def _accept(self, frames: list[zmq.Frame]) -> PeerMessage | None:
        """Check one message from the ROUTER; count and drop it if it is bad."""
        peer = self._table.sender(frames) if len(frames) >= 2 else None
        if peer is None:
            label = frames[0].bytes.decode("utf-8", errors="replace")[:80]
            self._counters.drop("unknown_peer", label, "sender is not one of our peers")
            return None
        if len(frames) - 2 > MAX_PAYLOAD_FRAMES:
            self._counters.drop("malformed", peer, f"{len(frames) - 2} payload frames")
            return None
        try:
            header = decode_header(frames[1].bytes, self._accepted)
            if header["src"].encode() not in (frames[0].bytes,
                                               frames[0].bytes.removesuffix(LIVE_ID_SUFFIX)):
                raise ProtocolError(f"'src' {header['src'][:80]!r} is not the sender's id")
        except (ProtocolError, ValueError, TypeError) as exc:
            self._refused(self._links[peer], exc)
            return None
        self._links[peer].version_error = None
        return PeerMessage(peer, header, frames[2:])

    def _refused(self, link: Link, exc: Exception) -> None:
        """Count and drop a malformed message from `link`'s peer; one in another
        protocol version is also kept on the link, for `gradsync doctor`."""
        if isinstance(exc, VersionMismatchError):
            link.version_error = str(exc)
        self._counters.drop("malformed", link.name, str(exc))

    def _stream_header(self, name: str, body: bytes) -> Message:
        """A data stream message's header, checked; raises ProtocolError and co."""
        header = decode_header(body, self._stream_kinds)
        if header["src"] != name:
            raise ProtocolError(f"'src' {header['src'][:80]!r} is not the stream's sender")
        return header

    def on_stream_head(
        self, peer: str, name: str, body: bytes, sizes: list[int]
    ) -> Sequence[PlacedPayload | None] | None:
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

    def on_stream_message(
        self, peer: str, name: str, body: bytes, payloads: list[memoryview | PlacedPayload]
    ) -> None:
        """One message from a data stream (`name`: the sender, as its hello said)."""
        decoded = self._stream_heads.pop(peer, None)
        try:
            header = (decoded[1] if decoded is not None and decoded[0] is body
                      else self._stream_header(name, body))
        except (ProtocolError, ValueError, TypeError) as exc:
            self._counters.drop("malformed", peer, str(exc))
            return
        self._health.heard(self._links[peer])
        self._counters.add("stream_received")
        if self._data is not None and self._data.sealed:
            self._counters.add("stream_encrypted_received")
        self._deliver(PeerMessage(peer, header, list(payloads)))

    def _pong(self, link: Link, frames: list[zmq.Frame]) -> tuple[Message, Probe] | None:
        """A PONG from `link`'s peer (its header and probe), counted as heard from
        it; None (refused, counted) when malformed."""
        try:
            header = decode_header(frames[0].bytes, frozenset({PONG}))
            if len(frames) != 1:
                raise ProtocolError("a pong carries no payload")
            pong = Probe.from_wire(header)
        except ProtocolError as exc:
            self._refused(link, exc)
            return None
        self._health.heard(link)
        return header, pong

    def on_dealer_frames(self, link: Link, frames: list[zmq.Frame]) -> None:
        """An answer to one of our probes, back over the link's DEALER."""
        decoded = self._pong(link, frames)
        if decoded is None:
            return
        header, pong = decoded
        link.version_error = None
        if pong.data_port is not None:
            link.data_address = f"{pong.data_host or link.endpoint.host}:{pong.data_port}"
        if self._data is not None and link.state == "up" and not self._closed():
            self._data.offer(link.name, link.endpoint.host, header)
        waiter = link.pongs.pop(pong.seq, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_live_frames(self, link: Link, frames: list[zmq.Frame]) -> None:
        """An answer on the link's `live` DEALER: to a heartbeat, or to a question
        about a suspect (`about`, `heard_s`)."""
        decoded = self._pong(link, frames)
        if decoded is None:
            return
        _, pong = decoded
        link.live_heard = link.last_heard or 0.0
        if pong.about is not None:
            self._health.witness_said(link, pong.about, pong.heard_s)
