"""One failure path (issue 46, part 3): every way a collective can fail is
answered once, counted in the daemon's statistics (`failed`, and the error's
code under `errors`) and leaves no deadline timer armed (`deadline_timers`).

Real daemons in subprocesses; the ranks are `Client`s in this process (a
failure answers them before the daemon's counters could lag: the daemon
counts, cancels the timer, then answers).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from test_multinode_failures import insecure_daemons, peer_state

from conftest import DaemonProcess, poll_until
from gradsync.client import (
    Client,
    CollectiveTimeoutError,
    DaemonShuttingDownError,
    GradsyncError,
    PeerLostError,
    RankLostError,
)
from gradsync.client.cli.stats import fetch_snapshot
from gradsync.client.ping import query

StartDaemon = Callable[..., DaemonProcess]


def failures_of(daemon: DaemonProcess) -> tuple[int, dict[str, int], int]:
    """(collectives failed, failures by error code, deadline timers armed)."""
    counters = query(daemon.endpoint, 5.0)["counters"]
    errors = fetch_snapshot(daemon.endpoint + ".stats", 5.0)["errors"]
    return int(counters["failed"]), dict(errors), int(counters["deadline_timers"])


@contextmanager
def counted_once(daemon: DaemonProcess, error: type[GradsyncError]) -> Iterator[None]:
    """The block fails one collective on `daemon` with `error`: counted once, by
    its code, and no deadline timer left armed."""
    failed, errors, _ = failures_of(daemon)
    yield
    failed_after, errors_after, armed = failures_of(daemon)
    assert failed_after == failed + 1, (failed, failed_after)
    assert errors_after.get(error.code, 0) == errors.get(error.code, 0) + 1, errors_after
    assert armed == 0, f"{armed} deadline timers left armed"


def clients(endpoint: str, job: str, ranks: list[int], world: int,
            **options: Any) -> list[Client]:
    """The job's `ranks` held by one daemon (its local ranks, in order)."""
    return [Client(endpoint, job=job, rank=rank, world_size=world, local_rank=local,
                   local_world_size=len(ranks), **options)
            for local, rank in enumerate(ranks)]


@pytest.mark.timeout(60)
def test_a_pending_collective_that_times_out(daemon: DaemonProcess) -> None:
    first, second = clients(daemon.endpoint, "late", [0, 1], 2, timeout_s=1.0)
    try:
        with counted_once(daemon, CollectiveTimeoutError), pytest.raises(CollectiveTimeoutError):
            first.all_reduce(np.ones(8, np.float32))
    finally:
        first.close()
        second.close()


@pytest.mark.timeout(60)
def test_a_pending_collective_whose_other_rank_leaves(daemon: DaemonProcess) -> None:
    first, second = clients(daemon.endpoint, "leaver", [0, 1], 2)
    try:
        with counted_once(daemon, RankLostError):
            work = first.all_reduce(np.ones(8, np.float32), async_op=True)
            assert work is not None
            first.empty(4, np.float32)  # answered in order: the all_reduce is pending now
            second.close()
            with pytest.raises(RankLostError):
                work.wait()
    finally:
        first.close()


@pytest.mark.timeout(90)
def test_a_collective_waiting_for_its_job_to_form_when_the_peer_is_lost(
    start_daemon: StartDaemon,
) -> None:
    endpoints, (here, there) = insecure_daemons(start_daemon, 2)
    # A peer lost is one whose link was up (one never reached may yet come).
    poll_until(lambda: peer_state(here, endpoints[1]) == "up", 30, "the link to be up")
    (rank,) = clients(here.endpoint, "unformed", [0], 2)
    try:
        with counted_once(here, PeerLostError):
            work = rank.all_reduce(np.ones(8, np.float32), async_op=True)
            assert work is not None
            rank.empty(4, np.float32)
            there.process.send_signal(signal.SIGKILL)
            there.process.wait(10)
            with pytest.raises(PeerLostError, match="before the job formed"):
                work.wait()
    finally:
        rank.close()
    here.assert_alive()


@pytest.mark.timeout(90)
def test_a_pending_collective_whose_job_breaks_on_the_peer(start_daemon: StartDaemon) -> None:
    _, (here, there) = insecure_daemons(start_daemon, 2)
    local = clients(here.endpoint, "broken", [0, 1], 3)
    (remote,) = clients(there.endpoint, "broken", [2], 3)
    try:
        arrays = [np.ones(8, np.float32) for _ in range(3)]
        works = [c.all_reduce(a, async_op=True) for c, a in zip([*local, remote], arrays,
                                                                 strict=True)]
        for work in works:
            assert work is not None and work.wait()  # the job formed and ran
        with counted_once(here, RankLostError):
            work = local[0].all_reduce(np.ones(8, np.float32), async_op=True)
            assert work is not None
            local[0].empty(4, np.float32)  # pending: rank 1 has not submitted
            remote.close()  # rank 2 leaves: the peer withdraws the job
            with pytest.raises(RankLostError):
                work.wait()
    finally:
        for client in local:
            client.close()
    here.assert_alive()


def formed_pair(start_daemon: StartDaemon, job: str,
                **options: Any) -> tuple[list[DaemonProcess], list[Client]]:
    """Two daemons with one rank each, whose job has formed and run a collective."""
    _, daemons = insecure_daemons(start_daemon, 2)
    ranks = [clients(d.endpoint, job, [i], 2, **options)[0] for i, d in enumerate(daemons)]
    works = [r.all_reduce(np.ones(8, np.float32), async_op=True) for r in ranks]
    for work in works:
        assert work is not None and work.wait()
    return daemons, ranks


@pytest.mark.timeout(90)
def test_a_running_collective_whose_peer_is_lost(start_daemon: StartDaemon) -> None:
    (here, there), (rank, other) = formed_pair(start_daemon, "running")
    try:
        with counted_once(here, PeerLostError):
            work = rank.all_reduce(np.ones(1024, np.float32), async_op=True)
            assert work is not None
            rank.empty(4, np.float32)  # running here: it waits for the peer's slices
            there.process.send_signal(signal.SIGKILL)
            there.process.wait(10)
            with pytest.raises(PeerLostError):
                work.wait()
    finally:
        rank.close()
        other.close()
    here.assert_alive()


@pytest.mark.timeout(90)
def test_a_running_collective_that_times_out(start_daemon: StartDaemon) -> None:
    (here, there), (rank, other) = formed_pair(start_daemon, "slow", timeout_s=1.5)
    try:
        with (counted_once(here, CollectiveTimeoutError),
              pytest.raises(CollectiveTimeoutError, match="waiting for peer daemons")):
            rank.all_reduce(np.ones(1024, np.float32))
        # The peer heard of it (once): its rank, late, gets the error at once.
        with pytest.raises(CollectiveTimeoutError):
            other.all_reduce(np.ones(1024, np.float32))
    finally:
        rank.close()
        other.close()
    _, _, armed = failures_of(there)
    assert armed == 0
    here.assert_alive()


@pytest.mark.timeout(60)
def test_a_pending_collective_when_the_daemon_stops(daemon: DaemonProcess) -> None:
    """The daemon's statistics go with it: what shows is the one answer."""
    first, second = clients(daemon.endpoint, "stopping", [0, 1], 2)
    try:
        work = first.all_reduce(np.ones(8, np.float32), async_op=True)
        assert work is not None
        first.empty(4, np.float32)
        _, _, armed = failures_of(daemon)
        assert armed == 1  # the pending key's deadline
        daemon.process.send_signal(signal.SIGTERM)
        with pytest.raises(DaemonShuttingDownError):
            work.wait()
    finally:
        first.close()
        second.close()
    assert daemon.process.wait(20) == 0, daemon.log()
