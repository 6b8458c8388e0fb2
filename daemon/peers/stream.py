"""TCP data streams between peer daemons: bulk payloads without ZeroMQ.

The collectives' slices travel over one TCP connection per direction and peer
instead of the ZeroMQ DEALER: in the clear on `--insecure` links, sealed in
AEAD records on CURVE links (`stream_crypto.py`).  Measured on
this project's 2-core machine, a ring exchange of 16 MiB between four
processes moved 0.78 to 0.95 GB/s per node over non-blocking sockets driven
from one thread, against 0.55 to 0.67 through pyzmq: ZeroMQ hands every
message to its I/O thread and back, and on CPU-bound nodes those thread
switches cost more than the copies.  ZeroMQ keeps everything else (probes,
heartbeats, control messages).

Wire format (all integers big-endian):

* hello, once, from the connecting side: `b"GSD1"`, name length (1 byte),
  token length (1 byte), the sender's endpoint name, the token the receiver
  advertised over the ZeroMQ link;
* then messages: header length (4 bytes), payload count (2 bytes), the
  msgpack header, one 8-byte length per payload, the payloads.

A sealed stream (CURVE links) says hello with `b"GSE2"`, and its "token" is
the cipher the sender chose, its X25519 public key and proof
(`stream_crypto.py`); after the hello, the same messages travel cut into
AEAD records (AES-256-GCM or ChaCha20-Poly1305).  The sender seals
records of at most 1 MiB from the caller's buffers into one reused buffer as
the socket takes them; the receiver opens each record, once its tag is in, into
a fresh payload buffer directly, or into a scratch buffer that the
`PlacedPayload` absorbs (a reduction combines it from there) or that is copied
into the sink: bytes that failed authentication never reach a sink.

A stream carries data one way: the receiver never writes, the sender reads
only to notice the end of the connection.  Sends go out from the caller's
buffers (no copy) as far as the kernel takes them; the rest waits, in order,
until the socket is writable, and each send's future completes once its last
byte is with the kernel.  Payloads are received into fresh buffers, or, when
the receiver's `on_head` places them, straight where they belong (a
`PlacedPayload`: the collective's own buffer, or a small reused chunk that is
reduced into it as it fills), which saves a copy and keeps the data in cache.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import struct
import sys
from collections.abc import Callable, Sequence

import numpy as np

from gradsync.daemon.core.interfaces import PlacedPayload
from gradsync.daemon.peers.stream_crypto import (
    LENGTH,
    RECORD_BYTES,
    RECORD_OVERHEAD,
    TAG_BYTES,
    RecordOpener,
    RecordSealer,
    StreamAuthError,
)

log = logging.getLogger("gradsync.daemon.peers")

MAGIC = b"GSD1"
SEALED_MAGIC = b"GSE2"
_HELLO = struct.Struct("!4sBB")
_PREFIX = struct.Struct("!IH")
_LENGTH = struct.Struct("!Q")
#: Bytes read per readiness callback before other callbacks get a turn.
READ_BUDGET = 8 * 1024 * 1024
#: Buffers handed to one sendmsg() call (below every platform's IOV_MAX).
_MAX_IOV = 512
#: TCP_NOTSENT_LOWAT (Linux's 25 where the socket module does not name it; None:
#: not there).
TCP_NOTSENT_LOWAT: int | None = getattr(
    socket, "TCP_NOTSENT_LOWAT", 25 if sys.platform.startswith("linux") else None)


class StreamError(Exception):
    """The other end broke the stream's format or limits."""


def limit_unsent(sock: socket.socket, nbytes: int) -> int | None:
    """Have the kernel keep at most about `nbytes` of the socket's data unsent
    (TCP_NOTSENT_LOWAT; 0: the kernel's own limit): the socket reads as writable,
    and takes more, only once fewer are left, so what is queued behind a bulk send
    waits for little.  The value read back, or None where the option is not there
    (not Linux) or the socket refused it."""
    if TCP_NOTSENT_LOWAT is None:
        return None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, nbytes)
        return sock.getsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT)
    except (OSError, OverflowError):
        return None


def encode_hello(name: str, token: bytes, magic: bytes = MAGIC) -> bytes:
    """The connecting side's first bytes: who it is and the token it was given
    (on a sealed stream, `SEALED_MAGIC` and its key and proof)."""
    encoded = name.encode()
    if not 0 < len(encoded) < 256 or not 0 < len(token) < 256:
        raise ValueError("stream hello: name and token must be 1 to 255 bytes")
    return _HELLO.pack(magic, len(encoded), len(token)) + encoded + token


def message_head(header: bytes, sizes: Sequence[int]) -> bytes:
    """Everything of a message before its payloads."""
    return b"".join(
        [_PREFIX.pack(len(header), len(sizes)), header, *(_LENGTH.pack(n) for n in sizes)]
    )


class StreamSender:
    """The sending end of one stream: ordered, zero-copy sends from the event loop."""

    def __init__(
        self,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        on_broken: Callable[[StreamSender, Exception], None],
        name: str,
        sealer: RecordSealer | None = None,
    ) -> None:
        """With a `sealer`, every message but those sent `plain` (the hello) goes
        out sealed in records."""
        sock.setblocking(False)
        self.sock = sock
        self.name = name
        self._loop = loop
        self._on_broken = on_broken
        self._queue: collections.deque[
            tuple[list[memoryview], asyncio.Future[None], bool]
        ] = collections.deque()
        self._sealer = sealer
        #: Sealed records not yet with the kernel (a view of `_sealed`).
        self._pending = memoryview(b"")
        self._sealed = (np.empty(2 * (RECORD_BYTES + RECORD_OVERHEAD), dtype=np.uint8).data
                        if sealer is not None else memoryview(b""))
        self._writing = False
        self.closed = False
        #: Messages queued so far (the hello included).
        self.sends = 0
        #: Bytes the kernel keeps unsent while a `bulk` message is queued (None: no
        #: limit, or none on this platform: data_plane.py sets it), and how many are.
        self.unsent_limit: int | None = None
        self._bulk = 0
        # Readable only when the receiver closed (or broke the protocol).
        loop.add_reader(sock.fileno(), self._on_readable)

    @property
    def sealed(self) -> bool:
        """Whether messages go out sealed (a CURVE link's stream)."""
        return self._sealer is not None

    @property
    def cipher(self) -> str | None:
        """The cipher that seals this stream (None: plaintext)."""
        return None if self._sealer is None else self._sealer.cipher

    def send(
        self, head: bytes, payloads: Sequence[memoryview], *, plain: bool = False,
        bulk: bool = False,
    ) -> asyncio.Future[None]:
        """Queue one message; the future completes once the kernel has all of it
        (sealed: once the kernel has the last record, so the payloads may change).

        While a `bulk` message (background data) is queued, the socket keeps at
        most `unsent_limit` bytes unsent in the kernel: what is queued behind it
        waits for that much, not for a send buffer of several MB.  Otherwise the
        kernel's own limit holds: a low one costs a collective's throughput.
        """
        done: asyncio.Future[None] = self._loop.create_future()
        if self.closed:
            done.set_exception(ConnectionError(f"{self.name} is closed"))
            return done
        self.sends += 1
        if bulk and self.unsent_limit is not None:
            self._bulk += 1
            if self._bulk == 1:
                self._limit_unsent(self.unsent_limit)
            done.add_done_callback(self._bulk_sent)
        views = [memoryview(head)]
        views += [view.cast("B") for view in payloads if view.nbytes]
        self._queue.append((views, done, self._sealer is not None and not plain))
        if len(self._queue) == 1:
            self._flush()
        return done

    def _bulk_sent(self, _: asyncio.Future[None]) -> None:
        self._bulk -= 1
        if self._bulk == 0:
            self._limit_unsent(0)  # 0: the kernel's own (net.ipv4.tcp_notsent_lowat)

    def _limit_unsent(self, nbytes: int) -> None:
        if not self.closed:  # a failure: the stream broke meanwhile, its own error says so
            limit_unsent(self.sock, nbytes)

    def _flush(self) -> None:
        while self._queue:
            views, done, seal = self._queue[0]
            if seal and not self._pending:
                self._pending = self._seal(views)
            try:
                sent = self.sock.sendmsg([self._pending] if seal else views[:_MAX_IOV])
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._break(exc)
                return
            if seal:
                self._pending = self._pending[sent:]
                if self._pending or views:
                    continue  # more of this message to seal or to send
                sent = 0
            while sent:
                first = views[0]
                if sent >= first.nbytes:
                    sent -= first.nbytes
                    views.pop(0)
                else:
                    views[0] = first[sent:]
                    sent = 0
            if views:
                continue  # the kernel took part: try again, it may take more
            self._queue.popleft()
            if not done.done():
                done.set_result(None)
        want = bool(self._queue)
        if want and not self._writing:
            self._loop.add_writer(self.sock.fileno(), self._flush)
        elif not want and self._writing:
            self._loop.remove_writer(self.sock.fileno())
        self._writing = want

    def _seal(self, views: list[memoryview]) -> memoryview:
        """Seal the next records of a message (consumed from `views`) into the
        reused buffer, as many as it holds: one send for several small ones."""
        assert self._sealer is not None
        buffer, used = self._sealed, 0
        while views:
            view = views[0]
            take = min(view.nbytes, RECORD_BYTES, buffer.nbytes - used - RECORD_OVERHEAD)
            # A record cut short by the buffer's end would only add records: seal
            # the rest next time, in full.
            if take <= 0 or (take < view.nbytes and take < RECORD_BYTES and used):
                break
            used += self._sealer.seal_into(view[:take], buffer[used:])
            if take == view.nbytes:
                views.pop(0)
            else:
                views[0] = view[take:]
        return buffer[:used]

    def _on_readable(self) -> None:
        try:
            data = self.sock.recv(1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._break(exc)
            return
        self._break(ConnectionResetError("the receiver closed the stream") if not data
                    else StreamError("the receiver wrote to a one-way stream"))

    def _break(self, exc: Exception) -> None:
        if self.closed:
            return
        self.close(exc)
        self._on_broken(self, exc)

    def close(self, exc: Exception) -> None:
        """Close the connection; sends not yet with the kernel fail with `exc`."""
        if self.closed:
            return
        self.closed = True
        fd = self.sock.fileno()
        self._loop.remove_reader(fd)
        if self._writing:
            self._loop.remove_writer(fd)
            self._writing = False
        self.sock.close()
        while self._queue:
            _, done, _ = self._queue.popleft()
            if not done.done():
                done.set_exception(exc)
                done.exception()  # retrieved: the caller may not be waiting


class StreamReceiver:
    """The receiving end of one stream: reads the hello, then message after message.

    `on_hello(name, token)` returns the peer the stream is from or raises
    `StreamError`; `on_message(receiver, header, payloads)` gets each message;
    `on_closed(receiver, error)` is called once, with None for a clean end
    between messages.  `on_head(receiver, header, sizes)`, if given, may return
    a sink (or None) per payload, once the header is in: a placed payload is
    read into its sink, and `on_message` gets the sink in its place.
    """

    def __init__(
        self,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        *,
        max_header_bytes: int,
        max_payloads: int,
        max_payload_bytes: int,
        on_hello: Callable[[str, bytes], str],
        on_message: Callable[[StreamReceiver, bytes, list[memoryview | PlacedPayload]], None],
        on_closed: Callable[[StreamReceiver, Exception | None], None],
        on_head: Callable[
            [StreamReceiver, bytes, list[int]], Sequence[PlacedPayload | None] | None
        ] | None = None,
        magic: bytes = MAGIC,
    ) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._magic = magic
        #: Set by `on_hello` on a sealed stream: everything after the hello is records.
        self._opener: RecordOpener | None = None
        self._record = memoryview(b"")
        self._record_got = 0
        self._record_len: int | None = None
        self._scratch = memoryview(b"")
        #: The sender's name as its hello gave it, and the peer that name is.
        self.name: str | None = None
        self.peer: str | None = None
        self._loop = loop
        self._limits = (max_header_bytes, max_payloads, max_payload_bytes)
        self._on_hello = on_hello
        self._on_message = on_message
        self._on_closed = on_closed
        self._on_head = on_head
        self._target: memoryview = memoryview(bytearray(_HELLO.size))
        self._got = 0
        self._stage: Callable[[], None] = self._hello_fixed
        self._name_len = 0
        self._header_len = 0
        self._header = b""
        self._sizes: list[int] = []
        self._payloads: list[memoryview | PlacedPayload] = []
        self._sinks: Sequence[PlacedPayload | None] | None = None
        #: The sink the current payload goes to (None: `_target`).
        self._sink: PlacedPayload | None = None
        self.closed = False
        loop.add_reader(sock.fileno(), self._on_readable)

    @property
    def mid_message(self) -> bool:
        """True once part of a message is in: closing now loses it."""
        return not (self._stage == self._prefix and self._got == 0 and self._record_got == 0)

    def open_records(self, opener: RecordOpener) -> None:
        """From the end of the hello on, read records and open them with `opener`
        (called by `on_hello` on a sealed stream)."""
        self._opener = opener
        self._record = np.empty(RECORD_BYTES + RECORD_OVERHEAD + LENGTH.size,
                                dtype=np.uint8).data
        self._scratch = np.empty(RECORD_BYTES, dtype=np.uint8).data

    def close(self, exc: Exception | None = None) -> None:
        """Close the connection and report it (once)."""
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self.sock.fileno())
        self.sock.close()
        self._on_closed(self, exc)

    def _on_readable(self) -> None:
        try:
            self._read()
        except Exception as exc:  # a callback's or a sink's bug: end this stream, not the loop
            log.exception("reading a data stream from %s failed", self.peer or "a stranger")
            self.close(exc)

    def _read(self) -> None:
        budget = READ_BUDGET
        while not self.closed and budget > 0:
            if self._opener is not None:
                self._read_records(budget)
                return
            sink = self._sink
            count = self._recv(self._target[self._got :] if sink is None else sink.window())
            if count is None:
                return
            budget -= count
            if self._took(sink, count):
                try:
                    self._stage()
                except (StreamError, StreamAuthError) as exc:
                    self.close(exc)
                    return

    def _recv(self, into: memoryview) -> int | None:
        """Read what the socket has into `into`; None: nothing now, or closed."""
        try:
            count = self.sock.recv_into(into)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            self.close(exc)
            return None
        if count == 0:
            self.close(StreamError("the stream ended mid-message") if self.mid_message
                       else None)
            return None
        return count

    def _took(self, sink: PlacedPayload | None, count: int) -> bool:
        """`count` bytes went into the target (None) or the sink: is it complete?"""
        if sink is None:
            self._got += count
            return self._got == self._target.nbytes
        sink.advance(count)
        return sink.remaining == 0

    def _read_records(self, budget: int) -> None:
        """Read records (each with the next one's length, if it is there) and open them."""
        record = self._record
        while not self.closed and budget > 0:
            size = self._record_len
            want = LENGTH.size if size is None else 2 * LENGTH.size + size + TAG_BYTES
            count = self._recv(record[self._record_got : want])
            if count is None:
                return
            budget -= count
            self._record_got += count
            try:
                self._open_complete_records()
            except (StreamError, StreamAuthError) as exc:
                self.close(exc)
                return

    def _open_complete_records(self) -> None:
        record = self._record
        while not self.closed:
            if self._record_len is None:
                if self._record_got < LENGTH.size:
                    return
                (size,) = LENGTH.unpack_from(record)
                if not 0 < size <= RECORD_BYTES:
                    raise StreamError(f"a record of {size} bytes (limit {RECORD_BYTES})")
                self._record_len = size
            size = self._record_len
            end = LENGTH.size + size + TAG_BYTES
            if self._record_got < end:
                return
            self._open(bytes(record[: LENGTH.size]), record[LENGTH.size : end], size)
            carry = self._record_got - end  # the start of the next record's length
            record[:carry] = record[end : end + carry]
            self._record_got, self._record_len = carry, None

    def _open(self, length: bytes, sealed: memoryview, size: int) -> None:
        """Open one record and feed its plaintext to the message stages."""
        assert self._opener is not None
        if self._sink is None and self._stage == self._payload and (
                self._target.nbytes - self._got >= size):
            # A fresh payload buffer is ours alone: open straight into it (a record
            # that fails leaves garbage in a buffer that is then dropped).
            self._opener.open_into(length, sealed, self._target[self._got : self._got + size])
            self._got += size
            if self._got == self._target.nbytes:
                self._stage()
            return
        plain = self._scratch[:size]
        self._opener.open_into(length, sealed, plain)
        self._consume(plain)

    def _consume(self, data: memoryview) -> None:
        """Hand authenticated plaintext to the message stages, as recv_into would."""
        while data.nbytes and not self.closed:
            sink = self._sink
            if sink is None:
                target = self._target[self._got :]
            else:
                taken = sink.absorb(data)
                if taken:
                    data = data[taken:]
                    if sink.remaining == 0:
                        self._stage()
                    continue
                target = sink.window()
                if target.format != "B":
                    target = target.cast("B")
            count = min(target.nbytes, data.nbytes)
            target[:count] = data[:count]
            data = data[count:]
            if self._took(sink, count):
                self._stage()

    def _expect(self, nbytes: int, stage: Callable[[], None]) -> None:
        self._target = memoryview(bytearray(nbytes))
        self._got = 0
        self._stage = stage

    def _hello_fixed(self) -> None:
        magic, name_len, token_len = _HELLO.unpack(self._target)
        if magic != self._magic or not name_len or not token_len:
            raise StreamError("not a gradsync data stream (bad hello)")
        self._expect(name_len + token_len, self._hello_body)
        self._name_len = name_len

    def _hello_body(self) -> None:
        body = bytes(self._target)
        try:
            name = body[: self._name_len].decode("utf-8")
        except UnicodeDecodeError:
            raise StreamError("the hello's name is not UTF-8") from None
        self.peer = self._on_hello(name, body[self._name_len :])
        self.name = name
        self._expect(_PREFIX.size, self._prefix)

    def _prefix(self) -> None:
        header_len, count = _PREFIX.unpack(self._target)
        max_header, max_payloads, _ = self._limits
        if not 0 < header_len <= max_header:
            raise StreamError(f"header of {header_len} bytes (limit {max_header})")
        if count > max_payloads:
            raise StreamError(f"{count} payloads (limit {max_payloads})")
        self._header_len = header_len
        self._expect(header_len + count * _LENGTH.size, self._head)

    def _head(self) -> None:
        head = bytes(self._target)
        self._header = head[: self._header_len]
        max_payload = self._limits[2]
        sizes = [n for (n,) in _LENGTH.iter_unpack(head[self._header_len :])]
        if any(n > max_payload for n in sizes):
            raise StreamError(f"a payload of {max(sizes)} bytes (limit {max_payload})")
        self._sizes = sizes
        self._payloads = []
        if self._on_head is not None:
            sinks = self._on_head(self, self._header, sizes)
            self._sinks = sinks if sinks is not None and len(sinks) == len(sizes) else None
        self._next_payload()

    def _next_payload(self) -> None:
        while len(self._payloads) < len(self._sizes):
            index = len(self._payloads)
            size = self._sizes[index]
            sink = self._sinks[index] if self._sinks is not None else None
            if size and sink is not None and sink.remaining == size:
                self._sink = sink
                self._stage = self._placed
                return
            if size:
                # numpy's empty(): uninitialised, unlike bytearray(size).
                self._target = np.empty(size, dtype=np.uint8).data
                self._got = 0
                self._stage = self._payload
                return
            self._payloads.append(memoryview(b""))
        payloads, self._payloads = self._payloads, []
        self._sinks = None
        self._expect(_PREFIX.size, self._prefix)
        self._on_message(self, self._header, payloads)

    def _payload(self) -> None:
        self._payloads.append(self._target)
        self._next_payload()

    def _placed(self) -> None:
        assert self._sink is not None
        self._payloads.append(self._sink)
        self._sink = None
        self._next_payload()
