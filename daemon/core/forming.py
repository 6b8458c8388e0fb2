"""Membership of the daemon's multi-node jobs: this daemon's announcement, the
peers' announcements and withdrawals, and the formation once they cover every
rank (see membership.py for the rules every daemon applies alike)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from gradsync.daemon.core.cluster_context import ClusterContext, Frame, log
from gradsync.daemon.core.job_failures import JobFailures
from gradsync.daemon.core.membership import (
    BOOT,
    Announcement,
    Withdrawals,
    conflicts,
    form,
    new_incarnation,
    ranks_not_announced,
)
from gradsync.daemon.core.unformed import UnformedJobs
from gradsync.protocol.errors import (
    GradsyncError,
    PeerLostError,
    RankLostError,
    as_collective_error,
    error_from_wire,
)
from gradsync.protocol.peer import Announce, Slice, Withdraw

if TYPE_CHECKING:
    from gradsync.daemon.core.matching import Job

#: Link costs assumed until a peer's have been measured.
DEFAULT_ALPHA_S = 50e-6
DEFAULT_BETA_S_PER_BYTE = 1 / 1e9

#: Hands on a slice that came before its job formed (`SliceRouting.replay`).
Replay = Callable[["Job", str, Slice, Sequence[Frame]], None]
#: What this daemon announces for `auto` compression: its codec rates (by rate
#: name) and whether all its peers are on this host.
CodecFacts = Callable[[], tuple[tuple[tuple[str, float], ...], bool]]


class JobForming:
    """Announcements, withdrawals and formations of every multi-node job here."""

    def __init__(self, context: ClusterContext, clock: Callable[[], float],
                 failures: JobFailures, replay: Replay) -> None:
        self.context = context
        self.failures = failures
        self.replay = replay
        #: Each job's announcements by peer.
        self.remote: dict[str, dict[str, Announcement]] = {}
        #: The newest incarnation of each (job, peer) that peer withdrew.
        self.withdrawn = Withdrawals()
        self.unformed = UnformedJobs(clock)  # broken before forming, for lost peers' return
        #: Peers whose link went down (after being up) and has not come back.
        self.lost: set[str] = set()
        #: run/codec_rates.py measures them on first use; none until the runner is
        #: wired in.
        self.codec_facts: CodecFacts = lambda: ((), False)

    def local_complete(self, job: Job) -> None:
        """All local ranks joined: announce this daemon's share to every peer."""
        transport = self.context.transport
        measured = transport.link_costs()
        costs = measured or (DEFAULT_ALPHA_S, DEFAULT_BETA_S_PER_BYTE)
        codec_Bps, loopback = self.codec_facts()
        job.across.incarnation = new_incarnation()
        job.across.announcement = Announcement(transport.endpoint, Announce(
            job.name, job.across.incarnation, BOOT, job.world_size, tuple(sorted(job.members)),
            costs[0], costs[1], codec_Bps, loopback, measured is None,
        ))
        announce = job.across.announcement.share.to_wire()
        for peer in transport.peers:
            transport.post(peer, announce)
        self.try_form(job)
        self.fail_if_unformable(job)

    def peer_up(self, peer: str) -> None:
        """A link (re)connected: tell it our jobs, and which of its broke here unformed."""
        self.lost.discard(peer)
        transport = self.context.transport
        for name, table in list(self.remote.items()):
            self.unformed.tell(peer, table.get(peer), self.context.jobs.get(name), transport)
        for job in list(self.context.jobs.values()):
            if job.across.announcement is not None and job.broken is None:
                transport.post(peer, job.across.announcement.share.to_wire())
                self.try_form(job)  # it may have waited for this very link

    def withdraw(self, job: Job, error: GradsyncError) -> None:
        """The local job broke or ended: peers must stop counting on it.

        The reason travels with its error code, so a peer's clients see the
        cause (a rank lost, a peer lost) rather than a generic failure.
        """
        if job.across.announcement is None or job.across.withdrawn:
            return
        job.across.withdrawn = True
        transport = self.context.transport
        origin, reason = job.across.end_origin or (transport.endpoint, error.message)
        withdraw = Withdraw(job.name, job.across.incarnation, BOOT, reason, error.code, origin,
                            job.across.ended_cleanly).to_wire()
        for peer in transport.peers:
            transport.post(peer, withdraw)

    def withdraw_when_idle(self, job: Job) -> None:
        """A withdrawal that waited for the job's running collectives goes out
        once none runs here."""
        if job.across.withdrawal is not None and not job.across.runs:
            self.withdraw(job, job.across.withdrawal)

    def try_form(self, job: Job) -> None:
        across = job.across
        ours = across.announcement
        if across.formation is not None or ours is None or job.broken is not None:
            return
        transport = self.context.transport
        announcements = dict(self.remote.get(job.name, {}))
        announcements[transport.endpoint] = ours
        problem = conflicts(announcements, job.world_size)
        if problem is not None:
            log.warning("%s cannot form yet: %s", job.describe(), problem)
            return
        formation = form(announcements, job.world_size)
        if formation is None:
            return
        down = [d for d in formation.daemons if d != transport.endpoint and not transport.is_up(d)]
        if down:
            # Announcements can arrive over a peer's link before ours to it is up; the
            # job forms once this daemon can send to every member (see peer_up).
            log.debug("%s waits for links to %s before forming", job.describe(), down)
            return
        job.across.formation = formation
        log.info(
            "%s formed across %d daemons (generation %x): %s", job.describe(),
            len(formation.daemons), formation.generation, ", ".join(formation.daemons),
        )
        if self.context.stats is not None:
            self.context.stats.job_formed(job.name, formation.alpha_s, formation.beta_s_per_byte)
        if not job.across.formed.done():
            job.across.formed.set_result(formation)
        for peer, message, frames in job.across.early.take_unformed():
            self.replay(job, peer, message, frames)

    def on_announce(self, peer: str, message: Announce, job: Job | None) -> None:
        if self.withdrawn.overtook(message.job, peer, message.boot, message.incarnation):
            self.context.counters.stale_membership += 1  # its withdrawal overtook it
            return
        table = self.remote.setdefault(message.job, {})
        previous = table.get(peer)
        table[peer] = Announcement(peer, message)
        self.unformed.tell(peer, table[peer], job, self.context.transport)
        if job is None:
            return
        if (previous is not None
                and (previous.share.boot, previous.share.incarnation)
                != (message.boot, message.incarnation)
                and job.across.formation is not None and peer in job.across.formation.daemons):
            self.failures.break_job(job, PeerLostError(
                f"peer daemon {peer} re-created {job.describe()} (its ranks restarted); "
                "this generation cannot continue",
                {"job": job.name, "peer": peer},
            ))
            return
        self.try_form(job)

    def on_withdraw(self, peer: str, message: Withdraw, job: Job | None) -> None:
        """A peer's part of a job ended.

        A withdrawal travels over the data stream when there is one, behind the
        slices sent before it (a peer must not hear that a daemon left before it
        has read that daemon's last slices); announcements take the ZeroMQ link.
        So the two can pass each other: incarnations grow within each run of a
        daemon (its `boot`), and a withdrawal older than the announcement held
        from the same boot is dropped, as is an announcement no newer than a
        withdrawal heard from the same boot.  A restarted daemon's messages are
        never stale: its old ones all came before its old connection closed.
        """
        name, incarnation, boot = message.job, message.incarnation, message.boot
        table = self.remote.get(name, {})
        held = table.get(peer)
        if held is not None and held.share.boot == boot and held.share.incarnation > incarnation:
            self.context.counters.stale_membership += 1
            return
        self.withdrawn.remember(name, peer, boot, incarnation)
        if held is not None:
            del table[peer]
            if not table:
                del self.remote[name]
        formation = job.across.formation if job is not None else None
        if job is not None and formation is not None and peer in formation.daemons:
            self._member_withdrew(peer, message, job)

    def _member_withdrew(self, peer: str, message: Withdraw, job: Job) -> None:
        """A member of the job's formation withdrew: the generation ends here too,
        but collectives that hold all they need from it may finish."""
        level = logging.DEBUG
        if job.broken is not None:
            # Already ended here, and logged why: most often this is the peer's
            # answer to our own withdrawal, which would only echo our reason.
            error = job.broken
        else:
            origin = message.origin
            reason = message.reason or "its part of the job ended"
            code = message.code or RankLostError.code
            error = error_from_wire(
                code, f"{job.describe()} on peer daemon {origin}: {reason}",
                {"job": message.job, "peer": origin},
            )
            job.across.end_origin = (origin, reason)
            job.across.ended_cleanly = message.clean
            level = logging.INFO if message.clean else logging.WARNING
        error = as_collective_error(error, RankLostError)
        job.across.gone.add(peer)
        self.failures.break_job(job, error, fail_runs=False, level=level)
        for run in list(job.across.runs.values()):
            job.across.fail_if_waiting_on_gone(run, error)

    def forget_peer(self, peer: str) -> set[str]:
        """`peer` was lost: its announcements are void.  The jobs it had announced."""
        self.lost.add(peer)
        announced = set()
        for name, table in list(self.remote.items()):
            if table.pop(peer, None) is not None:
                announced.add(name)
            if not table:
                del self.remote[name]
        return announced

    def fail_if_unformable(self, job: Job, announced: str | None = None,
                           why: str = "") -> None:
        """Break a job that waits to form when the ranks it misses can no longer come.

        They cannot once the peer that announced them (`announced`) is lost, or
        when every peer that has not announced the job is lost: no daemon is left
        to hold them.  Waiting ranks get PeerLostError now, not the job's deadline.
        """
        across = job.across
        if across.formation is not None or across.announcement is None or job.broken is not None:
            return
        table = self.remote.get(job.name, {})
        missing = ranks_not_announced(table, job.members, job.world_size)
        if not missing:
            return
        transport = self.context.transport
        others = [p for p in transport.peers if p != transport.endpoint]
        if announced is not None:
            gone = [announced]
        elif not others or any(p not in self.lost and p not in table for p in others):
            return
        else:
            gone = sorted(p for p in others if p in self.lost)
        error = PeerLostError(
            f"peer daemon {', '.join(gone)} of {job.describe()} was lost"
            f"{f' ({why})' if why else ''} before the job formed; ranks {missing} "
            "can join on no other daemon",
            {"job": job.name, "peer": gone[0], "missing": missing},
        )
        self.failures.break_job(job, error)
        self.unformed.remember(job.name, gone, error)
