"""Peer links over real TCP sockets on 127.0.0.1.

Several `PeerLinks` run in one event loop; the failure tests run one side in a
subprocess and SIGKILL or SIGSTOP it.  Readiness is awaited with deadlines
(`wait_up`, polling), never fixed sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio
from cluster import free_ports
from peer_events import Events

from gradsync.client.cli.keygen import generate_keypair
from gradsync.daemon.config import ConfigError
from gradsync.daemon.peers import (
    CurveConfig,
    KeyFileError,
    LinkSettings,
    PeerLinks,
    PeerMessage,
    load_secret,
    read_peers_file,
)
from gradsync.protocol.errors import DaemonShuttingDownError, InvalidArgumentError, PeerLostError
from gradsync.protocol.peer import PEER_PROTOCOL_VERSION

pytestmark = pytest.mark.timeout(30)

T = TypeVar("T")
KINDS = ("chunk", "note")
READY_S = 10.0
# Generous enough that a loaded test machine causes no false losses (the loss
# tests use 1 s with an idle peer); the probes kept small to be quick.
FAST: dict[str, Any] = {"peer_timeout_s": 5.0, "probe_bytes": 1 << 20, "probe_rounds": 3}




def endpoints(count: int) -> list[str]:
    return [f"tcp://127.0.0.1:{port}" for port in free_ports(count)]


def run(coro: Awaitable[T], timeout_s: float = 20.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


async def poll(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.005)


@pytest.fixture
def keys(tmp_path: Path) -> Callable[[list[str]], list[CurveConfig]]:
    """Factory: one keypair per endpoint, all public keys in one authorized folder."""

    def make(names: list[str]) -> list[CurveConfig]:
        folder = tmp_path / "authorized"
        folder.mkdir(mode=0o700, exist_ok=True)
        configs = []
        for index, endpoint in enumerate(names):
            secrets = tmp_path / f"node{index}"
            public, secret = generate_keypair(str(secrets), "node", endpoint)
            os.replace(public, folder / f"node{index}.key")
            configs.append(CurveConfig(secret, str(folder)))
        return configs

    return make


async def start_all(
    names: list[str], configs: list[CurveConfig | None], events: list[Events], **options: Any
) -> list[PeerLinks]:
    links = [
        PeerLinks(LinkSettings(
            name, names, config, insecure=config is None, kinds=KINDS, **{**FAST, **options},
        ), events=inbox)
        for name, config, inbox in zip(names, configs, events, strict=True)
    ]
    for link in links:
        await link.start()
    for link in links:
        await link.wait_up(READY_S)
    return links


async def close_all(links: list[PeerLinks]) -> None:
    for link in links:
        await link.close()


# -- exchange -------------------------------------------------------------------


def exchange(names: list[str], configs: list[CurveConfig | None]) -> None:
    """Every link sends every other one a header and two payloads; all arrive intact."""

    async def main() -> None:
        events = [Events() for _ in names]
        links = await start_all(names, configs, events)
        try:
            big = {
                name: np.arange(3 * 1024 * 1024, dtype=np.float32) * (i + 1)
                for i, name in enumerate(names)
            }  # 12 MiB each
            small = np.frombuffer(b"tail", dtype=np.uint8)
            for sender in links:
                for peer in sender.peers:
                    await sender.send(
                        peer, {"kind": "chunk", "to": peer, "step": 3},
                        [big[sender.endpoint].data, small],
                    )
            for receiver, inbox in zip(links, events, strict=True):
                got: dict[str, PeerMessage] = {}
                while len(got) < len(names) - 1:
                    message = await inbox.next()
                    got[message.peer] = message
                assert set(got) == set(receiver.peers)
                for peer, message in got.items():
                    assert message.header == {
                        "v": PEER_PROTOCOL_VERSION, "src": peer, "kind": "chunk",
                        "to": receiver.endpoint, "step": 3,
                    }
                    assert isinstance(message.frames[0], zmq.Frame)  # received without a copy
                    payload, tail = message.payloads
                    assert np.array_equal(np.frombuffer(payload, dtype=np.float32), big[peer])
                    assert bytes(tail) == b"tail"
                assert receiver.counters["received"] == len(names) - 1
                assert receiver.counters["malformed"] == receiver.counters["unknown_peer"] == 0
                for peer in receiver.peers:
                    assert receiver.peer_state(peer) == "up"
                    stats = receiver.link_stats(peer)
                    assert stats is not None
                    rtt_s, bytes_per_s = stats
                    assert 0 < rtt_s < 1.0 and bytes_per_s > 1e6
        finally:
            await close_all(links)

    run(main())


def test_three_links_exchange_large_payloads_over_curve(
    keys: Callable[[list[str]], list[CurveConfig]],
) -> None:
    names = endpoints(3)
    configs: list[CurveConfig | None] = list(keys(names))
    exchange(names, configs)


def test_two_links_insecure_mode_works_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gradsync.daemon.peers")
    exchange(endpoints(2), [None, None])
    assert "INSECURE" in caplog.text


def test_sending_zero_copy_waits_until_buffers_are_released() -> None:
    """After send() returns, overwriting the buffer cannot change what arrives."""

    async def main() -> None:
        names = endpoints(2)
        events = [Events(), Events()]
        a, b = await start_all(names, [None, None], events)
        try:
            data = np.full(8 * 1024 * 1024, 7, dtype=np.uint8)
            await a.send(b.endpoint, {"kind": "chunk"}, [data])
            data[:] = 0
            message = await events[1].next()
            assert np.all(np.frombuffer(message.payloads[0], dtype=np.uint8) == 7)
            with pytest.raises(InvalidArgumentError, match="C-contiguous"):
                await a.send(b.endpoint, {"kind": "chunk"}, [np.zeros((4, 4))[:, ::2]])
            with pytest.raises(InvalidArgumentError, match="not declared"):
                await a.send(b.endpoint, {"kind": "bogus"})
            with pytest.raises(InvalidArgumentError, match="not a peer"):
                await a.send("tcp://127.0.0.1:1", {"kind": "note"})
        finally:
            await close_all([a, b])

    run(main())


# -- configuration ----------------------------------------------------------------


def test_missing_keys_without_insecure_raises() -> None:
    names = endpoints(2)
    with pytest.raises(ConfigError, match=r"--curve-secret.*--curve-authorized.*--insecure"):
        PeerLinks(LinkSettings(names[0], names), events=Events())
    # Alone: nothing to secure, nothing bound.
    PeerLinks(LinkSettings(names[0], [names[0]]), events=Events())


def test_self_is_recognised_under_an_equivalent_address() -> None:
    own, other = free_ports(2)
    links = PeerLinks(LinkSettings(
        f"tcp://127.0.0.1:{own}", [f"tcp://localhost:{own}", f"tcp://127.0.0.1:{other}"],
        insecure=True,
    ), events=Events())
    assert links.endpoint == f"tcp://localhost:{own}"
    assert links.peers == (f"tcp://127.0.0.1:{other}",)
    wildcard = PeerLinks(LinkSettings(
        f"tcp://*:{own}", [f"tcp://127.0.0.1:{own}", f"tcp://127.0.0.1:{other}"], insecure=True,
    ), events=Events())
    assert wildcard.peers == (f"tcp://127.0.0.1:{other}",)
    with pytest.raises(ConfigError, match="twice"):
        PeerLinks(LinkSettings(
            f"tcp://127.0.0.1:{own}", [f"tcp://127.0.0.1:{other}", f"tcp://localhost:{other}"],
            insecure=True,
        ), events=Events())
    with pytest.raises(ConfigError, match="list this daemon's own address"):
        PeerLinks(LinkSettings(
            f"tcp://*:{own}", [f"tcp://127.0.0.1:{other}"], insecure=True,
        ), events=Events())


def test_peers_file(tmp_path: Path) -> None:
    path = tmp_path / "peers"
    path.write_text("# cluster\ntcp://node1:7070\n\n  tcp://[::1]:7071  # v6\n")
    assert read_peers_file(str(path)) == ["tcp://node1:7070", "tcp://[::1]:7071"]
    # Hostfile style: bare HOST:PORT or HOST PORT lines.
    path.write_text("node1:7070\nnode2 7071\n")
    assert read_peers_file(str(path)) == ["tcp://node1:7070", "tcp://node2:7071"]
    path.write_text("tcp://node1:7070\nnode2:port\n")
    with pytest.raises(ValueError, match=r"peers:2: .*needs a port"):
        read_peers_file(str(path))


def test_secret_key_readable_by_others_is_refused(
    keys: Callable[[list[str]], list[CurveConfig]],
) -> None:
    names = endpoints(2)
    config = keys(names)[0]
    os.chmod(config.secret_file, 0o644)
    with pytest.raises(KeyFileError, match=rf"{config.secret_file} has mode 0644"):
        PeerLinks(LinkSettings(names[0], names, config), events=Events())


def test_peer_without_recorded_endpoint_is_refused(tmp_path: Path) -> None:
    names = endpoints(2)
    folder = tmp_path / "authorized"
    folder.mkdir(mode=0o700)
    _, secret = generate_keypair(str(tmp_path / "a"), "a", names[0])
    public_b, _ = generate_keypair(str(tmp_path / "b"), "b")  # no --endpoint
    os.replace(public_b, folder / "b.key")
    with pytest.raises(KeyFileError, match=rf"records the endpoint of peer {names[1]}"):
        PeerLinks(LinkSettings(names[0], names, CurveConfig(secret, str(folder))), events=Events())


# -- authentication ------------------------------------------------------------------


def test_unknown_key_never_delivers_and_is_counted(
    tmp_path: Path, keys: Callable[[list[str]], list[CurveConfig]],
) -> None:
    names = endpoints(2)
    config_a, config_b = keys(names)
    # A rogue daemon knows A's public key and address but its own key is not authorised.
    rogue_folder = tmp_path / "rogue-authorized"
    rogue_folder.mkdir(mode=0o700)
    rogue_public, rogue_secret = generate_keypair(str(tmp_path / "rogue"), "rogue")
    (rogue_folder / "a.key").write_bytes((Path(config_a.authorized_dir) / "node0.key").read_bytes())
    os.replace(rogue_public, rogue_folder / "rogue.key")
    rogue_endpoint = endpoints(1)[0]

    async def main() -> None:
        events = [Events(), Events()]
        a, b = await start_all(names, [config_a, config_b], events)
        rogue_keys = CurveConfig(rogue_secret, str(rogue_folder))
        rogue = PeerLinks(LinkSettings(
            rogue_endpoint, [rogue_endpoint, names[0]], rogue_keys, kinds=KINDS, **FAST,
        ), events=Events())
        await rogue.start()
        # A raw CURVE socket with the rogue key, queueing messages before the handshake.
        context = zmq.asyncio.Context()
        raw = context.socket(zmq.DEALER)
        raw.linger = 0
        raw.routing_id = names[1].encode()  # even claiming to be B does not help
        raw.curve_publickey, raw.curve_secretkey = zmq.curve_keypair()
        raw.curve_serverkey = (Path(config_a.authorized_dir) / "node0.key").read_text().split(
            'public-key = "')[1][:40].encode()
        raw.connect(names[0])
        header = msgpack.packb({"v": PEER_PROTOCOL_VERSION, "kind": "note", "src": names[1]})
        raw.send_multipart([header])
        try:
            await poll(
                lambda: a.counters["rejected_keys"] >= 2 and rogue.counters["handshake_failed"] > 0,
                READY_S, "the rejections",
            )
            assert rogue.peer_state(names[0]) == "connecting"
            with pytest.raises(PeerLostError):
                await rogue.send(names[0], {"kind": "note"})
            await b.send(names[0], {"kind": "note", "from": "b"})
            message = await events[0].next()
            assert (message.peer, message.header["from"]) == (names[1], "b")
            assert a.counters["received"] == 1
        finally:
            context.destroy(linger=0)
            await close_all([a, b, rogue])

    run(main())


def test_authorised_daemon_cannot_speak_for_another(
    keys: Callable[[list[str]], list[CurveConfig]],
) -> None:
    names = endpoints(3)  # the third daemon is authorised but not running
    configs = keys(names)

    async def main() -> None:
        events_a = Events()
        a = PeerLinks(LinkSettings(
            names[0], names, configs[0], kinds=KINDS, **FAST,
        ), events=events_a)
        b = PeerLinks(LinkSettings(
            names[1], names, configs[1], kinds=KINDS, **FAST,
        ), events=Events())
        for links in (a, b):
            await links.start()
        await a.wait_up(READY_S, [names[1]])
        await b.wait_up(READY_S, [names[0]])
        context = zmq.asyncio.Context()
        try:
            # B's own key, but claiming to be the third daemon.
            secret_b = load_secret(configs[1].secret_file)
            raw = context.socket(zmq.DEALER)
            raw.linger = 0
            raw.routing_id = names[2].encode()
            raw.curve_publickey, raw.curve_secretkey = secret_b.public_key, secret_b.secret_key
            raw.curve_serverkey = load_secret(configs[0].secret_file).public_key
            raw.connect(names[0])
            await raw.send_multipart(
                [msgpack.packb({"v": PEER_PROTOCOL_VERSION, "kind": "note", "src": names[2]})]
            )
            await poll(lambda: a.counters["unknown_peer"] == 1, READY_S, "the drop")
            await b.send(names[0], {"kind": "note"})
            assert (await events_a.next()).peer == names[1]
            assert a.counters["received"] == 1
        finally:
            context.destroy(linger=0)
            await close_all([a, b])

    run(main())


def test_close_is_prompt_and_refuses_sends() -> None:
    async def main() -> None:
        a, b = await start_all(endpoints(2), [None, None], [Events(), Events()])
        started = time.monotonic()
        await close_all([a, b])
        assert time.monotonic() - started < 2.0
        with pytest.raises(DaemonShuttingDownError):
            await a.send(b.endpoint, {"kind": "note"})

    run(main())


# -- malformed input ---------------------------------------------------------------------


def test_malformed_messages_are_dropped_and_counted() -> None:
    names = endpoints(2)

    def header(**fields: Any) -> bytes:
        base: dict[str, Any] = {"v": PEER_PROTOCOL_VERSION, "kind": "note", "src": names[1]}
        return msgpack.packb({**base, **fields})

    bad = [
        [b"\xc1 not msgpack"],
        [msgpack.packb([1, 2, 3])],
        [msgpack.packb({1: "int key"})],
        [header(v=PEER_PROTOCOL_VERSION + 1)],
        [header(v=True)],
        [header(kind="no-such-kind")],
        [header(kind="link.pong", seq=1)],
        [header(src=names[0])],
        [header(kind="link.ping")],  # no seq
        [msgpack.packb({"v": PEER_PROTOCOL_VERSION, "kind": "note"})],
        [b"\x00" * (64 * 1024 + 1)],
    ]

    async def main() -> None:
        events = Events()
        a = PeerLinks(LinkSettings(
            names[0], names, insecure=True, kinds=KINDS, **FAST,
        ), events=events)
        await a.start()
        context = zmq.asyncio.Context()
        try:
            impostor = context.socket(zmq.DEALER)
            impostor.linger = 0
            impostor.routing_id = names[1].encode()
            impostor.connect(names[0])
            stranger = context.socket(zmq.DEALER)
            stranger.linger = 0
            stranger.routing_id = b"tcp://127.0.0.1:9"
            stranger.connect(names[0])
            await stranger.send_multipart([header(src="tcp://127.0.0.1:9")])
            for frames in bad:
                await impostor.send_multipart(frames)
            await impostor.send_multipart([header(ok=1), b"payload"])
            message = await events.next()
            assert message.header["ok"] == 1 and bytes(message.payloads[0]) == b"payload"
            assert a.counters["malformed"] == len(bad)
            await poll(lambda: a.counters["unknown_peer"] == 1, READY_S, "the stranger")
        finally:
            context.destroy(linger=0)
            await a.close()

    run(main())


# -- peer loss ------------------------------------------------------------------------------

CHILD = """
import asyncio, json, sys
sys.path.insert(0, sys.argv[4])
from gradsync.daemon.peers import LinkSettings, PeerLinks
from peer_events import Events

async def main():
    links = PeerLinks(LinkSettings(sys.argv[1], json.loads(sys.argv[2]), insecure=True,
                                   peer_timeout_s=float(sys.argv[3]), probe_bytes=1 << 20),
                      events=Events())
    await links.start()
    print("started", flush=True)
    await asyncio.Event().wait()  # until killed

asyncio.run(main())
"""
TESTS = os.path.dirname(os.path.abspath(__file__))


@contextlib.contextmanager
def child_links(
    listen: str, peers: list[str], peer_timeout_s: float
) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        [sys.executable, "-c", CHILD, listen, json.dumps(peers), str(peer_timeout_s), TESTS],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGCONT)
            process.kill()
        process.communicate(timeout=10)


def notice_loss(how: signal.Signals) -> None:
    peer_timeout_s = 1.0
    margin_s = 0.5
    names = endpoints(2)
    events = Events()

    async def main(child: subprocess.Popen[str]) -> None:
        links = PeerLinks(LinkSettings(
            names[0], names, insecure=True, kinds=KINDS, peer_timeout_s=peer_timeout_s,
        ), events=events)
        await links.start()
        try:
            try:
                await links.wait_up(READY_S)
            except TimeoutError:
                child.kill()
                raise AssertionError(f"child never came up: {child.communicate()[1]}") from None
            signalled = time.monotonic()
            os.kill(child.pid, how)
            await poll(lambda: bool(events.lost), peer_timeout_s + 5, "the loss")
            assert events.lost[0][0] == names[1]
            delay = events.lost[0][1] - signalled
            assert delay <= peer_timeout_s + margin_s, f"noticed after {delay:.2f}s"
            if how == signal.SIGSTOP:  # by missed heartbeats: after timeout - interval at least
                assert delay >= 0.7 * peer_timeout_s, f"noticed after {delay:.2f}s"
            assert links.peer_state(names[1]) == "lost"
            assert links.counters["peer_lost"] == 1
            with pytest.raises(PeerLostError, match=names[1]):
                await links.send(names[1], {"kind": "note"})
            if how == signal.SIGSTOP:  # it comes back when continued
                os.kill(child.pid, signal.SIGCONT)
                await links.wait_up(READY_S)
                assert events.up == [names[1], names[1]]
        finally:
            await links.close()

    with child_links(names[1], names, peer_timeout_s) as child:
        run(main(child))


def test_killed_peer_is_noticed_within_the_peer_timeout() -> None:
    notice_loss(signal.SIGKILL)


def test_stopped_peer_is_noticed_within_the_peer_timeout() -> None:
    notice_loss(signal.SIGSTOP)


def test_sends_waiting_for_a_lost_peer_fail_instead_of_hanging() -> None:
    """Beyond ZeroMQ's high-water mark, sends wait in the links' backlog; when the
    stopped peer is declared lost, every send still waiting fails with PeerLostError.
    (A few may find room first: the stopped peer's kernel buffers still take data,
    and the signal may land a moment late.  The backlog is in order, so those are
    the first ones, and every one after them fails.)"""
    peer_timeout_s = 1.0
    names = endpoints(2)

    async def main(child: subprocess.Popen[str]) -> None:
        links = PeerLinks(LinkSettings(
            names[0], names, insecure=True, kinds=KINDS, peer_timeout_s=peer_timeout_s,
            probe_bytes=0, probe_rounds=1,
        ), events=Events())
        await links.start()
        try:
            await links.wait_up(READY_S)
            os.kill(child.pid, signal.SIGSTOP)
            payload = np.zeros(16 * 1024, dtype=np.float32)  # 64 KiB, the same buffer each time
            sends = [links.send_nowait(names[1], {"kind": "note"}, [payload]) for _ in range(3000)]
            waiting = [sending for sending in sends if not sending.done()]
            assert waiting, "nothing waited: the high-water mark was never reached"
            await poll(lambda: links.peer_state(names[1]) == "lost", peer_timeout_s + 5, "loss")
            await poll(lambda: all(s.done() for s in waiting), 2.0, "the waiting sends to end")
            failed = [sending for sending in waiting if sending.exception() is not None]
            assert len(failed) > len(waiting) // 2, f"{len(failed)} of {len(waiting)} failed"
            assert failed == waiting[len(waiting) - len(failed):], "a send after a failed one went"
            for sending in failed:
                with pytest.raises(PeerLostError, match=names[1]):
                    sending.result()
        finally:
            await links.close()

    with child_links(names[1], names, peer_timeout_s) as child:
        run(main(child))


# -- links opened on first use ------------------------------------------------------


def test_past_a_few_daemons_links_open_on_first_use_and_one_that_never_comes_up_is_given_up_on(
) -> None:
    """Five daemons, one ring neighbour on either side, one never started: the
    first links its two neighbours at start only.  Messages to a peer further
    round open its link and arrive in order once it is up; messages to the
    daemon that never started fail with PeerLostError once the link is given up
    on (`open_deadline_s`), and that peer is no longer reachable."""
    names = endpoints(5)
    ring = sorted(names)
    absent = ring[3]

    async def main() -> None:
        events = [Events() for _ in names]
        links = {
            name: PeerLinks(LinkSettings(
                name, names, insecure=True, kinds=KINDS, watch_neighbours=1,
                **{**FAST, "probe_rounds": 1},
            ), events=inbox)
            for name, inbox in zip(names, events, strict=True) if name != absent
        }
        inbox = dict(zip(names, events, strict=True))
        for link in links.values():
            await link.start()
        try:
            first = links[ring[0]]
            await first.wait_up(READY_S, [ring[1], ring[4]])
            assert [first.peer_state(p) for p in ring[1:]] == ["up", "idle", "idle", "up"]
            assert first.reachable(ring[2]) and first.reachable(absent)

            sends = [first.send_nowait(ring[2], {"kind": "note", "n": n}) for n in range(5)]
            await first.send(ring[2], {"kind": "chunk", "n": 5}, [b"payload"])
            assert first.peer_state(ring[2]) == "up"
            await asyncio.gather(*sends)
            got = [(await inbox[ring[2]].next()).header["n"] for _ in range(6)]
            assert got == list(range(6))
            # Reachable all along: its coming up is no news to the daemon.
            assert ring[2] not in inbox[ring[0]].up and ring[1] in inbox[ring[0]].up

            lost = first.send_nowait(absent, {"kind": "note", "n": 0})
            assert first.peer_state(absent) == "connecting" and first.reachable(absent)
            with pytest.raises(PeerLostError, match=absent):
                await asyncio.wait_for(lost, first.open_deadline_s + 5)
            assert first.peer_state(absent) == "lost" and not first.reachable(absent)
            assert any("no answer within" in why for why in inbox[ring[0]].why)
            with pytest.raises(PeerLostError):
                first.send_nowait(absent, {"kind": "note", "n": 1})
        finally:
            await close_all(list(links.values()))

    run(main(), timeout_s=25.0)


def test_a_link_opened_on_first_use_closes_when_quiet_unless_kept_and_opens_again() -> None:
    """`link_idle_s`: of two links the first daemon opened on first use, the quiet
    one that nothing keeps is closed (its peer `idle` again, not lost), the kept
    one stays up, and a message to the closed one opens it again and arrives."""
    names = endpoints(5)
    ring = sorted(names)

    async def main() -> None:
        events = {name: Events() for name in names}
        links = {
            name: PeerLinks(LinkSettings(
                name, names, insecure=True, kinds=KINDS, watch_neighbours=1, link_idle_s=0.5,
                **{**FAST, "probe_rounds": 1},
            ), events=events[name])
            for name in names
        }
        for link in links.values():
            await link.start()
        try:
            first = links[ring[0]]
            first.keep_open = lambda: {ring[2]}
            for n, peer in enumerate((ring[2], ring[3])):
                await first.send(peer, {"kind": "note", "n": n})
                assert (await events[peer].next()).header["n"] == n
            await poll(lambda: first.peer_state(ring[3]) == "idle", 10, "the quiet link closed")
            assert first.peer_state(ring[2]) == "up"
            assert not events[ring[0]].lost and first.reachable(ring[3])

            await first.send(ring[3], {"kind": "note", "n": 2})
            assert (await events[ring[3]].next()).header["n"] == 2
            assert first.peer_state(ring[3]) == "up"
        finally:
            await close_all(list(links.values()))

    run(main(), timeout_s=25.0)
