"""Membership races driven through the core (`ClusterJobs`) with a fake transport.

No sockets and no daemons: a `FakeTransport` records what this daemon would
send, and the tests hand it peers' messages in the orders that real links can
produce (a withdrawal over a data stream overtaking an announcement over
ZeroMQ, a restarted peer, a peer leaving right after its last slices) — races
that otherwise need ghost ZeroMQ peers and luck to reproduce.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from gradsync.daemon.algorithms import ALGORITHMS
from gradsync.daemon.config import DaemonConfig
from gradsync.daemon.core.cluster import ClusterJobs
from gradsync.daemon.core.matching import CollectiveCall, Job, Member, Submission
from gradsync.daemon.core.membership import Announcement, form
from gradsync.daemon.run.executor import ScheduleRun
from gradsync.protocol import peer as wire
from gradsync.protocol.dtypes import ReduceOp
from gradsync.protocol.errors import GradsyncError, PeerLostError, RankLostError

HERE = "tcp://10.0.0.1:7000"
PEER = "tcp://10.0.0.2:7000"
BOOT = 1234


class FakeTransport:
    """`PeerTransport` that records sends; every listed peer is up."""

    def __init__(self, endpoint: str, peers: Sequence[str]) -> None:
        self.endpoint = endpoint
        self._peers = list(peers)
        self.sent: list[tuple[str, dict[str, Any], tuple[Any, ...]]] = []

    @property
    def peers(self) -> Sequence[str]:
        return self._peers

    def post(self, peer: str, header: dict[str, Any], payloads: Sequence[Any] = (),
             zero_copy: bool = False) -> Any:
        self.sent.append((peer, header, tuple(payloads)))
        return None

    def link_costs(self) -> tuple[float, float] | None:
        return 5e-5, 1e-9

    def is_up(self, peer: str) -> bool:
        return True

    def kinds(self) -> list[str]:
        return [header["kind"] for _, header, _ in self.sent]


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


class RecordedFailures:
    """The daemon's failure path as the core sees it (run/runs.py's CollectiveRuns.fail):
    what the core failed, answered once, as CollectiveRuns answers."""

    def __init__(self) -> None:
        self.failed: list[tuple[Any, GradsyncError]] = []

    def fail(self, pending: CollectiveCall, error: GradsyncError) -> None:
        self.failed.append((pending.key, error))
        for submission in pending.submissions.values():
            submission.respond(error)


def still_clock() -> float:
    """Now, for the core: these tests wait for nothing."""
    return 1000.0


def core(loop: asyncio.AbstractEventLoop) -> tuple[ClusterJobs, FakeTransport, dict[str, Job]]:
    transport = FakeTransport(HERE, [HERE, PEER])
    jobs: dict[str, Job] = {}
    cluster = ClusterJobs(DaemonConfig(), jobs, still_clock)
    cluster.connect(transport, RecordedFailures())
    return cluster, transport, jobs


def local_job(cluster: ClusterJobs, jobs: dict[str, Job], loop: asyncio.AbstractEventLoop,
              name: str = "train") -> Job:
    """A world of 2: rank 0 here, rank 1 on PEER; our rank has joined."""
    job = Job(name, 2, 1, still_clock)
    job.add_member(Member(0, 0, 100, 1))
    jobs[name] = job
    cluster.local_complete(job)
    return job


def announce(incarnation: int, boot: int = BOOT, name: str = "train") -> dict[str, Any]:
    return wire.Announce(name, incarnation, boot, 2, (1,), 5e-5, 1e-9).to_wire()


def withdraw(incarnation: int, boot: int = BOOT, clean: bool = False,
             name: str = "train") -> dict[str, Any]:
    return wire.Withdraw(name, incarnation, boot, "rank 1 exited", RankLostError.code, PEER,
                         clean).to_wire()


def test_a_job_forms_once_the_peer_announces_and_tells_it_our_share(
    loop: asyncio.AbstractEventLoop,
) -> None:
    cluster, transport, jobs = core(loop)
    job = local_job(cluster, jobs, loop)
    assert transport.kinds() == ["announce", "announce"]  # to every listed peer
    assert wire.from_wire(transport.sent[0][1]) == job.across.announcement.share  # type: ignore[union-attr]
    assert job.across.formation is None
    cluster.on_message(PEER, announce(5), ())
    assert job.across.formation is not None and job.across.formation.daemons == (HERE, PEER)
    assert job.across.formed.result() is job.across.formation


def test_a_lost_peer_fails_a_pending_collective_through_the_one_failure_path(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Rank 0 of two local ranks submitted key 0 (rank 1 has not): the peer holding
    rank 2 is lost, and the pending key goes to the failure path, which answers it
    once (CollectiveRuns.fail: counted in the statistics, its deadline cancelled)."""
    cluster, _, jobs = core(loop)
    job = Job("three", 3, 2, still_clock)
    for rank in (0, 1):
        job.add_member(Member(rank, rank, 100 + rank, 2))
    jobs["three"] = job
    cluster.local_complete(job)
    cluster.on_message(PEER, wire.Announce("three", 5, BOOT, 3, (2,), 5e-5, 1e-9).to_wire(), ())
    assert job.across.formation is not None
    answers: list[GradsyncError | None] = []
    submission = Submission(0, wire.Fingerprint("allreduce", "float32", 4, "sum"), None,
                            lambda error, timing=None: answers.append(error), 30.0)
    assert job.submit(0, submission) is None  # pending: rank 1 has not come
    cluster.peer_lost(PEER)
    failures = cluster.failures
    assert isinstance(failures, RecordedFailures)
    assert [key for key, _ in failures.failed] == [0]
    assert isinstance(failures.failed[0][1], PeerLostError)
    assert len(answers) == 1 and isinstance(answers[0], PeerLostError)
    assert not job.pending


def test_a_withdrawal_that_overtook_its_announcement_drops_the_announcement(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """The withdrawal travels the data stream, the announcement ZeroMQ: the peer's
    job ended before we even heard it begin, so it must not form here."""
    cluster, _, jobs = core(loop)
    job = local_job(cluster, jobs, loop)
    cluster.on_message(PEER, withdraw(5), ())
    cluster.on_message(PEER, announce(5), ())
    assert cluster.counters.stale_membership == 1
    assert job.across.formation is None and job.broken is None
    # The peer's ranks come back: a newer incarnation of the same boot forms.
    cluster.on_message(PEER, announce(6), ())
    assert job.across.formation is not None


def test_an_old_withdrawal_arriving_after_a_newer_announcement_is_dropped(
    loop: asyncio.AbstractEventLoop,
) -> None:
    cluster, _, jobs = core(loop)
    job = local_job(cluster, jobs, loop)
    cluster.on_message(PEER, announce(7), ())
    formation = job.across.formation
    cluster.on_message(PEER, withdraw(6), ())
    assert cluster.counters.stale_membership == 1
    assert job.across.formation is formation and job.broken is None


def test_a_restarted_peer_with_a_lower_incarnation_ends_the_generation(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Incarnations only compare within one boot: a peer daemon that restarted
    (new boot) may count from lower, and its announcement is news, not stale —
    the formed generation cannot go on with ranks that restarted."""
    cluster, transport, jobs = core(loop)
    job = local_job(cluster, jobs, loop)
    cluster.on_message(PEER, announce(900), ())
    assert job.across.formation is not None
    cluster.on_message(PEER, announce(3, boot=BOOT + 1), ())
    assert cluster.counters.stale_membership == 0
    assert isinstance(job.broken, PeerLostError)
    assert PEER in job.broken.message and "re-created" in job.broken.message
    assert "withdraw" in transport.kinds()  # peers hear that we stop counting on it


def _star_run(cluster: ClusterJobs, job: Job, transport: FakeTransport,
              loop: asyncio.AbstractEventLoop, buffer: np.ndarray) -> ScheduleRun:
    """The root's side (daemon 0) of a star allreduce over the job's formation."""
    assert job.across.formation is not None
    schedule = ALGORITHMS["star"](0, 2, buffer.size)
    fingerprint = wire.Fingerprint("allreduce", "float32", buffer.size, "sum", "star")

    def send(peer: int, header: dict[str, Any], payload: Any, zero_copy: bool) -> Any:
        return transport.post(job.across.formation.daemons[peer], header, (payload,))  # type: ignore[union-attr]

    run = ScheduleRun(schedule, buffer, ReduceOp.SUM, send, 1 << 20, loop,
                      fingerprint=fingerprint, algorithm="star")
    cluster.run_started(job, 0, run)
    run.start()
    return run


def _slice_from_peer(job: Job, data: np.ndarray) -> dict[str, Any]:
    assert job.across.formation is not None
    fingerprint = wire.Fingerprint("allreduce", "float32", data.size, "sum", "star")
    return wire.Slice(job.name, job.across.formation.generation, 0, fingerprint, 0, 0, 0).to_wire()


def test_a_peer_leaving_after_its_last_slices_does_not_fail_the_collective(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """The leaf sends its part and its ranks exit at once: its (clean) withdrawal
    arrives while the root still runs the collective, which needs nothing more
    from it, so it completes; the job then ends quietly."""
    cluster, transport, jobs = core(loop)
    job = local_job(cluster, jobs, loop)
    cluster.on_message(PEER, announce(5), ())
    ours, theirs = np.full(8, 1.0, np.float32), np.full(8, 2.0, np.float32)
    run = _star_run(cluster, job, transport, loop, ours)
    cluster.on_message(PEER, _slice_from_peer(job, theirs), (theirs.tobytes(),))
    cluster.on_message(PEER, withdraw(5, clean=True), ())
    assert isinstance(job.broken, RankLostError) and job.across.ended_cleanly
    assert run.done.done() and run.done.exception() is None
    np.testing.assert_array_equal(ours, np.full(8, 3.0, np.float32))


def test_a_peer_leaving_before_its_slices_fails_the_collective_naming_it(
    loop: asyncio.AbstractEventLoop,
) -> None:
    cluster, transport, jobs = core(loop)
    job = local_job(cluster, jobs, loop)
    cluster.on_message(PEER, announce(5), ())
    run = _star_run(cluster, job, transport, loop, np.full(8, 1.0, np.float32))
    cluster.on_message(PEER, withdraw(5), ())
    error = run.done.exception()
    assert isinstance(error, RankLostError) and PEER in error.message, error


def test_slices_before_the_job_forms_are_kept_and_replayed(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """A fast peer's first slice can arrive before its announcement: it waits
    (counted against max_shm_bytes) and reaches the collective once it runs."""
    cluster, transport, jobs = core(loop)
    job = local_job(cluster, jobs, loop)
    theirs = np.full(8, 2.0, np.float32)
    announcements = {HERE: job.across.announcement,
                     PEER: Announcement(PEER, wire.Announce.from_wire(announce(5)))}
    formation = form(announcements, 2)  # type: ignore[arg-type]
    assert formation is not None
    early = wire.Slice(job.name, formation.generation, 0,
                       wire.Fingerprint("allreduce", "float32", 8, "sum", "star"), 0, 0, 0)
    cluster.on_message(PEER, early.to_wire(), (theirs.tobytes(),))
    assert job.across.early.nbytes == theirs.nbytes and job.across.formation is None
    cluster.on_message(PEER, announce(5), ())
    assert job.across.formation == formation
    # Now it waits for its collective (key 0) to start here.
    assert list(job.across.early.by_key) == [0] and not job.across.early.unformed
    ours = np.full(8, 1.0, np.float32)
    run = _star_run(cluster, job, transport, loop, ours)
    cluster.feed_early(job, 0, run)
    assert job.across.early.nbytes == 0
    assert run.done.done() and run.done.exception() is None
    np.testing.assert_array_equal(ours, np.full(8, 3.0, np.float32))


def test_malformed_and_unknown_messages_are_counted_not_raised(
    loop: asyncio.AbstractEventLoop,
) -> None:
    cluster, _, jobs = core(loop)
    job = local_job(cluster, jobs, loop)
    cluster.on_message(PEER, {**announce(5), "ranks": [1, 1]}, ())
    cluster.on_message(PEER, {"kind": "withdraw", "job": "train"}, ())
    cluster.on_message(PEER, {"kind": "rumour", "job": "train"}, ())
    assert cluster.counters.malformed == 3 and job.across.formation is None
    cluster.on_message(PEER, announce(5, name="other"), ())  # no such job here
    assert cluster.counters.malformed == 3 and "other" in cluster.remote
