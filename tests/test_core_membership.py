"""Membership races driven through the core (`ClusterJobs`) with a fake transport.

No sockets and no daemons: a `FakeTransport` records what this daemon would
send, and the tests hand it peers' messages in the orders that real links can
produce (a withdrawal over a data stream overtaking an announcement over
ZeroMQ, a restarted peer, a peer leaving right after its last slices) — races
that otherwise need ghost ZeroMQ peers and luck to reproduce.

Job "train" is coordinated here (HERE is its coordinator among HERE and PEER,
and PEER its standby: membership.py `coordinators_of`), job "three" by PEER
(HERE its standby); the tests use the one whose side they drive.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from gradsync.daemon.algorithms import ALGORITHMS
from gradsync.daemon.config import DaemonConfig
from gradsync.daemon.core.cluster import ClusterJobs
from gradsync.daemon.core.formed_parts import formed_parts
from gradsync.daemon.core.matching import CollectiveCall, Job, Member, Submission
from gradsync.daemon.core.membership import BOOT as OUR_BOOT
from gradsync.daemon.core.membership import Announcement, coordinator_of, coordinators_of, form
from gradsync.daemon.run.executor import ScheduleRun
from gradsync.protocol import peer as wire
from gradsync.protocol.dtypes import ReduceOp
from gradsync.protocol.errors import GradsyncError, PeerLostError, RankLostError

HERE = "tcp://10.0.0.1:7000"
PEER = "tcp://10.0.0.2:7000"
BOOT = 1234
#: A job coordinated here, and one coordinated by PEER.
OURS, THEIRS = "train", "three"


class FakeTransport:
    """`PeerTransport` that records sends; every listed peer is up."""

    def __init__(self, endpoint: str, peers: Sequence[str]) -> None:
        self.endpoint = endpoint
        self._peers = list(peers)
        self.sent: list[tuple[str, dict[str, Any], tuple[Any, ...]]] = []
        self.down: set[str] = set()

    @property
    def peers(self) -> Sequence[str]:
        return self._peers

    def post(self, peer: str, header: dict[str, Any], payloads: Sequence[Any] = (),
             zero_copy: bool = False) -> Any:
        self.sent.append((peer, header, tuple(payloads)))
        return None

    def link_costs(self) -> tuple[float, float] | None:
        return 5e-5, 1e-9

    def reachable(self, peer: str) -> bool:
        return peer not in self.down

    def kinds(self) -> list[str]:
        return [header["kind"] for _, header, _ in self.sent]

    def of_kind(self, kind: str) -> list[tuple[str, Any]]:
        """(receiver, typed message) of each message of `kind` sent."""
        return [(peer, wire.from_wire(header)) for peer, header, _ in self.sent
                if header.get("kind") == kind]


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
    return core_among([HERE, PEER])


def core_among(daemons: Sequence[str]) -> tuple[ClusterJobs, FakeTransport, dict[str, Job]]:
    """This daemon's core, HERE among `daemons`, every one up."""
    transport = FakeTransport(HERE, daemons)
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


def announce(incarnation: int, boot: int = BOOT, name: str = OURS) -> dict[str, Any]:
    return wire.Announce(name, incarnation, boot, 2, (1,), 5e-5, 1e-9).to_wire()


def withdraw(incarnation: int, boot: int = BOOT, clean: bool = False,
             name: str = OURS) -> dict[str, Any]:
    return wire.Withdraw(name, incarnation, boot, "rank 1 exited", RankLostError.code, PEER,
                         clean).to_wire()


def formed_by_peer(job: Job, *shares: wire.Announce) -> list[dict[str, Any]]:
    """What PEER, coordinating `job`, sends us once `shares` and ours cover it."""
    assert job.across.announcement is not None
    table = {HERE: job.across.announcement,
             **{PEER if i == 0 else f"tcp://10.0.0.{3 + i}:7000": Announcement(
                 PEER if i == 0 else f"tcp://10.0.0.{3 + i}:7000", share)
                for i, share in enumerate(shares)}}
    formation = form(table, job.world_size)
    assert formation is not None
    return [part.to_wire() for part in formed_parts(job.name, job.world_size, formation)]


def test_the_two_jobs_have_the_coordinators_the_tests_assume() -> None:
    assert coordinator_of(OURS, [HERE, PEER]) == HERE
    assert coordinator_of(THEIRS, [PEER, HERE]) == PEER


def test_a_job_coordinated_here_forms_and_the_member_hears_the_formation(
    loop: asyncio.AbstractEventLoop,
) -> None:
    cluster, transport, jobs = core(loop)
    job = local_job(cluster, jobs, loop)
    # Our announcement stays here, with the coordinator, and goes to PEER, its standby.
    assert [to for to, _ in transport.of_kind("announce")] == [PEER]
    assert job.across.formation is None
    cluster.on_message(PEER, announce(5), ())
    assert job.across.formation is not None and job.across.formation.daemons == (HERE, PEER)
    assert job.across.formed.result() is job.across.formation
    [(to, formed)] = transport.of_kind("formed")
    assert to == PEER and formed.gen == job.across.formation.generation
    assert formed.part == ((HERE, OUR_BOOT, job.across.incarnation, (0,)), (PEER, BOOT, 5, (1,)))
    # PEER asks again (its link came back): it hears the same formation again.
    cluster.on_message(PEER, announce(5), ())
    assert [m.gen for _, m in transport.of_kind("formed")] == [formed.gen] * 2


def test_a_job_coordinated_by_the_peer_forms_on_its_word_only(
    loop: asyncio.AbstractEventLoop,
) -> None:
    cluster, transport, jobs = core(loop)
    job = local_job(cluster, jobs, loop, THEIRS)
    [(to, ours)] = transport.of_kind("announce")
    assert job.across.announcement is not None
    assert to == PEER and ours == dataclasses.replace(job.across.announcement.share, lead=True)
    share = wire.Announce(THEIRS, 5, BOOT, 2, (1,), 5e-5, 1e-9)
    cluster.on_message(PEER, share.to_wire(), ())  # an announcement: not ours to gather
    assert job.across.formation is None
    for part in formed_by_peer(job, share):
        cluster.on_message(PEER, part, ())
    assert job.across.formation is not None and job.across.formation.daemons == (HERE, PEER)


def test_a_formation_of_an_earlier_run_of_ours_is_stale(
    loop: asyncio.AbstractEventLoop,
) -> None:
    cluster, _, jobs = core(loop)
    job = local_job(cluster, jobs, loop, THEIRS)
    old = formed_by_peer(job, wire.Announce(THEIRS, 5, BOOT, 2, (1,), 5e-5, 1e-9))
    cluster.local_complete(job)  # our ranks created the job anew: a new incarnation
    for part in old:
        cluster.on_message(PEER, part, ())
    assert job.across.formation is None and cluster.counters.stale_membership == 1


def test_a_formation_that_does_not_add_up_is_refused(loop: asyncio.AbstractEventLoop) -> None:
    cluster, _, jobs = core(loop)
    job = local_job(cluster, jobs, loop, THEIRS)
    (part,) = formed_by_peer(job, wire.Announce(THEIRS, 5, BOOT, 2, (1,), 5e-5, 1e-9))
    cluster.on_message(PEER, {**part, "gen": part["gen"] ^ 1}, ())  # not the members' hash
    cluster.on_message(PEER, {**part, "part": part["part"][:1], "members": 1}, ())  # rank 1?
    assert cluster.counters.malformed == 2 and job.across.formation is None


def test_a_large_formation_comes_in_parts_that_each_fit_a_header() -> None:
    from gradsync.daemon.core.formed_parts import FormedAssembly
    from gradsync.daemon.peers.wire import encode_header

    daemons = [f"tcp://node-{i:04d}.rack-{i // 40:02d}.example.org:29400" for i in range(2048)]
    shares = {d: Announcement(d, wire.Announce("big", 1, 7, 8 * 2048,
                                               tuple(range(8 * i, 8 * i + 8)), 5e-5, 1e-9))
              for i, d in enumerate(daemons)}
    formation = form(shares, 8 * 2048)
    assert formation is not None
    parts = formed_parts("big", 8 * 2048, formation)
    assert len(parts) > 1
    for part in parts:
        encode_header(HERE, part.to_wire())  # raises if over the frame limit
    assembly = FormedAssembly()
    results = [assembly.add(wire.Formed.from_wire(p.to_wire())) for p in reversed(parts)]
    assert results[:-1] == [None] * (len(parts) - 1) and results[-1] == formation


def test_a_lost_peer_fails_a_pending_collective_through_the_one_failure_path(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Rank 0 of two local ranks submitted key 0 (rank 1 has not): the peer holding
    rank 2 is lost, and the pending key goes to the failure path, which answers it
    once (CollectiveRuns.fail: counted in the statistics, its deadline cancelled)."""
    cluster, _, jobs = core(loop)
    job = Job(THEIRS, 3, 2, still_clock)
    for rank in (0, 1):
        job.add_member(Member(rank, rank, 100 + rank, 2))
    jobs[THEIRS] = job
    cluster.local_complete(job)
    for part in formed_by_peer(job, wire.Announce(THEIRS, 5, BOOT, 3, (2,), 5e-5, 1e-9)):
        cluster.on_message(PEER, part, ())
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
    assert cluster.coordination.held[OURS] == 2  # ranks 0 and 1, each counted once


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
    cluster, _, jobs = core(loop)
    job = local_job(cluster, jobs, loop)
    cluster.on_message(PEER, announce(900), ())
    assert job.across.formation is not None
    cluster.on_message(PEER, announce(3, boot=BOOT + 1), ())
    assert cluster.counters.stale_membership == 0
    assert isinstance(job.broken, PeerLostError)
    assert PEER in job.broken.message and "re-created" in job.broken.message
    # Our withdrawal reached the coordinator (here): the new generation will not
    # count on our old run.
    assert HERE not in cluster.coordination.tables.get(OURS, {})


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
    cluster.on_message(PEER, announce(5, name="other"), ())  # no such job here: coordinated
    assert cluster.counters.malformed == 3 and "other" in cluster.coordination.tables


def _formed_theirs(cluster: ClusterJobs, job: Job) -> None:
    for part in formed_by_peer(job, wire.Announce(THEIRS, 5, BOOT, 2, (1,), 5e-5, 1e-9)):
        cluster.on_message(PEER, part, ())
    assert job.across.formation is not None


def _left(job: Job, clean: bool) -> dict[str, Any]:
    assert job.across.formation is not None
    return wire.Left(job.name, job.across.formation.generation, PEER, "rank 1 exited",
                     RankLostError.code, PEER, clean).to_wire()


def test_news_that_a_member_left_waits_for_its_own_withdrawal_behind_its_slices(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """The coordinator's word that PEER left can overtake PEER's last slices (they
    come down PEER's own stream): a collective that still waits for them asks PEER
    for its withdrawal, and fails only once that comes, with nothing before it."""
    cluster, transport, jobs = core(loop)
    job = local_job(cluster, jobs, loop, THEIRS)
    _formed_theirs(cluster, job)
    run = _star_run(cluster, job, transport, loop, np.full(8, 1.0, np.float32))
    cluster.on_message(PEER, _left(job, clean=False), ())
    assert isinstance(job.broken, RankLostError) and not run.done.done()
    [(to, drain)] = transport.of_kind("drain")
    assert to == PEER and (drain.boot, drain.incarnation) == (BOOT, 5)
    cluster.on_message(PEER, withdraw(5, name=THEIRS), ())
    error = run.done.exception()
    assert isinstance(error, RankLostError) and PEER in error.message, error


def test_news_that_a_member_left_after_its_slices_fails_nothing(
    loop: asyncio.AbstractEventLoop,
) -> None:
    cluster, transport, jobs = core(loop)
    job = local_job(cluster, jobs, loop, THEIRS)
    _formed_theirs(cluster, job)
    ours, theirs = np.full(8, 1.0, np.float32), np.full(8, 2.0, np.float32)
    run = _star_run(cluster, job, transport, loop, ours)
    cluster.on_message(PEER, _slice_from_peer(job, theirs), (theirs.tobytes(),))
    cluster.on_message(PEER, _left(job, clean=True), ())
    assert job.across.ended_cleanly and transport.of_kind("drain") == []
    assert run.done.done() and run.done.exception() is None
    np.testing.assert_array_equal(ours, np.full(8, 3.0, np.float32))


def test_a_member_asked_to_drain_sends_its_withdrawal_again_to_the_asker(
    loop: asyncio.AbstractEventLoop,
) -> None:
    cluster, transport, jobs = core(loop)
    job = local_job(cluster, jobs, loop, THEIRS)
    _formed_theirs(cluster, job)
    cluster.broke_here(job, RankLostError("rank 0 disconnected"))
    [(to, ours)] = transport.of_kind("withdraw")
    assert to == PEER  # to the coordinator alone
    cluster.on_message(PEER, wire.Drain(THEIRS, OUR_BOOT, job.across.incarnation).to_wire(), ())
    assert transport.of_kind("withdraw") == [(PEER, ours)] * 2
    cluster.on_message(PEER, wire.Drain(THEIRS, OUR_BOOT + 1, job.across.incarnation).to_wire(),
                       ())
    assert len(transport.of_kind("withdraw")) == 2 and cluster.counters.stale_membership == 1


def test_the_coordinator_passes_on_the_first_withdrawal_of_a_generation_only(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Three daemons, coordinated here: the first member to leave is news to the
    others; the withdrawals that answer it are news to no one."""
    third = "tcp://10.0.0.3:7000"
    cluster, transport, jobs = core_among([HERE, PEER, third])
    name = next(n for n in (f"j{i}" for i in range(100))
                if coordinator_of(n, [HERE, PEER, third]) == HERE)
    job = Job(name, 3, 1, still_clock)
    job.add_member(Member(0, 0, 100, 1))
    jobs[name] = job
    cluster.local_complete(job)
    cluster.on_message(PEER, wire.Announce(name, 5, BOOT, 3, (1,), 5e-5, 1e-9).to_wire(), ())
    cluster.on_message(third, wire.Announce(name, 9, BOOT, 3, (2,), 5e-5, 1e-9).to_wire(), ())
    assert job.across.formation is not None
    assert sorted(to for to, _ in transport.of_kind("formed")) == [PEER, third]
    cluster.on_message(PEER, wire.Withdraw(name, 5, BOOT, "rank 1 died", RankLostError.code,
                                           PEER, False).to_wire(), ())
    [(to, left)] = transport.of_kind("left")
    assert to == third and left.daemon == PEER and left.origin == PEER
    assert isinstance(job.broken, RankLostError) and PEER in job.broken.message
    cluster.on_message(third, wire.Withdraw(name, 9, BOOT, job.broken.message,
                                            RankLostError.code, PEER, False).to_wire(), ())
    assert len(transport.of_kind("left")) == 1 and name not in cluster.coordination.tables


def test_a_coordinator_that_loses_an_announcer_tells_the_others_it_cannot_form(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """PEER announced rank 1 of a world of 3 to us (coordinating), our rank 0 waits
    for rank 2: PEER is lost, so rank 1 can join nowhere: ours fails now, naming
    PEER and the rank.  PEER back (a restart) is told why its job broke here."""
    cluster, transport, jobs = core(loop)
    job = Job(OURS, 3, 1, still_clock)
    job.add_member(Member(0, 0, 100, 1))
    jobs[OURS] = job
    cluster.local_complete(job)
    cluster.on_message(PEER, wire.Announce(OURS, 5, BOOT, 3, (1,), 5e-5, 1e-9).to_wire(), ())
    transport.down.add(PEER)
    cluster.peer_lost(PEER, "declared lost")
    assert isinstance(job.broken, PeerLostError), job.broken
    assert PEER in job.broken.message and "[1]" in job.broken.message
    assert "declared lost" in job.broken.message
    del jobs[OURS]
    transport.down.clear()
    cluster.peer_up(PEER)
    [(to, broke)] = transport.of_kind("broke")
    assert to == PEER and broke.job == OURS and PEER in broke.reason
    cluster.peer_up(PEER)
    assert len(transport.of_kind("broke")) == 1  # told once


def test_a_daemon_told_its_job_broke_while_it_was_away_fails_that_run(
    loop: asyncio.AbstractEventLoop,
) -> None:
    cluster, _, jobs = core(loop)
    cluster.on_message(PEER, wire.Broke(THEIRS, "peer daemon X was lost", "peer_lost")
                       .to_wire(), ())
    job = local_job(cluster, jobs, loop, THEIRS)  # rank 0 joins after the news
    assert isinstance(job.broken, PeerLostError)
    assert f"peer daemon {PEER} broke job '{THEIRS}' before it formed" in job.broken.message
    again = local_job(cluster, jobs, loop, THEIRS)  # a later run is not told
    assert again.broken is None


def test_announcements_follow_the_coordinator_when_it_is_lost(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """A job's coordinator (PEER) is lost before the job forms: the announcement
    goes to the next one (here, of the two left), and again to PEER once it is
    back."""
    third = "tcp://10.0.0.3:7000"
    cluster, transport, jobs = core_among([HERE, PEER, third])
    name = next(n for n in (f"j{i}" for i in range(100))
                if coordinator_of(n, [HERE, PEER, third]) == PEER
                and coordinator_of(n, [HERE, third]) == HERE)
    job = Job(name, 3, 1, still_clock)
    job.add_member(Member(0, 0, 100, 1))
    jobs[name] = job
    cluster.local_complete(job)
    # To PEER, and to its standby: here, among the three.
    assert [to for to, _ in transport.of_kind("announce")] == [PEER]
    assert HERE in cluster.coordination.tables[name] and job.across.formation is None
    transport.down.add(PEER)
    cluster.peer_lost(PEER)
    assert job.broken is None  # ranks 1 and 2 may still join on the third daemon
    assert cluster.forming.coordinators[name] == HERE
    assert [to for to, _ in transport.of_kind("announce")] == [PEER, third]  # the new standby
    transport.down.clear()
    cluster.peer_up(PEER)
    assert [to for to, _ in transport.of_kind("announce")] == [PEER, third, PEER]


def test_news_of_a_generation_that_ended_before_it_formed_here_ends_the_run(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """The formation came, but our link to PEER is not up yet, so the job waits to
    form here; PEER leaves meanwhile: the run here fails now, not at its deadline."""
    cluster, transport, jobs = core(loop)
    job = local_job(cluster, jobs, loop, THEIRS)
    transport.down.add(PEER)
    parts = formed_by_peer(job, wire.Announce(THEIRS, 5, BOOT, 2, (1,), 5e-5, 1e-9))
    for part in parts:
        cluster.on_message(PEER, part, ())
    assert job.across.formation is None and job.broken is None
    cluster.on_message(PEER, wire.Left(THEIRS, parts[0]["gen"], PEER, "rank 1 died",
                                       RankLostError.code, PEER, False).to_wire(), ())
    assert isinstance(job.broken, RankLostError) and "rank 1 died" in job.broken.message
    with pytest.raises(RankLostError):
        job.across.formed.result()


def test_a_coordinator_keeps_a_bounded_number_of_jobs(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gradsync.daemon.core import coordinating

    monkeypatch.setattr(coordinating, "JOBS_KEPT", 3)
    cluster, _, _ = core(loop)
    names = [n for n in (f"j{i}" for i in range(100))
             if coordinator_of(n, [HERE, PEER]) == HERE][:5]
    for name in names:  # jobs of a world of 1, formed at once, never withdrawn
        cluster.on_message(PEER, wire.Announce(name, 1, BOOT, 1, (0,), 5e-5, 1e-9)
                           .to_wire(), ())
    assert list(cluster.coordination.tables) == names[2:]
    assert list(cluster.coordination.formed) == names[2:]
    assert cluster.coordination.held == dict.fromkeys(names[2:], 1)


def test_news_of_a_member_declared_lost_fails_what_waits_for_it_here(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """A job of three daemons: this one need not watch the third (core/watching.py).
    PEER declares the third lost and withdraws; the coordinator's word of it fails
    our collective waiting for the third's data now, not at its deadline, and our
    own withdrawal passes the loss on."""
    third = "tcp://10.0.0.4:7000"
    cluster, transport, jobs = core(loop)
    job = Job(THEIRS, 3, 1, still_clock)
    job.add_member(Member(0, 0, 100, 1))
    jobs[THEIRS] = job
    cluster.local_complete(job)
    for part in formed_by_peer(job, wire.Announce(THEIRS, 5, BOOT, 3, (1,), 5e-5, 1e-9),
                               wire.Announce(THEIRS, 9, BOOT, 3, (2,), 5e-5, 1e-9)):
        cluster.on_message(PEER, part, ())
    formation = job.across.formation
    assert formation is not None and formation.daemons == (HERE, PEER, third)
    buffer = np.full(8, 1.0, np.float32)
    fingerprint = wire.Fingerprint("allreduce", "float32", 8, "sum", "star")
    run = ScheduleRun(ALGORITHMS["star"](0, 3, 8), buffer, ReduceOp.SUM,
                      lambda peer, header, payload, zero_copy: transport.post(
                          formation.daemons[peer], header, (payload,)),
                      1 << 20, loop, fingerprint=fingerprint, algorithm="star")
    cluster.run_started(job, 0, run)
    run.start()
    theirs = np.full(8, 2.0, np.float32)
    cluster.on_message(PEER, wire.Slice(THEIRS, formation.generation, 0, fingerprint, 0, 0, 0)
                       .to_wire(), (theirs.tobytes(),))
    assert not run.done.done()  # it waits for the third's part
    cluster.on_message(PEER, wire.Left(
        THEIRS, formation.generation, PEER, f"peer daemon {third} was lost", "peer_lost", PEER,
        False, third).to_wire(), ())
    error = run.done.exception()
    assert isinstance(error, PeerLostError) and third in error.message, error
    assert transport.of_kind("drain") == []  # nothing more is needed from PEER
    cluster.run_ended(job, 0)
    [(to, ours)] = transport.of_kind("withdraw")
    assert to == PEER and ours.lost == third and ours.origin == PEER


def test_the_standby_keeps_the_announcements_and_speaks_once_the_coordinator_is_lost(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Three daemons; PEER coordinates the job, this one is its standby.  Every
    announcement comes here too, and this daemon forms nothing while PEER is up.
    PEER (holding rank 1) is lost before the job forms: this daemon, now the
    coordinator, knows rank 1 was PEER's, and says so to every announcer."""
    third = "tcp://10.0.0.3:7000"
    cluster, transport, jobs = core_among([HERE, PEER, third])
    name = next(n for n in (f"j{i}" for i in range(100))
                if coordinators_of(n, [HERE, PEER, third]) == (PEER, HERE))
    job = Job(name, 4, 1, still_clock)
    job.add_member(Member(0, 0, 100, 1))
    jobs[name] = job
    cluster.local_complete(job)
    assert [to for to, _ in transport.of_kind("announce")] == [PEER]
    cluster.on_message(PEER, wire.Announce(name, 5, BOOT, 4, (1,), 5e-5, 1e-9).to_wire(), ())
    cluster.on_message(third, wire.Announce(name, 9, BOOT, 4, (2, 3), 5e-5, 1e-9).to_wire(),
                       ())
    assert transport.of_kind("formed") == [] and job.across.formation is None  # standby
    transport.down.add(PEER)
    cluster.peer_lost(PEER, "declared lost")
    assert isinstance(job.broken, PeerLostError) and PEER in job.broken.message
    assert "ranks [1]" in job.broken.message
    [(to, told)] = transport.of_kind("unformable")
    assert to == third and told.peer == PEER and (told.boot, told.incarnation) == (BOOT, 9)


def test_a_standby_picked_as_coordinator_by_a_member_behind_a_partial_cut_forms_the_job(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """HERE reaches THIRD, the job's coordinator, and is its standby; PEER cannot
    reach THIRD, so it picked HERE as coordinator (`lead`).  HERE holds every
    rank: it forms the job, or no one would.  Without PEER's `lead` it only keeps
    the announcements."""
    third = "tcp://10.0.0.3:7000"
    name = next(n for n in (f"cut-{i}" for i in range(1000))
                if coordinators_of(n, [HERE, PEER, third]) == (third, HERE)
                and coordinator_of(n, [HERE, PEER]) == HERE)
    for lead in (False, True):
        cluster, transport, jobs = core_among([HERE, PEER, third])
        job = local_job(cluster, jobs, loop, name)
        assert [(to, m.lead) for to, m in transport.of_kind("announce")] == [(third, True)]
        share = wire.Announce(name, 5, BOOT, 2, (1,), 5e-5, 1e-9, lead=lead)
        cluster.on_message(PEER, share.to_wire(), ())
        formed = [to for to, _ in transport.of_kind("formed")]
        if lead:
            assert job.across.formation is not None
            assert job.across.formation.daemons == tuple(sorted((HERE, PEER)))
            assert formed == [PEER]
        else:
            assert job.across.formation is None and formed == []
