"""Multi-node jobs: membership across daemons, the peers' messages, failures.

`ClusterJobs` is what the links and the layers above see of the cluster core.
It dispatches each peer message and each report to the part whose job it is:

- `JobForming` (forming.py): this daemon's announcement and withdrawal, the
  formation its coordinator sends, the news of members leaving;
- `JobCoordination` (coordinating.py): the jobs this daemon coordinates:
  their announcements, formations and first withdrawals (see membership.py);
- `SliceRouting` (slice_routing.py): this daemon's slices out to the members,
  peers' slices to the collectives running here, placed before they arrive,
  or kept until those start;
- `JobFailures` (job_failures.py): aborts of one collective, breaks of a
  job's generation (a rank, a peer or a stream lost).

They share a `ClusterContext` (cluster_context.py).  The core alone writes a
job's cross-daemon state (`cluster_job.py`): the runner (run/multi_node.py)
and the request handlers tell it what happened through these methods.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from gradsync.daemon.core.cluster_context import ClusterContext, ClusterCounters, Frame, log
from gradsync.daemon.core.coordinating import JobCoordination
from gradsync.daemon.core.forming import CodecFacts, JobForming
from gradsync.daemon.core.interfaces import (
    CollectiveRun,
    FailedCollectives,
    IncomingMessage,
    PeerTransport,
    PlacedPayload,
)
from gradsync.daemon.core.job_failures import JobFailures
from gradsync.daemon.core.membership import coordinator_of
from gradsync.daemon.core.slice_routing import SliceRouting
from gradsync.daemon.core.watching import ring_neighbours
from gradsync.daemon.stats import StatsRecorder
from gradsync.protocol import peer as peer_wire
from gradsync.protocol.errors import CollectiveError, GradsyncError, ProtocolError
from gradsync.protocol.peer import (
    Abort,
    Announce,
    Broke,
    Drain,
    Formed,
    Key,
    Left,
    Slice,
    Unformable,
    Withdraw,
)

if TYPE_CHECKING:
    from gradsync.daemon.config import DaemonConfig
    from gradsync.daemon.core.matching import Job

__all__ = ["ClusterJobs"]


class ClusterJobs:
    """Cross-daemon state of every multi-node job on this daemon."""

    def __init__(
        self,
        config: DaemonConfig,
        jobs: dict[str, Job],
        clock: Callable[[], float],
        stats: StatsRecorder | None = None,
    ) -> None:
        self.context = ClusterContext(config, jobs, stats)
        self.job_failures = JobFailures(
            self.context, lambda job, error: self.forming.withdraw(job, error))
        self.routing = SliceRouting(self.context, self.job_failures)
        self.forming = JobForming(self.context, clock, self.job_failures,
                                  self.routing.replay, self.send_membership)
        self.coordination = JobCoordination(self.context, self.forming.unformed,
                                            self.send_membership)
        #: Each formed job's members heartbeated, by generation (`peers_in_use`).
        self._job_watch: dict[int, frozenset[str]] = {}

    def connect(self, transport: PeerTransport, failures: FailedCollectives) -> None:
        """Send through `transport` (the peer links, which report to this object:
        it is their `PeerEvents`, see daemon/peers/events.py); fail collectives
        through `failures` (the daemon's one failure path)."""
        self.context.transport = transport
        self.context.failures = failures

    # -- what the parts share, for the layers above and the tests --------------

    @property
    def config(self) -> DaemonConfig:
        return self.context.config

    @property
    def jobs(self) -> dict[str, Job]:
        return self.context.jobs

    @property
    def counters(self) -> ClusterCounters:
        return self.context.counters

    @property
    def transport(self) -> PeerTransport:
        return self.context.transport

    @property
    def failures(self) -> FailedCollectives | None:
        return self.context.failures

    @property
    def codec_facts(self) -> CodecFacts:
        """What this daemon announces for `auto` compression (run/codec_rates.py)."""
        return self.forming.codec_facts

    @codec_facts.setter
    def codec_facts(self, facts: CodecFacts) -> None:
        self.forming.codec_facts = facts

    # -- PeerEvents: the links report here, from the event loop ---------------

    def message(self, message: IncomingMessage) -> None:
        """An accepted peer message."""
        self.on_message(message.peer, message.header, message.payloads)

    def on_message(
        self, peer: str, header: dict[str, Any], frames: Sequence[Frame]
    ) -> None:
        """Dispatch one peer message; malformed content is counted and dropped."""
        with self.counters.dropping_bad(header, peer, log):
            message = peer_wire.from_wire(header)
            job = self.jobs.get(message.job)
            if isinstance(message, Announce):
                self.coordination.on_announce(peer, message)
            elif isinstance(message, Withdraw):
                # The coordinator's news first: then the member's side, which fails
                # what waits for the leaver's data (it came before, on its stream).
                self.coordination.on_withdraw(peer, message)
                self.forming.on_withdraw(peer, message, job)
            elif isinstance(message, Formed):
                self.forming.on_formed(peer, message, job)
            elif isinstance(message, Left):
                self.forming.on_left(peer, message, job)
            elif isinstance(message, Drain):
                self.forming.on_drain(peer, message)
            elif isinstance(message, Slice):
                if job is None:
                    self.counters.dropped_unknown_job += 1
                else:
                    self.routing.on_slice(job, peer, message, frames)
            elif isinstance(message, Abort):
                self.job_failures.on_abort(peer, message, job)
            elif isinstance(message, Unformable):
                self.forming.on_unformable(peer, message, job)
            elif isinstance(message, Broke):
                self.forming.on_broke(peer, message, job)
            else:
                self._on_costs(peer, message, job)

    def place(
        self, peer: str, header: dict[str, Any], sizes: list[int]
    ) -> list[PlacedPayload] | None:
        """Where a slice's payload can go before it arrives (`SliceRouting.place`)."""
        return self.routing.place(peer, header, sizes)

    def peers_in_use(self) -> set[str]:
        """The peers this daemon's jobs use now: of each formed job's members, its
        neighbours on the job's own ring (every member, in a job of a few daemons);
        the coordinators it announced to; the announcers of the jobs it coordinates
        that have not formed, or their coordinator where this daemon is the
        standby.  The links heartbeat them whatever their place on the ring of all
        daemons (core/watching.py)."""
        used: set[str] = set()
        endpoint, count = self.transport.endpoint, self.config.watch_neighbours
        # Asked every heartbeat interval: each generation's ring is sorted once.
        known, self._job_watch = self._job_watch, {}
        for job in self.jobs.values():
            formation = job.across.formation
            if formation is not None and endpoint in formation.daemons:
                # Its members nearest on the ring of the job: each member is watched
                # by some, and their news of a loss reaches every member.
                generation = formation.generation
                watch = known.get(generation)
                if watch is None:
                    watch = frozenset(ring_neighbours(endpoint, formation.daemons, count)
                                      or formation.daemons)
                self._job_watch[generation] = watch
                used.update(watch)
        used.update(self.forming.coordinators.values())
        reachable = self.context.reachable()
        for name, table in self.coordination.tables.items():
            if name in self.coordination.formed:
                continue
            coordinator = coordinator_of(name, reachable)
            if coordinator == endpoint:
                used.update(table)  # one lost before the job forms: `Unformable`
            else:
                used.add(coordinator)  # the standby: it takes over if that one is lost
        used.discard(self.transport.endpoint)
        return used

    def peers_kept(self) -> set[str]:
        """The peers whose links stay open however quiet (daemon/peers/links.py),
        besides those in use (`peers_in_use`, which the links ask anyway): every
        member of each formed job here, as any member may send to any other (tree
        and halving-doubling partners, aborts)."""
        kept: set[str] = set()
        for job in self.jobs.values():
            formation = job.across.formation
            if formation is not None:
                kept.update(formation.daemons)
        kept.discard(self.transport.endpoint)
        return kept

    def send_membership(self, daemon: str, header: dict[str, Any]) -> None:
        """Send a membership message to `daemon`; one to this daemon (it coordinates
        a job it is a member of) is handled here at once, as if it came in."""
        if daemon == self.transport.endpoint:
            self.on_message(daemon, header, ())
        else:
            self.transport.post(daemon, header)

    def peer_up(self, peer: str) -> None:
        """A link (re)connected: tell it which of its jobs broke here unformed, and
        announce our jobs again where it (now) coordinates them, and send it the
        formations it missed while down."""
        self.forming.peer_up(peer)
        self.coordination.peer_up(peer)

    def peer_lost(self, peer: str, why: str = "") -> None:
        """Fail every collective of every job that spans the lost peer, and of every
        job still forming that counted on it for missing ranks; `why` (the links'
        words: its connection closed, or the failure detector's verdict) goes into
        the errors."""
        self.forming.forget_peer(peer)
        why = why or "its connection closed"
        self.coordination.peer_lost(peer, why)
        self.job_failures.break_jobs_with(peer, f"was lost ({why})", lost=True)
        self.forming.coordinators_moved()
        for job in list(self.jobs.values()):
            self.forming.fail_if_unformable(job, why)

    def stream_broken(self, peer: str, why: str) -> None:
        """A data stream with `peer` broke and may have lost slices, of running
        collectives or of ones not started here yet: the jobs spanning it end
        their generation as on a lost peer, here and on every member, instead
        of waiting for their deadlines.  The link itself is up: a new stream
        opens, and the job can form again."""
        self.job_failures.break_jobs_with(peer, f"lost slices ({why})")

    # -- what the layers above report ------------------------------------------

    def local_complete(self, job: Job) -> None:
        """All local ranks joined: announce this daemon's share to the job's coordinator."""
        self.forming.local_complete(job)

    def run_started(self, job: Job, key: Key, run: CollectiveRun) -> None:
        """Collective `key` began its inter-daemon phase here: its slices go to `run`."""
        self.routing.run_started(job, key, run)

    def feed_early(self, job: Job, key: Key, run: CollectiveRun) -> None:
        """Hand `run` (just started) the slices that came for it before it ran."""
        self.routing.feed_early(job, key, run)

    def run_ended(self, job: Job, key: Key) -> None:
        """Collective `key`'s inter-daemon phase is over here (done or failed); a
        withdrawal that waited for the job's running collectives goes out now."""
        job.across.runs.pop(key, None)
        self.forming.withdraw_when_idle(job)

    def ended_cleanly(self, job: Job) -> None:
        """A rank said bye with nothing in flight: the job's normal end, which its
        withdrawal tells the peers, so that they do not warn."""
        job.across.ended_cleanly = True

    def broke_here(self, job: Job, error: GradsyncError) -> None:
        """The job broke on this daemon (a rank lost): fail its running collectives
        here and on every member, and withdraw it."""
        self.job_failures.broke_here(job, error)

    def abort(self, job: Job, key: Key, error: CollectiveError) -> None:
        """Fail one collective here and on every member daemon (once per key)."""
        self.job_failures.abort(job, key, error)

    def send(self, job: Job, peer: str, header: dict[str, Any], payload: Any,
             zero_copy: bool, raw_nbytes: int) -> Any:
        """Send one of this daemon's slices to a member (`SliceRouting.send`)."""
        return self.routing.send(job, peer, header, payload, zero_copy, raw_nbytes)

    def _on_costs(self, peer: str, message: peer_wire.Costs, job: Job | None) -> None:
        """A member's figures for one epoch of `auto` (see cost_epochs.py)."""
        generation = message.gen
        if job is None:
            self.counters.dropped_unknown_job += 1
            return
        formation = job.across.formation
        if formation is not None and generation != formation.generation:
            self.counters.stale_generation += 1
            return
        if formation is not None and peer not in formation.daemons:
            raise ProtocolError(f"costs from {peer}, not a member of {job.describe()}")
        job.across.auto.heard(formation, peer, message)
