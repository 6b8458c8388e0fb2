"""A daemon restarted on the same socket: one DaemonLostError, then the client reconnects."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
from cluster import free_ports, peer_args

from conftest import DaemonProcess, launch_daemon, segments_of
from gradsync.client import Client
from gradsync.protocol.errors import (
    DaemonLostError,
    DaemonShuttingDownError,
    DaemonUnavailableError,
    PeerLostError,
)

pytestmark = pytest.mark.timeout(60)


def restart(daemon: DaemonProcess, how: signal.Signals) -> DaemonProcess:
    """Stop `daemon` (SIGTERM: a systemctl restart; SIGKILL: a crash), start another
    on the same socket, as systemd's Restart= does."""
    daemon.process.send_signal(how)
    daemon.process.wait(30)
    if how == signal.SIGKILL:
        daemon.sweep_segments()
    return launch_daemon(daemon.folder, name=daemon.socket_path.rsplit("/", 1)[1][: -len(".sock")])


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["restart", "crash"])
def test_collective_after_a_restart_raises_once_then_the_client_reconnects(
    start_daemon: object, how: signal.Signals
) -> None:
    daemon: DaemonProcess = start_daemon()  # type: ignore[operator]
    ranks = [Client(daemon=daemon.endpoint, job="restart", rank=r, world_size=2, local_rank=r,
                    local_world_size=2, timeout_s=20) for r in range(2)]
    try:
        arrays = [np.full(1 << 18, float(r + 1), np.float32) for r in range(2)]
        works = [c.all_reduce(a, op="sum", async_op=True)
                 for c, a in zip(ranks, arrays, strict=True)]
        for work in works:
            assert work is not None
            work.wait()
        assert all(np.all(a == 3.0) for a in arrays)
        in_flight = ranks[0].all_reduce(arrays[0], async_op=True)  # rank 1 never joins it
        assert in_flight is not None
        old_pid = ranks[0].daemon_pid
        new = restart(daemon, how)
        try:
            with pytest.raises(DaemonUnavailableError) as lost:
                in_flight.wait()
            # A stopping daemon fails it itself; a crashed one just closes the socket.
            expected = DaemonLostError if how == signal.SIGKILL else DaemonShuttingDownError
            assert isinstance(lost.value, expected), repr(lost.value)
            # Rank 1 was idle: its next call finds the session gone and reconnects.
            # Rank 0's too.  Both then run in a new session of the job.
            assert all(np.all(a == 3.0) for a in allreduce_on_both(ranks, 1 << 18))
            assert ranks[0].daemon_pid == ranks[1].daemon_pid == new.pid != old_pid
        finally:
            close_and_stop(ranks, new)
    finally:
        for client in ranks:
            client.close()


def close_and_stop(ranks: list[Client], daemon: DaemonProcess) -> None:
    """Close the clients, then stop the restarted daemon: a clean exit, no segment left."""
    for client in ranks:
        client.close()
    assert daemon.stop() == 0, daemon.log()
    assert not segments_of(daemon.pid)


def allreduce_on_both(ranks: list[Client], count: int) -> list[np.ndarray]:
    """A synchronous allreduce of `count` floats on both ranks (one thread each)."""
    arrays = [np.full(count, float(r + 1), np.float32) for r in range(2)]
    threads = [threading.Thread(target=c.all_reduce, args=(a,))
               for c, a in zip(ranks, arrays, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return arrays


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["restart", "crash"])
def test_a_run_of_fast_page_allreduces_moves_to_a_restarted_daemon(
    start_daemon: object, how: signal.Signals
) -> None:
    """Small allreduces end on the fast page, which needs no daemon, so a client looks
    for a lost one at most every PROBE_INTERVAL_S there: the first call after a restart
    still finds the new daemon and runs in a new session, on both ranks."""
    daemon: DaemonProcess = start_daemon()  # type: ignore[operator]
    ranks = [Client(daemon=daemon.endpoint, job="fast-restart", rank=r, world_size=2,
                    local_rank=r, local_world_size=2, timeout_s=20) for r in range(2)]
    try:
        assert 0 < 1024 * 4 <= ranks[0].fast_path_bytes
        for _ in range(50):
            assert all(np.all(a == 3.0) for a in allreduce_on_both(ranks, 1024))
        old_pid = ranks[0].daemon_pid
        new = restart(daemon, how)
        try:
            assert all(np.all(a == 3.0) for a in allreduce_on_both(ranks, 1024))
            assert ranks[0].daemon_pid == ranks[1].daemon_pid == new.pid != old_pid
        finally:
            close_and_stop(ranks, new)
    finally:
        for client in ranks:
            client.close()


def test_a_lost_daemon_is_a_daemon_lost_error(start_daemon: object) -> None:
    """An idle client whose daemon crashed: its next collective finds no daemon and
    says so; it raised DaemonLostError for the one in flight."""
    daemon: DaemonProcess = start_daemon()  # type: ignore[operator]
    client = Client(daemon=daemon.endpoint, job="lost", rank=0, world_size=2, local_rank=0,
                    local_world_size=2, timeout_s=20)
    try:
        work = client.all_reduce(np.ones(1024, np.float32), async_op=True)
        assert work is not None
        daemon.process.kill()
        daemon.process.wait(10)
        with pytest.raises(DaemonLostError, match="the connection"):
            work.wait()
        with pytest.raises(DaemonUnavailableError, match="no gradsync daemon answers"):
            client.all_reduce(np.ones(1024, np.float32))
    finally:
        client.close()


def test_a_job_broken_while_its_peer_restarted_fails_that_peers_ranks_at_once(
    start_daemon: Any,
) -> None:
    """Rank 0 of a two-daemon job joins on daemon A while daemon B restarts: A breaks
    the job (its peer lost before it formed), and the withdrawal it sends cannot
    reach B.  B comes back and rank 1 joins there: A answers B's announcement, and
    rank 1 fails now, naming A and why, not at its 20 s deadline.  A later run of
    the job under the same name is not told: it forms and reduces."""
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    flags = [peer_args(i, endpoints, "--insecure", "--peer-timeout-s", "2") for i in range(2)]
    a, b = start_daemon(*flags[0]), start_daemon(*flags[1])

    def client(daemon: DaemonProcess, rank: int) -> Client:
        return Client(daemon=daemon.endpoint, job="away", rank=rank, world_size=2,
                      local_rank=0, local_world_size=1, timeout_s=20)

    def reduce_across(ranks: list[Client]) -> None:
        arrays = [np.full(8, float(r + 1), np.float32) for r in range(2)]
        workers = [threading.Thread(target=ranks[r].all_reduce, args=(arrays[r],))
                   for r in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(30)
        for rank in ranks:
            rank.close()
        assert all(np.array_equal(x, np.full(8, 3.0, np.float32)) for x in arrays), arrays

    warm = [Client(daemon=d.endpoint, job="warm", rank=r, world_size=2, local_rank=0,
                   local_world_size=1, timeout_s=20) for r, d in enumerate((a, b))]
    reduce_across(warm)  # the link is up: B's leaving is a loss
    assert b.stop() == 0, b.log()
    with client(a, 0) as rank0, pytest.raises(PeerLostError, match="was lost"):
        rank0.all_reduce(np.ones(8, np.float32))
    back = launch_daemon(b.folder, *flags[1], name="d1")
    try:
        started = time.monotonic()
        with client(back, 1) as rank1, pytest.raises(
                PeerLostError, match=f"peer daemon {endpoints[0]} broke job 'away' before it "
                "formed, while this daemon was lost to it"):
            rank1.all_reduce(np.ones(8, np.float32))
        assert time.monotonic() - started < 12, "rank 1 waited for its deadline"

        # The two daemons serve jobs together again.
        reduce_across([Client(daemon=d.endpoint, job="away-2", rank=r, world_size=2,
                              local_rank=0, local_world_size=1, timeout_s=20)
                       for r, d in enumerate((a, back))])
    finally:
        assert back.stop() == 0, back.log()
