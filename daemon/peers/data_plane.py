"""The data streams of one daemon's peer links: listen, connect, route.

Each daemon listens on a TCP port on its peer address (`data_port`, or an
ephemeral one) and advertises the port and a random token in its answers to
link probes (the ZeroMQ link carries them); where peers reach it through a NAT
or port forward, it advertises that address instead (`data_advertise`: host
and port, and a peer connects to that host rather than the link's).  A daemon
that hears them opens one stream to that peer, says hello with its own
endpoint name and the token, and from then on sends the stream kinds (the
collectives' slices) over it.  On insecure links the token only proves that
the connecting side talked to this daemon over its ZeroMQ link; like the rest
of `--insecure`, it is not authentication.

On CURVE links (`sealed`) the advertisement is an offer made to one peer alone
(a token, an X25519 key and a cipher, over CURVE), the hello carries a key and a proof
instead of the token, a hello that does not match the offer is refused and
counted (`stream_auth_failed`), and everything after it is AEAD records
(`stream_crypto.py`): AES-256-GCM where both daemons' CPUs have AES
instructions, ChaCha20-Poly1305 where either lacks them.  Each accepted hello
uses its offer up: the peer gets a new one for its next stream.  A record that
fails authentication ends its stream, is counted, and is reported like any
break that lost data.

While a checkpoint replica's chunk is queued on a stream, its socket keeps at
most `NOTSENT_LOWAT_BYTES` unsent in the kernel (TCP_NOTSENT_LOWAT, Linux): the
rest waits in the stream's own queue (`stream.py`, which sends again once the
socket is writable), so that a collective's slice queued behind the chunk waits
for that much, not for a send buffer of several MB, while the congestion window
stays full.  Otherwise the kernel's own limit holds: kept low all the time, it
cost a 2-daemon allreduce on 127.0.0.1 a fifth of its speed at 64 MiB.

A stream that breaks is dropped and reopened on the next advertisement; sends
that were waiting on it fail, and `on_broken(peer, why)` reports the break of
any stream to or from a peer that may have lost data (a send, or a message
cut short), so that the jobs spanning that peer fail at once (as on a lost
peer) instead of at their deadlines.  Until the stream is back, slices go over the
ZeroMQ link.  When the ZeroMQ link is lost, the streams to and from that peer
are closed too (the link's loss is reported by the links themselves).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Callable, Sequence
from typing import Any

from gradsync.daemon.core.interfaces import PlacedPayload
from gradsync.daemon.peers.endpoints import TcpEndpoint
from gradsync.daemon.peers.link_counters import Counter
from gradsync.daemon.peers.stream import (
    MAGIC,
    SEALED_MAGIC,
    StreamError,
    StreamReceiver,
    StreamSender,
    encode_hello,
    limit_unsent,
)
from gradsync.daemon.peers.stream_crypto import (
    CIPHER_TITLES,
    KEY_BYTES,
    Offer,
    StreamAuthError,
    choose_cipher,
    fast_cipher,
    take_offer,
)
from gradsync.protocol.codec import is_integer

log = logging.getLogger("gradsync.daemon.peers")

#: Connections that have not said hello yet, at most.
_MAX_UNIDENTIFIED = 64
#: Bytes a data stream's socket keeps unsent in the kernel, at most: a slice queued
#: behind a checkpoint replica waits for this much, not for a whole send buffer
#: (several MB), while the congestion window stays full.
NOTSENT_LOWAT_BYTES = 128 * 1024


class DataPlane:
    """Listener, outgoing streams (one per peer) and incoming streams of a daemon."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        listen: TcpEndpoint,
        *,
        name: str,
        identify: Callable[[str], str | None],
        on_message: Callable[[str, str, bytes, list[memoryview | PlacedPayload]], None],
        on_event: Callable[[Counter, str, str], None],
        on_broken: Callable[[str, str], None],
        limits: tuple[int, int, int],
        connect_timeout_s: float,
        dead_after_s: float = 10.0,
        on_head: Callable[
            [str, str, bytes, list[int]], Sequence[PlacedPayload | None] | None
        ] | None = None,
        sealed: bool = False,
        cipher: str | None = None,
        port: int = 0,
        advertise: TcpEndpoint | None = None,
    ) -> None:
        """`identify(name)` maps a hello's endpoint name to a peer (None: a stranger);
        `on_message(peer, name, header, payloads)` gets each received message;
        `on_head(peer, name, header, sizes)` may place its payloads (see
        `StreamReceiver`); `on_event(counter, peer, reason)` counts and reports
        refusals and breaks; `on_broken(peer, why)` is told of a break that may
        have lost data (see the module docstring).  `sealed`: streams are
        encrypted and authenticated (CURVE links; see the module docstring);
        `cipher` is the one this daemon runs fast, which its offers name (one of
        STREAM_CIPHERS; None: `fast_cipher()`, by the CPU's AES instructions).
        The listener takes `port` (0: any free one); peers are told to connect to
        `advertise` if given, else to the link's host at that port."""
        self._loop = loop
        self._listen = listen
        self._name = name
        self._identify = identify
        self._on_message = on_message
        self._on_head = on_head
        self._on_event = on_event
        self._on_broken = on_broken
        self._limits = limits
        self._connect_timeout_s = connect_timeout_s
        self._dead_after_s = dead_after_s
        self.token = secrets.token_bytes(16)
        #: The port we listen on (once started; asked for: `port`, 0 for any).
        self.port = port
        self._advertise = advertise
        self._listener: socket.socket | None = None
        self._senders: dict[str, StreamSender] = {}
        self._connecting: dict[str, asyncio.Task[None]] = {}
        self._receivers: set[StreamReceiver] = set()
        self._closed = False
        self.sealed = sealed
        #: Sealed: per peer, the offer its next stream must match.
        self._offers: dict[str, Offer] = {}
        self.cipher = fast_cipher() if cipher is None else cipher
        if self.cipher not in CIPHER_TITLES:
            raise ValueError(f"unknown stream cipher {cipher!r}")

    def start(self) -> None:
        """Listen on the port of the peer address; raises OSError if it cannot."""
        host = self._listen.host
        family = socket.AF_INET6 if self._listen.is_ipv6 else socket.AF_INET
        if self._listen.is_wildcard:
            host = "::" if family == socket.AF_INET6 else "0.0.0.0"
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            # A fixed port (`data_port`) is free again at once after a restart.
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, self.port))
            listener.listen(64)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._loop.add_reader(listener.fileno(), self._accept)

    def advert(self, peer: str) -> dict[str, Any]:
        """The fields of a probe answer to `peer` that say where our streams listen:
        `data_port`, `data_token`, `data_host` where we advertise another address,
        and (sealed) our offer to it, `data_key` and `data_cipher` (protocol/peer.py,
        Probe)."""
        where: dict[str, Any] = {"data_port": self.port}
        if self._advertise is not None:
            where = {"data_port": self._advertise.port, "data_host": self._advertise.host}
        if not self.sealed:
            return {**where, "data_token": self.token}
        offer = self._offers.get(peer)
        if offer is None:
            offer = self._offers[peer] = Offer(self.cipher)
        return {**where, "data_token": offer.token, "data_key": offer.public,
                "data_cipher": offer.cipher}

    def sender(self, peer: str) -> StreamSender | None:
        """The open stream to `peer`, if any."""
        return self._senders.get(peer)

    def offer(self, peer: str, host: str, fields: dict[str, Any]) -> None:
        """A peer advertised its stream port: connect, unless already done or under way
        (to `host`, the link's, unless the peer advertised a `data_host`)."""
        port, token = fields.get("data_port"), fields.get("data_token")
        advertised = fields.get("data_host")
        if isinstance(advertised, str) and advertised:
            host = advertised
        if not is_integer(port) or not 0 < port < 65536:
            return
        if not isinstance(token, bytes) or not 0 < len(token) < 256:
            return
        key, theirs = fields.get("data_key"), fields.get("data_cipher")
        sealing = None
        if self.sealed:
            if not (isinstance(key, bytes) and len(key) == KEY_BYTES
                    and isinstance(theirs, str) and theirs in CIPHER_TITLES):
                return  # no offer: an insecure peer
            sealing = (key, choose_cipher(self.cipher, theirs))
        if (self._closed or peer in self._senders or peer in self._connecting
                or self._listener is None):
            return
        self._connecting[peer] = self._loop.create_task(
            self._connect(peer, host, port, token, sealing), name=f"peer-stream {peer}",
        )

    async def _connect(
        self, peer: str, host: str, port: int, token: bytes,
        sealing: tuple[bytes, str] | None,
    ) -> None:
        """Open our stream to `peer`; `sealing`: the offer's key and the cipher."""
        sock: socket.socket | None = None
        try:
            sock = await self._open(host, port)
            if self._closed:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            bound_dead_connection(sock, self._dead_after_s)
            # Checked now, applied while checkpoint chunks are queued (StreamSender.send).
            lowat = limit_unsent(sock, NOTSENT_LOWAT_BYTES)
            if lowat is not None:
                limit_unsent(sock, 0)
            sealer = None
            hello = encode_hello(self._name, token)
            if sealing is not None:
                secret, sealer = take_offer(self._name, token, *sealing)
                hello = encode_hello(self._name, secret, SEALED_MAGIC)
            sender = StreamSender(sock, self._loop, self._broken, f"the stream to {peer}",
                                  sealer)
            sock = None  # the sender owns it now
            sender.unsent_limit = lowat
            self._senders[peer] = sender  # before the hello: a failing send unregisters it
            sender.send(hello, (), plain=True)
            if not sender.closed:
                log.info("data stream to %s open (port %d), %s, %s", peer, port,
                         "plaintext" if sealer is None else CIPHER_TITLES[sealer.cipher],
                         "unsent bytes unbounded" if lowat is None
                         else f"at most {lowat} bytes unsent in the kernel behind "
                         "checkpoint chunks")
        except (OSError, TimeoutError, ValueError) as exc:
            # asyncio's text ("Connect call failed ...") hides the reason; errno says it.
            why = (os.strerror(exc.errno) if isinstance(exc, OSError) and exc.errno
                   else str(exc) or type(exc).__name__)
            self._on_event("stream_failed", peer,
                           f"cannot open a data stream to {host}:{port}: {why}")
        finally:
            if sock is not None:
                sock.close()
            self._connecting.pop(peer, None)

    async def _open(self, host: str, port: int) -> socket.socket:
        """Connect to the first address of `host` that answers (like create_connection)."""
        infos = await self._loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        error: Exception = OSError(f"{host} has no address")
        for family, _, _, _, address in infos:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await asyncio.wait_for(
                    self._loop.sock_connect(sock, address), self._connect_timeout_s
                )
                return sock
            except (OSError, TimeoutError) as exc:
                sock.close()
                error = exc
            except BaseException:
                sock.close()
                raise
        raise error

    def _broken(self, sender: StreamSender, exc: Exception) -> None:
        for peer, open_sender in list(self._senders.items()):
            if open_sender is sender:
                del self._senders[peer]
                self._on_event("stream_failed", peer, f"data stream broke: {exc}")
                if sender.sends > 1:  # more than the hello: a slice may be lost
                    self._on_broken(peer, f"the data stream to it broke: {exc}")

    def drop(self, peer: str, exc: Exception) -> None:
        """The link to `peer` went down: close our streams to and from it (waiting
        sends fail with `exc`); nothing more is reported."""
        task = self._connecting.pop(peer, None)
        if task is not None:
            task.cancel()
        sender = self._senders.pop(peer, None)
        if sender is not None:
            sender.close(exc)
        # A new link period, new keys: the old offer is forgotten.
        self._offers.pop(peer, None)
        for receiver in list(self._receivers):
            if receiver.peer == peer:
                receiver.close(None)

    # -- incoming -----------------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, address = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.warning("accepting a data stream failed: %s", exc)
            return
        unidentified = sum(1 for r in self._receivers if r.peer is None)
        if unidentified >= _MAX_UNIDENTIFIED:
            sock.close()
            self._on_event("stream_refused", str(address[0]), "too many streams without hello")
            return
        with contextlib.suppress(OSError):
            bound_dead_connection(sock, self._dead_after_s)
        max_header, max_payloads, max_payload = self._limits
        receiver = StreamReceiver(
            sock, self._loop, max_header_bytes=max_header, max_payloads=max_payloads,
            max_payload_bytes=max_payload,
            on_hello=lambda name, token: self._hello(receiver, name, token),
            on_message=self._received, on_closed=self._stream_closed,
            on_head=self._head if self._on_head is not None else None,
            magic=SEALED_MAGIC if self.sealed else MAGIC,
        )
        self._receivers.add(receiver)
        # A connection that never says hello is closed, not kept.
        self._loop.call_later(self._connect_timeout_s, self._expire, receiver)

    def _expire(self, receiver: StreamReceiver) -> None:
        if receiver.peer is None and not receiver.closed:
            receiver.close(StreamError(f"no hello within {self._connect_timeout_s:g}s"))

    def _hello(self, receiver: StreamReceiver, name: str, token: bytes) -> str:
        if not self.sealed and not secrets.compare_digest(token, self.token):
            raise StreamError(f"wrong token from {name[:80]!r}")
        peer = self._identify(name)
        if peer is None:
            raise StreamError(f"{name[:80]!r} is not one of our peers")
        if self.sealed:
            offer = self._offers.get(peer)
            if offer is None:
                raise StreamAuthError(f"no offer was made to {name[:80]!r}")
            receiver.open_records(offer.accept(name, token))  # raises StreamAuthError
            self._offers[peer] = Offer(self.cipher)  # this one is used up
        for other in list(self._receivers):
            if other is not receiver and other.peer == peer:
                # The peer reconnected: its old stream is dead (and lost data if cut short).
                other.close(StreamError("replaced by a new stream from the same peer")
                            if other.mid_message else None)
        return peer

    def _head(
        self, receiver: StreamReceiver, header: bytes, sizes: list[int]
    ) -> Sequence[PlacedPayload | None] | None:
        assert self._on_head is not None and receiver.peer is not None
        assert receiver.name is not None
        return self._on_head(receiver.peer, receiver.name, header, sizes)

    def _received(
        self, receiver: StreamReceiver, header: bytes, payloads: list[memoryview | PlacedPayload]
    ) -> None:
        assert receiver.peer is not None and receiver.name is not None
        self._on_message(receiver.peer, receiver.name, header, payloads)

    def _stream_closed(self, receiver: StreamReceiver, exc: Exception | None) -> None:
        self._receivers.discard(receiver)
        if exc is not None:
            label = receiver.peer or "a stranger"
            counter: Counter = "stream_refused" if receiver.peer is None else "stream_failed"
            if isinstance(exc, StreamAuthError):
                counter = "stream_auth_failed"
            self._on_event(counter, label, f"incoming data stream closed: {exc}")
            if receiver.peer is not None and not self._closed:
                why = ("failed authentication" if isinstance(exc, StreamAuthError)
                       else "broke")
                self._on_broken(receiver.peer, f"the data stream from it {why}: {exc}")

    async def close(self, exc: Exception) -> None:
        """Close everything; waiting sends fail with `exc`."""
        self._closed = True
        tasks = list(self._connecting.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sender in list(self._senders.values()):
            sender.close(exc)
        self._senders.clear()
        for receiver in list(self._receivers):
            receiver.close(None)
        if self._listener is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None


def bound_dead_connection(sock: socket.socket, dead_after_s: float) -> None:
    """Have the kernel give up on a TCP connection the other end stopped answering.

    TCP_USER_TIMEOUT bounds how long sent data may stay unacknowledged (a cut
    link with a full send queue would otherwise retransmit for many minutes);
    keepalive probes find a dead connection that has nothing to send.
    """
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, round(dead_after_s / 2))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, round(idle / 3)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, round(dead_after_s * 1000)))

