"""Plain-TCP data streams of insecure peer links, over real sockets on 127.0.0.1.

The stream kinds must take the streams once they are open (sealed streams of
CURVE links: test_sealed_streams.py), arrive intact and in order, leave the caller's buffer
alone only once written, fail instead of hanging when the peer is lost, and
refuse whatever is not a peer's stream, without disturbing the links.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import subprocess
import sys
import time
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio
from cluster import free_ports
from peer_events import Events
from test_peer_links import FAST, READY_S, TESTS, poll, run

from gradsync.daemon.core.interfaces import PlacedPayload
from gradsync.daemon.peers import CurveConfig, LinkSettings, PeerLinks
from gradsync.daemon.peers.stream import encode_hello, message_head
from gradsync.protocol.errors import PeerLostError
from gradsync.protocol.peer import PEER_PROTOCOL_VERSION

pytestmark = pytest.mark.timeout(60)

KINDS = ("chunk", "note")
STREAM = ("chunk",)


def endpoints(count: int) -> list[str]:
    return [f"tcp://127.0.0.1:{port}" for port in free_ports(count)]


async def start_streaming(
    names: list[str], events: list[Events], configs: list[CurveConfig] | None = None,
    **options: Any,
) -> list[PeerLinks]:
    """Links with "chunk" on streams (insecure ones, or with `configs` CURVE ones and
    sealed streams); returns once every stream is open."""
    curve: list[CurveConfig | None] = [None] * len(names) if configs is None else [*configs]
    links = [
        PeerLinks(LinkSettings(
            name, names, config, insecure=config is None, kinds=KINDS, stream_kinds=STREAM,
            **{**FAST, **options},
        ), events=inbox)
        for name, config, inbox in zip(names, curve, events, strict=True)
    ]
    for link in links:
        await link.start()
    for link in links:
        await link.wait_up(READY_S)
    await poll(lambda: all(link.stream_open(peer) for link in links for peer in link.peers),
               READY_S, "the data streams to open")
    return links


async def close_all(links: list[PeerLinks]) -> None:
    for link in links:
        await link.close()


def test_stream_kinds_take_the_streams_intact_and_in_order() -> None:
    names = endpoints(3)

    async def main() -> None:
        events = [Events() for _ in names]
        links = await start_streaming(names, events)
        try:
            rng = np.random.default_rng(5)
            sent: dict[tuple[str, str], list[bytes]] = {}
            for sender in links:
                for peer in sender.peers:
                    sent[sender.endpoint, peer] = []
                    for seq in range(40):
                        size = int(rng.choice([0, 1, 4096, 100_003, 3 << 20]))
                        data = rng.integers(0, 256, size, dtype=np.uint8)
                        payloads = [data, np.frombuffer(b"", np.uint8), b"tail%d" % seq]
                        sender.send_nowait(peer, {"kind": "chunk", "seq": seq}, payloads)
                        sent[sender.endpoint, peer].append(data.tobytes())
                    await sender.send(peer, {"kind": "note", "last": True}, [b"zmq"])
            for receiver, inbox in zip(links, events, strict=True):
                seen: dict[str, int] = dict.fromkeys(receiver.peers, 0)
                notes = 0
                while notes < len(receiver.peers) or any(n < 40 for n in seen.values()):
                    message = await inbox.next()
                    if message.header["kind"] == "note":
                        notes += 1
                        assert message.header["src"] == message.peer
                        assert isinstance(message.frames[0], zmq.Frame)  # over ZeroMQ
                        continue
                    seq = seen[message.peer]
                    assert message.header == {"v": PEER_PROTOCOL_VERSION, "src": message.peer,
                                              "kind": "chunk", "seq": seq}
                    data, empty, tail = message.payloads
                    assert isinstance(message.frames[0], memoryview)  # over the stream
                    assert bytes(data) == sent[message.peer, receiver.endpoint][seq]
                    assert bytes(empty) == b"" and bytes(tail) == b"tail%d" % seq
                    seen[message.peer] = seq + 1
                assert receiver.counters["stream_received"] == 40 * len(receiver.peers)
                assert receiver.counters["stream_sent"] == 40 * len(receiver.peers)
                for counter in ("malformed", "stream_failed", "stream_refused", "unknown_peer"):
                    assert receiver.counters[counter] == 0, counter
        finally:
            await close_all(links)

    run(main(), timeout_s=50)


class Sink(PlacedPayload):
    """A placed payload's destination, filled through small windows."""

    def __init__(self, size: int) -> None:
        self.data = bytearray(size)
        self.remaining = size
        self.windows = 0

    def window(self) -> memoryview:
        self.windows += 1
        start = len(self.data) - self.remaining
        return memoryview(self.data)[start : start + 65_536]

    def advance(self, count: int) -> None:
        self.remaining -= count

    def absorb(self, data: memoryview) -> int:
        return 0


def test_placed_payloads_are_read_into_their_sinks() -> None:
    """`place` sees a stream message's header before its payloads; the
    payloads it places land in its sinks (the message carries the sinks), the
    others in fresh buffers, and messages it declines arrive as usual.  Small
    messages (below `place_min_bytes`, 64 KiB) are not offered at all."""
    placed: dict[int, list[Sink | None]] = {}
    asked: list[tuple[str, int, list[int]]] = []

    def on_place(peer: str, header: dict[str, Any], sizes: list[int]) -> list[Sink | None] | None:
        asked.append((peer, header["seq"], sizes))
        if header["seq"] % 3 == 2:
            return None  # declined: fresh buffers
        placed[header["seq"]] = [Sink(sizes[0]), None]
        return placed[header["seq"]]

    async def main() -> None:
        events = [Events(on_place), Events(on_place)]
        a, b = await start_streaming(endpoints(2), events)
        try:
            rng = np.random.default_rng(3)
            sent = []
            for seq in range(12):
                data = rng.integers(0, 256, int(rng.choice([1, 70_000, 1 << 20])), np.uint8)
                a.send_nowait(b.endpoint, {"kind": "chunk", "seq": seq}, [data, b"tail"])
                sent.append(data.tobytes())
            for seq in range(12):
                message = await events[1].next()
                assert message.header["seq"] == seq
                first, tail = message.frames
                assert isinstance(tail, memoryview) and bytes(tail) == b"tail"
                if seq % 3 == 2 or seq not in placed:
                    assert isinstance(first, memoryview) and bytes(first) == sent[seq]
                    continue
                assert first is placed[seq][0]
                assert first.remaining == 0 and bytes(first.data) == sent[seq]
                assert first.windows >= len(sent[seq]) // 65_536
            offered = [seq for seq in range(12) if len(sent[seq]) + 4 >= 64 * 1024]
            assert 0 < len(offered) < 12
            assert asked == [(a.endpoint, seq, [len(sent[seq]), 4]) for seq in offered]
            assert placed and set(placed) == {seq for seq in offered if seq % 3 != 2}
            assert b.counters["malformed"] == b.counters["stream_failed"] == 0
        finally:
            await close_all([a, b])

    run(main())


class BrokenSink(Sink):
    """A sink whose consumer fails part-way (a bug on the receiving side)."""

    def advance(self, count: int) -> None:
        super().advance(count)
        raise RuntimeError("the sink broke")


def test_a_stream_that_breaks_mid_message_is_reported_and_the_link_goes_on() -> None:
    """A failure while a payload is being read closes that stream only: both
    ends report it through `stream_broken` (a slice may be lost), the event
    loop and the ZeroMQ link carry on, and later messages still arrive."""
    breaking = [True]

    def on_place(peer: str, header: dict[str, Any], sizes: list[int]) -> list[Sink | None]:
        if breaking[0]:
            breaking[0] = False
            return [BrokenSink(sizes[0])]
        return [Sink(sizes[0])]

    async def main() -> None:
        names = endpoints(2)
        events_a, events_b = events = [Events(), Events(on_place)]
        links = [
            PeerLinks(LinkSettings(
                name, names, insecure=True, kinds=KINDS, stream_kinds=STREAM, **FAST,
            ), events=inbox)
            for name, inbox in zip(names, events, strict=True)
        ]
        a, b = links
        try:
            for link in links:
                await link.start()
            for link in links:
                await link.wait_up(READY_S)
            await poll(lambda: a.stream_open(b.endpoint), READY_S, "a's stream to b")
            first = np.ones(1 << 20, np.uint8)
            a.send_nowait(b.endpoint, {"kind": "chunk", "seq": 0}, [first])
            await poll(lambda: a.endpoint in dict(events_b.broken), READY_S,
                       "b to report the broken stream from a")
            await poll(lambda: b.endpoint in dict(events_a.broken), READY_S,
                       "a to report its broken stream to b")
            assert "from it" in dict(events_b.broken)[a.endpoint]
            assert "to it" in dict(events_a.broken)[b.endpoint]
            assert a.peer_state(b.endpoint) == b.peer_state(a.endpoint) == "up"
            data = np.arange(1 << 20, dtype=np.uint8)
            a.send_nowait(b.endpoint, {"kind": "chunk", "seq": 1}, [data])
            message = await events_b.next(READY_S)
            assert message.header["seq"] == 1
            (payload,) = message.frames
            got = bytes(payload.data) if isinstance(payload, Sink) else bytes(payload)
            assert got == data.tobytes()
            assert b.counters["stream_failed"] >= 1
        finally:
            await close_all(links)

    run(main())


def test_a_stream_send_keeps_the_buffer_until_the_kernel_has_it() -> None:
    async def main() -> None:
        events = [Events(), Events()]
        a, b = await start_streaming(endpoints(2), events)
        try:
            data = np.full(48 << 20, 7, dtype=np.uint8)  # more than the socket buffers hold
            written = a.send_nowait(b.endpoint, {"kind": "chunk"}, [data])
            assert not written.done()  # b has not read yet: the rest waits in order
            await a.send(b.endpoint, {"kind": "chunk", "second": True}, [data[:10]])
            assert written.done() and written.result() is None
            data[:] = 0
            first, second = await events[1].next(), await events[1].next()
            assert np.all(np.frombuffer(first.payloads[0], np.uint8) == 7)
            assert "second" in second.header and bytes(second.payloads[0]) == b"\7" * 10
        finally:
            await close_all([a, b])

    run(main())


def test_no_stream_kinds_means_no_streams() -> None:
    async def main() -> None:
        names = endpoints(2)
        plain = PeerLinks(LinkSettings(
            names[0], names, insecure=True, kinds=KINDS, **FAST,
        ), events=Events())
        await plain.start()
        try:
            assert plain.data_port is None and not plain.stream_open(names[1])
        finally:
            await plain.close()

    run(main())


def pong_fields(names: list[str]) -> dict[str, Any]:
    """What any host that reaches an insecure daemon learns from one probe."""
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.rcvtimeo = int(READY_S * 1000)
        dealer.routing_id = names[1].encode()
        dealer.connect(names[0])
        ping = {"v": PEER_PROTOCOL_VERSION, "kind": "link.ping", "src": names[1], "seq": 1}
        dealer.send(msgpack.packb(ping))
        return dict(msgpack.unpackb(dealer.recv(), raw=False))
    finally:
        context.destroy(linger=0)


def raw_stream(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=READY_S)
    sock.sendall(data)
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(READY_S)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    finally:
        sock.close()


def test_bad_streams_are_refused_without_disturbing_the_links() -> None:
    names = endpoints(2)

    def header(**fields: Any) -> bytes:
        base = {"v": PEER_PROTOCOL_VERSION, "kind": "chunk", "src": names[1]}
        return msgpack.packb({**base, **fields})

    async def main() -> None:
        events = Events()
        a = PeerLinks(LinkSettings(
            names[0], names, insecure=True, kinds=KINDS, stream_kinds=STREAM, **FAST,
        ), events=events)
        await a.start()
        try:
            fields = await asyncio.to_thread(pong_fields, names)
            port, token = fields["data_port"], fields["data_token"]
            assert port == a.data_port and isinstance(token, bytes)
            refused = [
                b"HTTP/1.1 GET /\r\n\r\n",  # not our magic
                encode_hello(names[1], b"wrong token"),
                encode_hello("tcp://127.0.0.1:9", token),  # a stranger, right token
            ]
            for data in refused:
                assert await asyncio.to_thread(closed_by_peer, raw_stream(port, data))
            await poll(lambda: a.counters["stream_refused"] == len(refused), READY_S,
                       "the refusals to be counted")
            # An impostor with the token: bad messages are dropped, oversize ones end it.
            hello = encode_hello(names[1], token)
            good = header(seq=1)
            messages = [
                message_head(header(src=names[0]), [3]) + b"abc",  # src is not the sender
                message_head(b"\xc1 not msgpack", []),
                message_head(header(kind="note"), []),  # not a stream kind
                message_head(good, [4]) + b"data",
            ]
            impostor = await asyncio.to_thread(raw_stream, port, hello + b"".join(messages))
            message = await events.next()
            assert message.header["seq"] == 1 and bytes(message.payloads[0]) == b"data"
            assert a.counters["malformed"] == 3
            impostor.sendall(struct.pack("!IH", 1 << 30, 0))  # a 1 GiB header
            assert await asyncio.to_thread(closed_by_peer, impostor)
            await poll(lambda: a.counters["stream_failed"] == 1, READY_S, "the broken stream")
            # The real peer still gets through, over ZeroMQ and then its own stream.
            b = PeerLinks(LinkSettings(
                names[1], names, insecure=True, kinds=KINDS, stream_kinds=STREAM, **FAST,
            ), events=Events())
            await b.start()
            try:
                await b.wait_up(READY_S)
                await poll(lambda: b.stream_open(names[0]), READY_S, "b's stream")
                await b.send(names[0], {"kind": "chunk", "seq": 2}, [b"real"])
                message = await events.next()
                assert message.header["seq"] == 2 and bytes(message.payloads[0]) == b"real"
                assert b.counters["stream_sent"] == 1
            finally:
                await b.close()
        finally:
            await a.close()

    run(main(), timeout_s=50)


CHILD = """
import asyncio, json, sys
sys.path.insert(0, sys.argv[4])
from gradsync.daemon.peers import CurveConfig, LinkSettings, PeerLinks
from peer_events import Events

async def main():
    links = PeerLinks(LinkSettings(sys.argv[1], json.loads(sys.argv[2]), insecure=True,
                                   kinds=["chunk", "note"], stream_kinds=["chunk"],
                                   peer_timeout_s=float(sys.argv[3]), probe_bytes=0,
                                   probe_rounds=1),
                      events=Events())
    await links.start()
    print("started", flush=True)
    await asyncio.Event().wait()  # until killed

asyncio.run(main())
"""


def test_stream_sends_waiting_for_a_lost_peer_fail_instead_of_hanging() -> None:
    """A stopped peer stops reading: sends back up behind the kernel's buffers,
    and fail with PeerLostError once the peer is declared lost."""
    import json

    peer_timeout_s = 1.0
    names = endpoints(2)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, names[1], json.dumps(names), str(peer_timeout_s), TESTS],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )

    async def main() -> None:
        links = PeerLinks(LinkSettings(
            names[0], names, insecure=True, kinds=KINDS, stream_kinds=STREAM,
            peer_timeout_s=peer_timeout_s, probe_bytes=0, probe_rounds=1,
        ), events=Events())
        await links.start()
        try:
            await links.wait_up(READY_S)
            await poll(lambda: links.stream_open(names[1]), READY_S, "the stream")
            child.send_signal(19)  # SIGSTOP
            data = np.zeros(4 << 20, dtype=np.uint8)
            waiting = [links.send_nowait(names[1], {"kind": "chunk"}, [data]) for _ in range(40)]
            assert not waiting[-1].done()
            started = time.monotonic()
            results = await asyncio.gather(*waiting, return_exceptions=True)
            assert time.monotonic() - started < peer_timeout_s + 5
            failed = [r for r in results if isinstance(r, PeerLostError)]
            assert failed and all(r is None or isinstance(r, PeerLostError) for r in results)
            assert names[1] in str(failed[0])
            assert not links.stream_open(names[1])
        finally:
            await links.close()

    try:
        run(main(), timeout_s=40)
    finally:
        child.send_signal(18)  # SIGCONT
        child.kill()
        child.communicate(timeout=10)
