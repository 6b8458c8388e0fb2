"""Which peers a daemon heartbeats (daemon/core/watching.py), and which peers its
jobs use (ClusterJobs.peers_in_use): no sockets."""

from __future__ import annotations

import asyncio

import pytest
from test_core_membership import HERE, PEER, THEIRS, _formed_theirs, core, local_job
from test_core_membership import loop as loop  # the fixture

from gradsync.daemon.core.failure_detector import DetectorTimings, FailureDetector
from gradsync.daemon.core.watching import neighbour_count, ring_neighbours
from gradsync.protocol.errors import RankLostError

DAEMONS = [f"tcp://10.0.{i // 256}.{i % 256}:29400" for i in range(64)]


def test_a_few_daemons_watch_every_other() -> None:
    for size in (1, 2, 3, 4, 5, 7):
        assert ring_neighbours(DAEMONS[0], DAEMONS[:size]) is None, size
    assert neighbour_count(8) == 3 and neighbour_count(1024) == 10
    assert ring_neighbours(DAEMONS[0], DAEMONS[:8]) is not None


def test_each_daemon_watches_its_nearest_on_either_side_and_is_watched_by_them() -> None:
    ring = sorted(DAEMONS)
    watched = {me: ring_neighbours(me, DAEMONS) for me in DAEMONS}
    assert all(w is not None and len(w) == 2 * 6 for w in watched.values())  # log2 64 = 6
    for me, mine in watched.items():
        assert mine is not None and me not in mine
        index = ring.index(me)
        assert {ring[(index + 1) % 64], ring[index - 1], ring[(index + 6) % 64]} <= mine
        assert ring[(index + 7) % 64] not in mine
        for other in mine:  # mutual
            theirs = watched[other]
            assert theirs is not None and me in theirs
    # The same whatever order the daemon lists them in, itself included or not.
    assert ring_neighbours(DAEMONS[5], reversed(DAEMONS)) == watched[DAEMONS[5]]
    assert ring_neighbours(DAEMONS[5], DAEMONS[:5] + DAEMONS[6:]) == watched[DAEMONS[5]]
    at = ring.index(DAEMONS[5])
    assert ring_neighbours(DAEMONS[5], DAEMONS, count=1) == {ring[at - 1], ring[at + 1]}


def test_a_suspects_neighbours_are_asked_about_it_first() -> None:
    now = [0.0]
    detector = FailureDetector(DetectorTimings.for_timeout(10.0), lambda: now[0])
    suspect, near, *far = DAEMONS[1:8]
    for peer in (suspect, near, *far):
        detector.watch(peer)
    detector.watchers = lambda peer: {near} if peer == suspect else set()
    asked: tuple[str, ...] = ()
    while not asked:
        now[0] += 0.1
        for peer in (near, *far):  # the far ones heard later than `near`
            detector.heard(peer)
        asks = [a for a in detector.tick() if getattr(a, "peer", None) == suspect]
        asked = getattr(asks[0], "witnesses", ()) if asks else ()
    assert asked[0] == near and len(asked) == 3


def test_the_peers_a_job_uses_are_its_members_and_coordinator(
    loop: asyncio.AbstractEventLoop,
) -> None:
    cluster, _, jobs = core(loop)
    assert cluster.peers_in_use() == set()
    job = local_job(cluster, jobs, loop, THEIRS)  # announced to PEER, its coordinator
    assert cluster.peers_in_use() == {PEER}
    _formed_theirs(cluster, job)
    assert cluster.peers_in_use() == {PEER} and HERE not in cluster.peers_in_use()
    cluster.broke_here(job, RankLostError("rank 0 left"))  # withdrawn: its coordinator forgot
    del jobs[THEIRS]  # its ranks gone: the job too
    assert cluster.peers_in_use() == set()


def test_a_coordinator_uses_the_announcers_of_what_it_coordinates(
    loop: asyncio.AbstractEventLoop,
) -> None:
    import gradsync.protocol.peer as wire

    cluster, _, _ = core(loop)
    cluster.on_message(PEER, wire.Announce("other", 5, 1, 2, (1,), 5e-5, 1e-9).to_wire(), ())
    assert cluster.peers_in_use() == {PEER}


@pytest.mark.parametrize("size", [16, 256])
def test_at_rest_a_daemon_heartbeats_2_log2_m_peers(size: int) -> None:
    from benchmarks.membership_scale import at_rest_per_daemon_s

    per_peer = 4 * (10 + 1)  # sent and received, pings and answers, live and DEALER
    assert at_rest_per_daemon_s(size) == per_peer * 2 * neighbour_count(size)


def test_a_standby_watches_the_coordinator_not_the_announcers() -> None:
    from test_core_membership import core_among

    import gradsync.protocol.peer as wire
    from gradsync.daemon.core.membership import coordinators_of

    third = "tcp://10.0.0.3:7000"
    cluster, _, _ = core_among([HERE, PEER, third])
    standby = next(n for n in (f"s{i}" for i in range(100))
                   if coordinators_of(n, [HERE, PEER, third]) == (PEER, HERE))
    acting = next(n for n in (f"a{i}" for i in range(100))
                  if coordinators_of(n, [HERE, PEER, third])[0] == HERE)
    cluster.on_message(third, wire.Announce(standby, 5, 1, 3, (1,), 5e-5, 1e-9).to_wire(), ())
    assert cluster.peers_in_use() == {PEER}  # the coordinator, should it be lost
    cluster.on_message(third, wire.Announce(acting, 5, 1, 3, (1,), 5e-5, 1e-9).to_wire(), ())
    assert cluster.peers_in_use() == {PEER, third}  # and the announcer here
