"""Membership of the daemon's multi-node jobs, as a member sees it: this
daemon's announcement and withdrawal (to the job's coordinator), the
formation the coordinator sends, and the news it passes on (see
coordinating.py for the coordinator's side, membership.py for the rules).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from gradsync.daemon.core.cluster_context import ClusterContext, Frame, Send, log
from gradsync.daemon.core.formed_parts import FormedAssembly
from gradsync.daemon.core.job_failures import JobFailures
from gradsync.daemon.core.membership import (
    BOOT,
    WITHDRAWALS_KEPT,
    Announcement,
    Formation,
    coordinators_of,
    new_incarnation,
    ranks_not_here,
)
from gradsync.daemon.core.unformed import HeardBreaks, UnformedJobs
from gradsync.protocol.errors import (
    GradsyncError,
    PeerLostError,
    RankLostError,
    as_collective_error,
    error_from_wire,
)
from gradsync.protocol.peer import (
    Announce,
    Broke,
    Drain,
    Formed,
    Left,
    Slice,
    Unformable,
    Withdraw,
)

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
    """This daemon's part in forming and ending each of its multi-node jobs."""

    def __init__(self, context: ClusterContext, clock: Callable[[], float],
                 failures: JobFailures, replay: Replay, send: Send) -> None:
        self.context = context
        self.failures = failures
        self.replay = replay
        self.send = send
        #: Each job's formation as the coordinator sent it (until it forms here).
        self.heard: dict[str, Formation] = {}
        #: The coordinator each job's announcement went to last.
        self.coordinators: dict[str, str] = {}
        #: ... and with its standby (`coordinators_for`).
        self.pairs: dict[str, tuple[str, ...]] = {}
        #: Every daemon this run of each job was announced to (more than one
        #: where the coordinator moved): each hears the withdrawal.
        self.announced_to: dict[str, set[str]] = {}
        self.parts = FormedAssembly()
        #: Jobs broken here before forming, for lost peers' return.
        self.unformed = UnformedJobs(clock)
        #: Jobs peers broke while this daemon was lost to them.
        self.heard_breaks = HeardBreaks(clock)
        #: Peers whose link went down (after being up) and has not come back.
        self.lost: set[str] = set()
        #: This daemon's withdrawals by (job, incarnation), for members' `Drain`.
        self.withdrawals_sent: collections.OrderedDict[tuple[str, int], dict[str, Any]] = (
            collections.OrderedDict())
        #: run/codec_rates.py measures them on first use; none until the runner is
        #: wired in.
        self.codec_facts: CodecFacts = lambda: ((), False)

    def coordinators_for(self, name: str) -> tuple[str, ...]:
        """The coordinator of job `name` as this daemon sees it, and its standby:
        picked among itself and the peers it can reach now (membership.py
        `coordinators_of`)."""
        return coordinators_of(name, self.context.reachable())

    def local_complete(self, job: Job) -> None:
        """All local ranks joined: announce this daemon's share to the coordinator."""
        transport = self.context.transport
        measured = transport.link_costs()
        costs = measured or (DEFAULT_ALPHA_S, DEFAULT_BETA_S_PER_BYTE)
        codec_Bps, loopback = self.codec_facts()
        job.across.incarnation = new_incarnation()
        job.across.announcement = Announcement(transport.endpoint, Announce(
            job.name, job.across.incarnation, BOOT, job.world_size, tuple(sorted(job.members)),
            costs[0], costs[1], codec_Bps, loopback, measured is None,
        ))
        self.heard.pop(job.name, None)  # an earlier run's formation
        self.announced_to[job.name] = set()
        self.parts.forget(job.name)
        broke = self.heard_breaks.take(job.name, job.describe())
        if broke is not None:
            self.failures.break_job(job, broke)
            return
        self._announce(job)
        self.fail_if_unformable(job)

    def _announce(self, job: Job) -> None:
        """To the job's coordinator, and to its standby: should the coordinator be
        lost before the job forms, the standby knows who announced what."""
        assert job.across.announcement is not None
        pair = self.pairs[job.name] = self.coordinators_for(job.name)
        self.coordinators[job.name] = pair[0]
        self.announced_to.setdefault(job.name, set()).update(pair)
        share = job.across.announcement.share
        for daemon in pair:
            self.send(daemon, dataclasses.replace(share, lead=daemon == pair[0]).to_wire())

    def _announcing(self) -> list[Job]:
        """This daemon's jobs whose announcement stands (made, not withdrawn)."""
        return [job for job in self.context.jobs.values()
                if job.across.announcement is not None and not job.across.withdrawn
                and job.broken is None]

    def coordinators_moved(self) -> None:
        """The peers reachable changed: announce again where a job's coordinator
        is now another daemon (it may form the job, or pass its news on)."""
        for job in self._announcing():
            if self.coordinators_for(job.name) != self.pairs.get(job.name):
                self._announce(job)

    def peer_up(self, peer: str) -> None:
        """A link (re)connected: tell it which of its jobs broke here while it was
        lost; announce again to it where it coordinates (it may have restarted,
        or missed the announcement while down), and where coordinators moved."""
        self.lost.discard(peer)
        jobs = self.context.jobs
        for broke in self.unformed.due(
                peer, lambda name: name not in jobs or jobs[name].broken is not None):
            self.send(peer, broke.to_wire())
        for job in self._announcing():
            pair = self.coordinators_for(job.name)
            if peer in pair or pair != self.pairs.get(job.name):
                self._announce(job)
            self.try_form(job)  # it may have waited for this very link

    def withdraw(self, job: Job, error: GradsyncError) -> None:
        """The local job broke or ended: the coordinator must stop counting on it,
        and pass it on to the other members.

        The reason travels with its error code, so a peer's clients see the
        cause (a rank lost, a peer lost) rather than a generic failure.
        """
        if job.across.announcement is None or job.across.withdrawn:
            return
        job.across.withdrawn = True
        transport = self.context.transport
        origin, reason = job.across.end_origin or (transport.endpoint, error.message)
        withdraw = Withdraw(job.name, job.across.incarnation, BOOT, reason, error.code, origin,
                            job.across.ended_cleanly, job.across.lost).to_wire()
        self.withdrawals_sent[(job.name, job.across.incarnation)] = withdraw
        while len(self.withdrawals_sent) > WITHDRAWALS_KEPT:
            self.withdrawals_sent.popitem(last=False)
        self.coordinators.pop(job.name, None)
        self.pairs.pop(job.name, None)
        self.heard.pop(job.name, None)
        self.parts.forget(job.name)
        receivers = {daemon for daemon in self.announced_to.pop(job.name, ())
                     if daemon == transport.endpoint or transport.reachable(daemon)}
        for daemon in sorted(receivers or set(self.coordinators_for(job.name))):
            self.send(daemon, withdraw)

    def withdraw_when_idle(self, job: Job) -> None:
        """A withdrawal that waited for the job's running collectives goes out
        once none runs here."""
        if job.across.withdrawal is not None and not job.across.runs:
            self.withdraw(job, job.across.withdrawal)

    def on_formed(self, peer: str, message: Formed, job: Job | None) -> None:
        """A part of the formation the coordinator sent; the job forms here once
        every part has come, if it names this run of ours."""
        if job is None:
            self.context.counters.dropped_unknown_job += 1
            return
        formation = self.parts.add(message)
        if formation is None:
            return
        endpoint = self.context.transport.endpoint
        across = job.across
        if (across.announcement is None or job.broken is not None
                or endpoint not in formation.daemons
                or formation.run_of(endpoint) != (BOOT, across.incarnation)):
            self.context.counters.stale_membership += 1  # of a run of ours that ended
            return
        current = across.formation
        if current is not None:
            if current.generation != formation.generation:
                self._renewed(job, current, formation)
            return
        self.heard[job.name] = formation
        self.try_form(job)

    def _renewed(self, job: Job, current: Formation, formation: Formation) -> None:
        """A newer generation formed while ours runs: a member created the job anew."""
        renewed = [daemon for daemon in formation.daemons
                   if daemon in current.daemons
                   and formation.run_of(daemon) != current.run_of(daemon)]
        self.failures.break_job(job, PeerLostError(
            f"peer daemon {', '.join(renewed) or 'of another set'} re-created "
            f"{job.describe()} (its ranks restarted); this generation cannot continue",
            {"job": job.name, "peer": renewed[0] if renewed else ""},
        ))

    def try_form(self, job: Job) -> None:
        """Form the job from the coordinator's formation, once this daemon can send
        to every member."""
        across = job.across
        formation = self.heard.get(job.name)
        if (across.formation is not None or across.announcement is None
                or job.broken is not None or formation is None):
            return
        transport = self.context.transport
        down = [d for d in formation.daemons
                if d != transport.endpoint and not transport.reachable(d)]
        if down:
            # The formation can come before our links to every member are up; the
            # job forms once this daemon can send to every member (see peer_up).  A
            # link opened on first use counts: what is sent waits in it until it is up.
            log.debug("%s waits for links to %s before forming", job.describe(), down)
            return
        job.across.formation = formation
        del self.heard[job.name]
        log.info(
            "%s formed across %d daemons (generation %x): %s", job.describe(),
            len(formation.daemons), formation.generation, ", ".join(formation.daemons),
        )
        if self.context.stats is not None:
            self.context.stats.job_formed(job.name, formation.alpha_s, formation.beta_s_per_byte,
                                          self.coordinators.get(job.name))
        if not job.across.formed.done():
            job.across.formed.set_result(formation)
        for peer, message, frames in job.across.early.take_unformed():
            self.replay(job, peer, message, frames)

    def on_left(self, peer: str, message: Left, job: Job | None) -> None:
        """The coordinator passes on a member's withdrawal from the generation
        running here: it ends here too, but collectives that hold all they need
        from that member may finish.  One that still waits for its data cannot
        tell yet whether that data is on its way (down the member's own stream,
        which the news overtook): it asks the member for its withdrawal
        (`Drain`), which comes behind the last of it (`on_withdraw`)."""
        formation = job.across.formation if job is not None else None
        if job is not None and formation is None:
            heard = self.heard.get(job.name)
            if heard is not None and heard.generation == message.gen:
                # It ended before our links let it form here: it never will.
                del self.heard[job.name]
                error, _ = self._ended_by(job, message.origin, message.reason, message.code,
                                          message.clean)
                self.failures.break_job(job, error)
                return
        if job is None or formation is None or message.gen != formation.generation:
            self.context.counters.stale_generation += 1
            return
        if message.daemon not in formation.daemons:
            self.context.counters.malformed += 1
            log.warning("dropped news of %s leaving %s: not a member (from %s)",
                        message.daemon, job.describe(), peer)
            return
        error, level = self._ended_by(job, message.origin, message.reason, message.code,
                                      message.clean)
        self.failures.break_job(job, error, fail_runs=False, level=level)
        self._lost_member(job, message.lost, error)
        index = formation.index_of(message.daemon)
        if peer == self.context.transport.endpoint:
            return  # coordinated here: the leaver's own withdrawal is in hand (`on_withdraw`)
        if message.daemon not in job.across.gone and any(
                run.needs_from(index) for run in job.across.runs.values()):
            boot, incarnation = formation.run_of(message.daemon)
            self.send(message.daemon, Drain(job.name, boot, incarnation).to_wire())

    def _ended_by(self, job: Job, origin: str, reason: str, code: str,
                  clean: bool) -> tuple[GradsyncError, int]:
        """The error a member's leaving ends the job with here, and how loud to log
        it; the first such news says where the end began, and whether it was the
        job's normal end."""
        if job.broken is not None:
            # Already ended here, and logged why: most often this is news of a
            # member that heard of our own withdrawal, or saw the same loss.
            return as_collective_error(job.broken, RankLostError), logging.DEBUG
        reason = reason or "its part of the job ended"
        error = error_from_wire(code or RankLostError.code,
                                f"{job.describe()} on peer daemon {origin}: {reason}",
                                {"job": job.name, "peer": origin})
        job.across.end_origin = (origin, reason)
        job.across.ended_cleanly = clean
        return (as_collective_error(error, RankLostError),
                logging.INFO if clean else logging.WARNING)

    def on_drain(self, peer: str, message: Drain) -> None:
        """A member waits for our data of a run we withdrew from: our withdrawal,
        to it, behind whatever slices we sent it (`Drain`)."""
        withdraw = self.withdrawals_sent.get((message.job, message.incarnation))
        if message.boot != BOOT or withdraw is None:
            self.context.counters.stale_membership += 1
            return
        self.context.transport.post(peer, withdraw)

    def on_withdraw(self, peer: str, message: Withdraw, job: Job | None) -> None:
        """A member's own withdrawal, sent here after its last slices (`on_drain`):
        collectives that still wait for its data cannot finish."""
        formation = job.across.formation if job is not None else None
        if (job is None or formation is None or peer not in formation.daemons
                or formation.run_of(peer) != (message.boot, message.incarnation)):
            return  # to the coordinator only, or of another generation
        job.across.gone.add(peer)
        error, level = self._ended_by(job, message.origin, message.reason, message.code,
                                      message.clean)
        self.failures.break_job(job, error, fail_runs=False, level=level)
        self._lost_member(job, message.lost, error)
        for run in list(job.across.runs.values()):
            job.across.fail_if_waiting_on_gone(run, error)

    def _lost_member(self, job: Job, lost: str, error: GradsyncError) -> None:
        """A member says `lost` was declared lost or cut off: the generation's
        collectives fail here now, as where this daemon declares a member itself
        (it may not watch that one: core/watching.py), since their data, or data
        that depends on it, will not come.  Passed on with our own withdrawal."""
        formation = job.across.formation
        if (not lost or formation is None or lost not in formation.daemons
                or lost == self.context.transport.endpoint):
            return
        job.across.lost = job.across.lost or lost
        job.across.gone.add(lost)
        for run in list(job.across.runs.values()):
            run.fail(error)

    def on_unformable(self, peer: str, message: Unformable, job: Job | None) -> None:
        """The coordinator says this run of the job can never form (a daemon that
        announced ranks of it was lost)."""
        across = job.across if job is not None else None
        if (job is None or across is None or job.broken is not None
                or across.formation is not None or across.announcement is None
                or (message.boot, message.incarnation) != (BOOT, across.incarnation)):
            self.context.counters.stale_membership += 1
            return
        self.failures.break_job(job, error_from_wire(
            message.code or PeerLostError.code, message.message,
            {"job": message.job, "peer": message.peer}))

    def on_broke(self, peer: str, message: Broke, job: Job | None) -> None:
        """`peer` broke a job before it formed while this daemon was lost to it:
        the run of it here, if it waits to form, ends now; else the next run
        created within a while (`HeardBreaks`)."""
        self.heard_breaks.keep(peer, message)
        if (job is not None and job.broken is None and job.across.formation is None
                and job.across.announcement is not None):
            error = self.heard_breaks.take(job.name, job.describe())
            if error is not None:
                self.failures.break_job(job, error)

    def forget_peer(self, peer: str) -> None:
        """`peer` was lost: formations heard that name it will not form."""
        self.lost.add(peer)
        for name, formation in list(self.heard.items()):
            if peer in formation.daemons:
                del self.heard[name]

    def fail_if_unformable(self, job: Job, why: str = "") -> None:
        """Break a job that waits to form when every other daemon is lost: no one
        is left to hold the ranks it misses.  Waiting ranks get PeerLostError now,
        not the job's deadline.  (Where the daemon that announced them is lost,
        the coordinator says so: `on_unformable`.)"""
        across = job.across
        if across.formation is not None or across.announcement is None or job.broken is not None:
            return
        missing = ranks_not_here(job.members, job.world_size)
        transport = self.context.transport
        others = [p for p in transport.peers if p != transport.endpoint]
        if not missing or not others or any(p not in self.lost for p in others):
            return
        gone = sorted(others)
        error = PeerLostError(
            f"peer daemon {', '.join(gone)} of {job.describe()} was lost"
            f"{f' ({why})' if why else ''} before the job formed; ranks {missing} "
            "can join on no other daemon",
            {"job": job.name, "peer": gone[0], "missing": missing},
        )
        self.failures.break_job(job, error)
        self.unformed.remember(job.name, gone, error)
