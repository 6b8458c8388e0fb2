"""The pull on open (issue 50, part 2): a replacement node's daemon fetches the parts
it lacks from the peer that holds them, several parts and several chunks of each in
flight at once (daemon/io/checkpoint_peers.py), bitwise; a holder lost mid-pull
fails the open at once, not at the answers' deadline.  And the data streams'
sockets keep little unsent in the kernel (TCP_NOTSENT_LOWAT), without the writer
spinning while it waits for the socket.

Real daemons on 127.0.0.1 with CURVE keys (sealed streams); the ranks' parts put
and committed with the torch-free checkpoint client, one session per rank.
"""

from __future__ import annotations

import asyncio
import random
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_checkpoint_replicas import lose_node, replicated_on, sealed_pair, stats

from conftest import DaemonProcess, poll_until
from gradsync.client.checkpoints import DaemonCheckpoints, checkpoint_client
from gradsync.daemon.io.checkpoint_peers import ANSWER_TIMEOUT_S, CHUNK_BYTES, PULL_PARTS
from gradsync.daemon.peers.data_plane import NOTSENT_LOWAT_BYTES
from gradsync.daemon.peers.stream import StreamSender, limit_unsent
from gradsync.protocol.errors import GradsyncError

StartDaemon = Callable[..., DaemonProcess]
MIB = 2**20


def put(store: DaemonCheckpoints, step: int, item: str, data: bytes) -> None:
    mapping = store.put(step, item, len(data))
    mapping[:len(data)] = data
    mapping.close()


def replaced(start_daemon: StartDaemon, keys: Path, job: str, parts: dict[str, bytes]
             ) -> tuple[str, DaemonProcess, DaemonProcess]:
    """Two daemons: rank 0 puts a small part on the first, rank 1 `parts` on the
    second, rank 0 commits step 1 across both; once each daemon's parts are on the
    other, the second node is lost and a fresh daemon replaces it, which gets the
    first's own part pushed.  The first's peer endpoint, it, and the replacement."""
    peers, flags, (first, second) = sealed_pair(start_daemon, keys)
    for daemon, peer in ((first, peers[1]), (second, peers[0])):
        poll_until(lambda d=daemon, p=peer: stats(d)["peers"][p].get(  # type: ignore[misc]
            "data_stream") == "sealed", 60, f"{daemon.endpoint}'s sealed stream to {peer}")
    with (checkpoint_client(job, 0, first.endpoint) as zero,
          checkpoint_client(job, 1, second.endpoint) as one):
        put(DaemonCheckpoints(zero), 1, "own", b"rank zero")
        ones = DaemonCheckpoints(one)
        for item, data in parts.items():
            put(ones, 1, item, data)
        DaemonCheckpoints(zero).commit(1, [(0, "own"), *((1, item) for item in parts)])
    poll_until(lambda: replicated_on(second, job) == [peers[0]], 60,
               f"the second daemon's parts confirmed on the first: {stats(second)}")
    lose_node(second)
    replacement = start_daemon(*flags[1])
    poll_until(lambda: replicated_on(first, job) == [peers[1]], 60,
               "the first daemon's own part pushed to the replacement")
    return peers[0], first, replacement


@pytest.mark.timeout(300)
def test_a_pull_of_several_multi_chunk_parts_arrives_bitwise(
    start_daemon: StartDaemon, tmp_path: Path
) -> None:
    job = "pulled"
    rng = random.Random(7)
    sizes = {"a": 5 * MIB + 3, "b": 3 * MIB, "c": CHUNK_BYTES, "d": 2 * MIB - 1, "e": 1,
             "f": 4 * MIB + CHUNK_BYTES // 2}
    assert len(sizes) > PULL_PARTS  # more parts than are pulled at once
    parts = {item: rng.randbytes(n) for item, n in sizes.items()}
    _, first, replacement = replaced(start_daemon, tmp_path / "keys", job, parts)
    with checkpoint_client(job, 1, replacement.endpoint) as client:
        opened = DaemonCheckpoints(client).open()
        assert opened.step == 1
        for item, data in parts.items():
            got = opened.parts[(1, item)]
            assert got[:len(data)] == data, f"part {item} differs"
            got.close()
    assert "opened from the peers' parts and replicas" in replacement.log()
    pulled = {r["item"]: r for r in stats(replacement)["checkpoint_replicas"][job]
              if r["rank"] == 1}
    assert set(pulled) == set(sizes), pulled  # segments: whole pages
    assert all(r["complete"] and r["bytes"] >= sizes[item] for item, r in pulled.items())
    # The survivor's stream to the replacement keeps little unsent in the kernel.
    assert f"at most {NOTSENT_LOWAT_BYTES} bytes unsent in the kernel" in first.log()
    replacement.assert_alive()


@pytest.mark.timeout(300)
def test_a_holder_lost_mid_pull_fails_the_open_at_once(
    start_daemon: StartDaemon, tmp_path: Path
) -> None:
    job = "cut"
    holder, first, replacement = replaced(
        start_daemon, tmp_path / "keys", job,
        {f"big{i}": bytes([i + 1]) * (160 * MIB) for i in range(2)})
    failure: list[BaseException] = []
    ended = threading.Event()

    def load() -> None:
        try:
            with checkpoint_client(job, 1, replacement.endpoint) as client:
                DaemonCheckpoints(client).open()
        except BaseException as exc:
            failure.append(exc)
        ended.set()

    opener = threading.Thread(target=load, daemon=True)
    opener.start()

    def arriving() -> bool:
        held = stats(replacement).get("checkpoint_replicas", {}).get(job, [])
        return any(r["rank"] == 1 and 0 < r["got"] < r["bytes"] for r in held)

    poll_until(arriving, 60, "a pulled part to be arriving on the replacement")
    first.process.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    first.process.wait(10)
    assert ended.wait(ANSWER_TIMEOUT_S + 30), "the open did not end"
    took = time.monotonic() - killed
    opener.join(5)
    assert failure and isinstance(failure[0], GradsyncError), failure
    message = str(failure[0])
    assert holder in message and "could not be fetched" in message, message
    assert took < ANSWER_TIMEOUT_S / 3, f"the open failed {took:.1f}s after the holder's loss"
    # Nothing half-pulled is kept: rank 0's part, pushed whole before, alone stays.
    def released() -> bool:
        held = stats(replacement)["checkpoint_replicas"].get(job, [])
        return [(r["rank"], r["complete"]) for r in held] == [(0, True)]

    poll_until(released, 30, "the half-pulled parts to be released")
    print(f"the open failed {took:.2f}s after the holder was killed: {message}")
    replacement.assert_alive()


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return client, server


def test_the_unsent_limit_is_set_and_read_back_on_a_tcp_socket() -> None:
    client, server = tcp_pair()
    with client, server:
        assert limit_unsent(client, NOTSENT_LOWAT_BYTES) == NOTSENT_LOWAT_BYTES
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT) == (
            NOTSENT_LOWAT_BYTES)


def test_a_stream_with_the_unsent_limit_drains_without_spinning() -> None:
    """A slow reader: the sender waits for the socket to be writable (its thread's
    CPU time stays a small part of the wall time), and every byte arrives in order."""
    client, server = tcp_pair()
    limit_unsent(client, NOTSENT_LOWAT_BYTES)
    payload = random.Random(3).randbytes(24 * MIB)
    received = bytearray()

    def read_slowly() -> None:
        with server:
            while chunk := server.recv(256 * 1024):
                received.extend(chunk)
                time.sleep(0.01)  # about 25 MB/s at most

    reader = threading.Thread(target=read_slowly, daemon=True)
    reader.start()

    async def send() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        broken: list[Exception] = []
        sender = StreamSender(client, loop, lambda _, exc: broken.append(exc), "slow")
        wall, cpu = time.monotonic(), time.thread_time()
        await asyncio.wait_for(sender.send(b"", [memoryview(payload)]), 60)
        spent = time.monotonic() - wall, time.thread_time() - cpu
        sender.close(ConnectionError("done"))
        assert not broken, broken
        return spent

    wall, cpu = asyncio.run(send())
    reader.join(30)
    assert bytes(received) == payload
    assert wall > 0.5, f"the reader did not hold the sender back ({wall:.2f}s)"
    assert cpu < 0.25 * wall, f"the sender spent {cpu:.2f}s of CPU in {wall:.2f}s: spinning?"


def test_the_unsent_limit_holds_only_while_a_bulk_message_is_queued() -> None:
    """A checkpoint chunk (`bulk`) lowers the kernel's unsent limit while it is queued;
    once the kernel has it, the kernel's own limit is back, so that a collective's
    large sends alone are not slowed by the limit (a fifth of a 64 MiB allreduce
    across two daemons, measured)."""
    client, server = tcp_pair()
    received = bytearray()

    def read_slowly() -> None:
        with server:
            while chunk := server.recv(256 * 1024):
                received.extend(chunk)
                time.sleep(0.01)

    reader = threading.Thread(target=read_slowly, daemon=True)
    reader.start()

    def unsent_limit() -> int:
        return client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)

    async def send() -> list[int]:
        sender = StreamSender(client, asyncio.get_running_loop(), lambda _, exc: None, "bulk")
        sender.unsent_limit = NOTSENT_LOWAT_BYTES
        seen = [unsent_limit()]
        plain = sender.send(b"", [memoryview(bytes(1 * MIB))])
        seen.append(unsent_limit())
        bulk = sender.send(b"", [memoryview(bytes(8 * MIB))], bulk=True)
        seen.append(unsent_limit())
        await asyncio.wait_for(asyncio.gather(plain, bulk), 60)
        await asyncio.sleep(0)  # the bulk send's done callback
        seen.append(unsent_limit())
        sender.close(ConnectionError("done"))
        return seen

    with client:
        seen = asyncio.run(send())
    reader.join(30)
    assert len(received) == 9 * MIB
    assert seen == [0, 0, NOTSENT_LOWAT_BYTES, 0], seen
