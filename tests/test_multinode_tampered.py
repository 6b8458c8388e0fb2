"""A man in the middle between two real daemons' sealed data streams.

Daemon B advertises its data streams at a relay on 127.0.0.1
(`--data-advertise`, as behind a port forward), so A's stream to B passes
through it.  The relay flips one byte of one record: the allreduce fails on
both daemons with an error naming the other, nothing but inputs and true sums
is in the buffers (B's holds its input untouched), B counts the failed
authentication, and both go on serving a new job through the same relay.
The relay's copy holds none of A's input.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from cluster import curve_args, free_ports, peer_args, run_spread, spawn_spread
from test_sealed_streams import Relay, hello_size

from conftest import DaemonProcess, collect, poll_until
from gradsync.client.cli.stats import fetch_snapshot
from gradsync.client.ping import query
from gradsync.daemon.peers.stream_crypto import LENGTH

StartDaemon = Callable[..., DaemonProcess]
COUNT, SEED = 1 << 20, 22  # 4 MiB of float32 per rank


@pytest.fixture
def relay_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop on a thread of its own, for a relay beside blocking test code."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="relay", daemon=True)
    thread.start()
    yield loop

    async def end_connections() -> None:
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(end_connections(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@pytest.mark.fault
@pytest.mark.timeout(120)
def test_a_flipped_byte_between_daemons_fails_both_writes_nothing_and_both_serve_on(
    start_daemon: StartDaemon, short_tmp: str, relay_loop: asyncio.AbstractEventLoop
) -> None:
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(3)]
    data_port = int(endpoints.pop().rsplit(":", 1)[1])  # B's data streams listen here
    flipped: list[int] = []

    def flip_once(index: int, record: bytes) -> list[bytes]:
        if flipped or len(record) < 64 * 1024:  # the first record of slice data
            return [record]
        flipped.append(index)
        changed = bytearray(record)
        changed[LENGTH.size + 1000] ^= 0x01
        return [bytes(changed)]

    relay = Relay(data_port, hello_size(endpoints[0]), flip_once)
    asyncio.run_coroutine_threadsafe(relay.start(), relay_loop).result(10)
    flags = curve_args(Path(short_tmp) / "keys", endpoints)
    a = start_daemon(*peer_args(0, endpoints, *flags[0]))
    b = start_daemon(*peer_args(1, endpoints, *flags[1], "--data-port", str(data_port),
                                "--data-advertise", f"127.0.0.1:{relay.port}"))
    try:
        # Until A's data stream to B is open, A's slices would take ZeroMQ, not the relay.
        poll_until(lambda: fetch_snapshot(a.endpoint + ".stats", 5.0)["peers"][endpoints[1]]
                   ["data_stream"] == "sealed", 60, "A's sealed data stream to B")
        ranks = spawn_spread([a, b], (1, 1), "multinode_tampered.py", [str(COUNT), str(SEED)],
                             job="tampered", env={"GRADSYNC_TIMEOUT_S": "60"})
        results = collect(ranks, timeout_s=70)
        capture = bytes(relay.capture)
        assert flipped, ("no slice data went through the relay:\n"
                         + "\n".join(r.stdout + r.stderr for r in results)
                         + f"\nA:\n{a.log()}\nB:\n{b.log()}")
        for result, other in zip(results, reversed(endpoints), strict=True):
            outcome = result.records()[-1]
            assert outcome["error"] is not None, result.stdout + result.stderr
            assert other in outcome["message"], outcome
            # Nothing wrong is written: each element holds its input or the true sum.
            assert outcome["unchanged"] + outcome["summed"] == COUNT, outcome
        # B, whose stream from A was tampered with, wrote nothing at all; A had
        # reduced B's intact half into its own before the failure (the collectives
        # work in the clients' buffers: a failed one may leave a step's true
        # partial result, never bytes that failed authentication).
        assert results[1].records()[-1]["unchanged"] == COUNT
        assert "failed authentication" in " ".join(r.records()[-1]["message"] for r in results)
        assert query(b.endpoint, 5.0)["counters"]["links_stream_auth_failed"] == 1
        snapshot = fetch_snapshot(b.endpoint + ".stats", 5.0)
        assert snapshot["counters"]["links_stream_auth_failed"] == 1
        # The capture: A's stream went through sealed, none of A's input in it.
        assert len(capture) > COUNT  # at least half of A's 4 MiB went through
        # Rank 0's input, as multinode_tampered.py makes it.
        sent = np.random.default_rng(SEED).standard_normal(COUNT, dtype=np.float32).tobytes()
        for start in range(0, len(sent) - 32, 65_521):
            assert sent[start : start + 32] not in capture
        # Both keep serving: a new job over the relay (now faithful) works.
        after = run_spread([a, b], (1, 1), "multinode_allreduce.py",
                           ["ring", "float32", "sum"], job="after-tamper", timeout_s=60)
        assert all(r.records()[-1]["failures"] == 0 for r in after)
        for daemon in (a, b):
            daemon.assert_alive()
        assert query(b.endpoint, 5.0)["counters"]["links_stream_auth_failed"] == 1
    finally:
        asyncio.run_coroutine_threadsafe(relay.close(), relay_loop).result(10)
