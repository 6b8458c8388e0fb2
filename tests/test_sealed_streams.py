"""Sealed data streams of CURVE links (AEAD, keys agreed over CURVE), on 127.0.0.1.

With CURVE keys the stream kinds take data streams as on insecure links, but
sealed: they arrive intact (placed or not) and the counters say they went
encrypted.  The cipher is AES-256-GCM where both ends run it fast, else
ChaCha20-Poly1305 (forced here through the data planes' `cipher`).  A man in
the middle (a relay on 127.0.0.1 between two data planes) sees no plaintext; a
byte it flips, a record it plays twice, a recorded stream played again and a
hello from someone without the offer are refused and counted, and nothing that
failed authentication reaches a sink.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cluster import free_ports
from peer_events import Events
from test_data_streams import KINDS, STREAM, Sink, close_all, start_streaming
from test_peer_links import FAST, READY_S, keys, poll, run  # noqa: F401 (keys: a fixture)

from gradsync.daemon.core.interfaces import PlacedPayload
from gradsync.daemon.peers import CurveConfig, LinkSettings, PeerLinks
from gradsync.daemon.peers.data_plane import DataPlane
from gradsync.daemon.peers.endpoints import parse_tcp_endpoint
from gradsync.daemon.peers.stream import SEALED_MAGIC, encode_hello, message_head
from gradsync.daemon.peers.stream_crypto import (
    AES_GCM,
    CHACHA,
    HELLO_SECRET_BYTES,
    LENGTH,
    TAG_BYTES,
    has_aes_instructions,
    take_offer,
)
from gradsync.daemon.peers.wire import encode_header

pytestmark = pytest.mark.timeout(60)


def endpoints(count: int) -> list[str]:
    return [f"tcp://127.0.0.1:{port}" for port in free_ports(count)]


@pytest.mark.parametrize("count", [2, 3])
def test_curve_links_send_stream_kinds_over_sealed_streams(
    count: int, keys: Callable[[list[str]], list[CurveConfig]]  # noqa: F811 (the fixture)
) -> None:
    """Every size (empty, one byte, record boundaries, several records) arrives
    intact and in order, placed into sinks or into fresh buffers; the
    counters show each went over an encrypted stream, none over ZeroMQ."""
    names = endpoints(count)
    sizes = [0, 1, 4096, 100_003, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 3 << 20]
    placed: list[Sink] = []

    def on_place(peer: str, header: dict[str, Any], lengths: list[int]) -> list[Sink | None]:
        if header["seq"] % 2:
            return [None, None]
        sink = Sink(lengths[0])
        placed.append(sink)
        return [sink, None]

    async def main() -> None:
        events = [Events(on_place) for _ in names]
        links = await start_streaming(names, events, keys(names))
        try:
            rng = np.random.default_rng(7)
            sent: dict[tuple[str, str], list[bytes]] = {}
            for sender in links:
                for peer in sender.peers:
                    sent[sender.endpoint, peer] = []
                    for seq, size in enumerate(sizes):
                        data = rng.integers(0, 256, size, dtype=np.uint8)
                        sender.send_nowait(peer, {"kind": "chunk", "seq": seq}, [data, b"t"])
                        sent[sender.endpoint, peer].append(data.tobytes())
                    await sender.send(peer, {"kind": "note", "seq": -1})  # over ZeroMQ
            for receiver, inbox in zip(links, events, strict=True):
                got: dict[str, list[bytes]] = {peer: [] for peer in receiver.peers}
                notes = 0
                while notes < count - 1 or any(len(g) < len(sizes) for g in got.values()):
                    message = await inbox.next()
                    if message.header["kind"] == "note":
                        notes += 1
                        continue
                    first, tail = message.payloads
                    data = bytes(first.data) if isinstance(first, Sink) else bytes(first)
                    assert message.header["seq"] == len(got[message.peer])
                    assert bytes(tail) == b"t"
                    got[message.peer].append(data)
                for peer in receiver.peers:
                    assert got[peer] == sent[peer, receiver.endpoint]
                streamed = len(sizes) * (count - 1)
                counters = receiver.counters
                assert counters["stream_sent"] == counters["stream_encrypted_sent"] == streamed
                assert counters["stream_received"] == streamed
                assert counters["stream_encrypted_received"] == streamed
                assert counters["sent"] == streamed + count - 1  # the notes took ZeroMQ
                assert counters["stream_auth_failed"] == counters["stream_failed"] == 0
                assert counters["malformed"] == 0
            assert placed and all(sink.remaining == 0 for sink in placed)
        finally:
            await close_all(links)

    run(main(), timeout_s=50)


# -- a man in the middle: two data planes and a relay -----------------------------


class Relay:
    """Forwards one direction of TCP connections (127.0.0.1) and keeps a copy.

    Once the hello (`hello_bytes` long) is through, it cuts the rest into
    records and hands each to `alter(index, record)`, which returns what goes on
    (several records, one changed, or none)."""

    def __init__(
        self, target_port: int, hello_bytes: int,
        alter: Callable[[int, bytes], list[bytes]] = lambda index, record: [record],
    ) -> None:
        self.target_port = target_port
        self.hello_bytes = hello_bytes
        self.alter = alter
        self.capture = bytearray()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        back, out = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def close_when_target_closes() -> None:
            with contextlib.suppress(ConnectionError):
                await back.read()  # streams are one way: only the end comes back
            writer.close()

        watcher = asyncio.create_task(close_when_target_closes())
        try:
            hello = await reader.readexactly(self.hello_bytes)
            self.capture += hello
            out.write(hello)
            index = 0
            while True:
                length = await reader.readexactly(LENGTH.size)
                (size,) = LENGTH.unpack(length)
                record = length + await reader.readexactly(size + TAG_BYTES)
                self.capture += record
                for piece in self.alter(index, record):
                    out.write(piece)
                await out.drain()
                index += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            out.close()
            writer.close()
            watcher.cancel()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class Plane:
    """One side of the man-in-the-middle tests: a sealed data plane and what it heard."""

    def __init__(self, name: str, peer: str, place: Callable[..., Any] | None = None,
                 cipher: str = AES_GCM) -> None:
        self.name = name
        self.messages: list[tuple[dict[str, Any], list[Any]]] = []
        self.counted: list[tuple[str, str]] = []
        self.broken: list[tuple[str, str]] = []
        self.plane = DataPlane(
            asyncio.get_running_loop(), parse_tcp_endpoint(name), name=name,
            identify=lambda hello: peer if hello == peer else None,
            on_message=lambda peer, _, header, payloads: self.messages.append(
                (header, payloads)),
            on_event=lambda counter, who, why: self.counted.append((counter, who)),
            on_broken=lambda who, why: self.broken.append((who, why)),
            on_head=place, limits=(1 << 20, 64, 1 << 30), connect_timeout_s=5.0, sealed=True,
            cipher=cipher,
        )
        self.plane.start()

    def count(self, counter: str) -> int:
        return sum(1 for name, _ in self.counted if name == counter)


def hello_size(name: str) -> int:
    return len(encode_hello(name, b"x" * HELLO_SECRET_BYTES, SEALED_MAGIC))


async def through_relay(
    alter: Callable[[int, bytes], list[bytes]] | None = None,
    place: Callable[..., Any] | None = None,
    ciphers: tuple[str, str] = (AES_GCM, AES_GCM),
) -> tuple[Plane, Plane, Relay]:
    """Plane a opens its sealed stream to plane b through a relay; returns (a, b, relay).
    `ciphers`: the ones a and b run fast."""
    name_a, name_b = endpoints(2)
    a, b = Plane(name_a, name_b, cipher=ciphers[0]), Plane(name_b, name_a, place, ciphers[1])
    advert = b.plane.advert(name_a)
    relay = Relay(advert["data_port"], hello_size(name_a),
                  *(() if alter is None else (alter,)))
    await relay.start()
    a.plane.offer(name_b, "127.0.0.1", {**advert, "data_port": relay.port})
    await poll(lambda: a.plane.sender(name_b) is not None, READY_S, "a's stream to open")
    return a, b, relay


async def close_planes(*parts: Plane | Relay) -> None:
    for part in parts:
        if isinstance(part, Relay):
            await part.close()
        else:
            await part.plane.close(ConnectionError("test over"))


def send(a: Plane, b: Plane, seq: int, data: np.ndarray) -> asyncio.Future[None]:
    sender = a.plane.sender(b.name)
    assert sender is not None
    header = encode_header(a.name, {"kind": "chunk", "seq": seq})
    return sender.send(message_head(header, [data.nbytes]), [data.data])


def test_a_captured_stream_holds_none_of_the_plaintext() -> None:
    async def main() -> None:
        a, b, relay = await through_relay()
        try:
            data = np.frombuffer(os.urandom(3 << 20), np.uint8)
            await send(a, b, 0, data)
            await poll(lambda: len(b.messages) == 1, READY_S, "the message")
            _, (payload,) = b.messages[0]
            assert bytes(payload) == data.tobytes()
            capture = bytes(relay.capture)
            assert len(capture) > data.nbytes
            raw = data.tobytes()
            for start in range(0, data.nbytes - 32, 65_521):
                assert raw[start : start + 32] not in capture
            assert b"chunk" not in capture and a.name.encode() in capture  # the hello's name
            assert b.plane.advert(a.name)["data_token"] not in capture
            assert a.count("stream_auth_failed") == b.count("stream_auth_failed") == 0
        finally:
            await close_planes(a, b, relay)

    run(main())


@pytest.mark.parametrize(("fast", "chosen"), [
    ((AES_GCM, AES_GCM), AES_GCM), ((AES_GCM, CHACHA), CHACHA), ((CHACHA, AES_GCM), CHACHA),
    ((CHACHA, CHACHA), CHACHA),
], ids=["both-aes", "receiver-chacha", "sender-chacha", "both-chacha"])
def test_the_cipher_is_aes_only_where_both_ends_run_it_fast(
    fast: tuple[str, str], chosen: str
) -> None:
    """Each offer names the cipher its daemon runs fast; the stream is AES-256-GCM
    only where both name it, and its data arrives intact with either cipher."""
    async def main() -> None:
        a, b, relay = await through_relay(ciphers=fast)
        try:
            assert b.plane.advert(a.name)["data_cipher"] == fast[1]
            sender = a.plane.sender(b.name)
            assert sender is not None and sender.cipher == chosen
            data = np.frombuffer(os.urandom(1 << 20), np.uint8)
            await send(a, b, 0, data)
            await poll(lambda: len(b.messages) == 1, READY_S, "the message")
            assert bytes(b.messages[0][1][0]) == data.tobytes()
            assert data.tobytes()[:64] not in bytes(relay.capture)
            assert b.count("stream_auth_failed") == 0
        finally:
            await close_planes(a, b, relay)

    run(main())


def test_aes_instructions_are_read_from_cpuinfo(tmp_path: Path) -> None:
    """x86 names them among its flags, ARMv8 among its features; no file: none."""
    cases = {"flags\t\t: fpu sse2 aes avx2\n": True, "flags\t\t: fpu sse2 avx2\n": False,
             "Features\t: fp asimd aes pmull sha1\n": True, "processor\t: 0\n": False}
    for index, (text, expected) in enumerate(cases.items()):
        path = tmp_path / f"cpuinfo{index}"
        path.write_text("processor\t: 0\n" + text)
        assert has_aes_instructions(str(path)) is expected, text
    assert not has_aes_instructions(str(tmp_path / "missing"))


def test_aes_against_an_offer_that_did_not_allow_it_is_refused() -> None:
    """A hello that chose AES-256-GCM from an offer naming ChaCha20-Poly1305 (say,
    altered on the way, or a peer not following the rule) is refused and counted,
    even with the right proof."""
    async def main() -> None:
        name_a, name_b = endpoints(2)
        b = Plane(name_b, name_a, cipher=CHACHA)
        try:
            advert = b.plane.advert(name_a)
            secret, _ = take_offer(name_a, advert["data_token"], advert["data_key"], AES_GCM)
            hello = encode_hello(name_a, secret, SEALED_MAGIC)
            assert await asyncio.to_thread(raw_connect, advert["data_port"], hello)
            await poll(lambda: b.count("stream_auth_failed") == 1, READY_S, "the refusal")
            # The same offer, with the cipher it allows: accepted.
            secret, _ = take_offer(name_a, advert["data_token"], advert["data_key"], CHACHA)
            with socket.create_connection(("127.0.0.1", advert["data_port"])) as sock:
                sock.sendall(encode_hello(name_a, secret, SEALED_MAGIC))
                await poll(lambda: b.plane.advert(name_a)["data_key"] != advert["data_key"],
                           READY_S, "the offer to be used up")
            assert b.count("stream_auth_failed") == 1
        finally:
            await close_planes(b)

    run(main())


@pytest.mark.parametrize("cipher", [AES_GCM, CHACHA])
def test_a_flipped_byte_fails_the_stream_naming_the_peer_and_writes_nothing(
    cipher: str,
) -> None:
    """The relay flips one ciphertext byte of the payload's first record: the
    receiver counts it, reports the stream broken naming the sender, and the
    placed sink is never written; a new stream then carries data again."""
    sinks: list[Sink] = []

    def place(peer: str, name: str, header: bytes, sizes: list[int]) -> list[PlacedPayload]:
        sink = Sink(sizes[0])
        sinks.append(sink)
        return [sink]

    def flip(index: int, record: bytes) -> list[bytes]:
        if index != 1:  # record 0: the message's head; record 1: the payload starts
            return [record]
        changed = bytearray(record)
        changed[100] ^= 0x01
        return [bytes(changed)]

    async def main() -> None:
        a, b, relay = await through_relay(flip, place, (cipher, cipher))
        try:
            sender = a.plane.sender(b.name)
            assert sender is not None and sender.cipher == cipher
            data = np.full(2 << 20, 7, np.uint8)
            send(a, b, 0, data)
            await poll(lambda: b.broken, READY_S, "b to report the broken stream")
            assert b.broken[0][0] == a.name and "failed authentication" in b.broken[0][1]
            assert b.count("stream_auth_failed") == 1 and not b.messages
            assert len(sinks) == 1 and sinks[0].remaining == data.nbytes
            assert not any(sinks[0].data)  # nothing reached the sink
            await poll(lambda: a.plane.sender(b.name) is None, READY_S, "a to see it close")
            # b keeps serving: a fresh offer, a direct stream, the data arrives.
            a.plane.offer(b.name, "127.0.0.1", b.plane.advert(a.name))
            await poll(lambda: a.plane.sender(b.name) is not None, READY_S, "a new stream")
            await send(a, b, 1, data)
            await poll(lambda: b.messages, READY_S, "the message over the new stream")
            (payload,) = b.messages[0][1]
            assert payload is sinks[-1] and bytes(sinks[-1].data) == data.tobytes()
        finally:
            await close_planes(a, b, relay)

    run(main())


def test_a_replayed_record_is_refused_and_counted() -> None:
    async def main() -> None:
        a, b, relay = await through_relay(
            lambda index, record: [record, record] if index == 1 else [record])
        try:
            data = np.arange(1 << 20, dtype=np.uint8)
            send(a, b, 0, data)
            send(a, b, 1, data)
            await poll(lambda: b.broken, READY_S, "b to refuse the replayed record")
            assert b.broken[0][0] == a.name and "failed authentication" in b.broken[0][1]
            assert b.count("stream_auth_failed") == 1
            assert len(b.messages) <= 1  # at most the first message, intact
            for _, (payload,) in b.messages:
                assert bytes(payload) == data.tobytes()
        finally:
            await close_planes(a, b, relay)

    run(main())


def raw_connect(port: int, data: bytes) -> bool:
    """Send `data` to a data port; True once the daemon closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=READY_S) as sock:
        sock.sendall(data)
        try:
            return sock.recv(1) == b""
        except ConnectionResetError:
            return True


def test_a_replayed_stream_and_a_hello_without_the_offer_are_refused() -> None:
    """A whole recorded stream, played again, meets a used-up offer; a daemon
    that never got the offer (over CURVE) can only guess the proof; a plain
    (insecure) hello is not a sealed one.  All are refused and counted."""
    async def main() -> None:
        a, b, relay = await through_relay()
        try:
            data = np.arange(1 << 16, dtype=np.uint8)
            await send(a, b, 0, data)
            await poll(lambda: len(b.messages) == 1, READY_S, "the message")
            advert = b.plane.advert(a.name)
            port, token = advert["data_port"], advert["data_token"]
            recorded = bytes(relay.capture)
            stranger = encode_hello(a.name, os.urandom(HELLO_SECRET_BYTES), SEALED_MAGIC)
            for attempt in (recorded, stranger, encode_hello(a.name, token)):
                assert await asyncio.to_thread(raw_connect, port, attempt)
            await poll(lambda: b.count("stream_auth_failed") == 2, READY_S,
                       "the refusals to be counted")
            assert b.count("stream_refused") == 1  # the plain hello
            assert len(b.messages) == 1 and not b.broken
        finally:
            with contextlib.suppress(Exception):
                await close_planes(a, b, relay)

    run(main())


def test_unauthorised_key_gets_no_offer_and_no_stream(
    keys: Callable[[list[str]], list[CurveConfig]],  # noqa: F811 (the fixture)
) -> None:
    """A daemon whose key is not authorised never gets through CURVE, so it never
    learns an offer: its guesses at the data port are refused and counted."""
    names = endpoints(2)

    async def main() -> None:
        configs = keys(names)
        events = Events()
        a = PeerLinks(LinkSettings(
            names[0], names, configs[0], kinds=KINDS, stream_kinds=STREAM, **FAST,
        ), events=events)
        await a.start()
        try:
            port = a.data_port
            assert port is not None
            guess = encode_hello(names[1], os.urandom(HELLO_SECRET_BYTES), SEALED_MAGIC)
            assert await asyncio.to_thread(raw_connect, port, guess)
            await poll(lambda: a.counters["stream_auth_failed"] == 1, READY_S, "the refusal")
            assert a.counters["stream_received"] == 0 and events.messages.empty()
        finally:
            await a.close()

    run(main())
