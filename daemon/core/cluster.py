"""Multi-node jobs: membership across daemons, the peers' messages, failures.

`ClusterJobs` forms a job across daemons once its local ranks are in (see
`membership.py`), hands peers' slices to the collectives running here (or
keeps them until those start), and reacts to announcements, withdrawals,
aborts and lost peers.  It alone writes a job's cross-daemon state
(`cluster_job.py`): the runner (run/multi_node.py) and the request handlers
tell it what happened through its methods.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gradsync.daemon.core.cluster_job import payload_bytes
from gradsync.daemon.core.interfaces import (
    NOT_CONNECTED,
    CollectiveRun,
    FailedCollectives,
    IncomingMessage,
    PeerTransport,
    PlacedPayload,
    is_placed,
)
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
from gradsync.daemon.stats import StatsRecorder
from gradsync.protocol import peer as peer_wire
from gradsync.protocol.errors import (
    CollectiveError,
    GradsyncError,
    MismatchError,
    PeerLostError,
    ProtocolError,
    RankLostError,
    as_collective_error,
    error_from_wire,
)
from gradsync.protocol.peer import Abort, Announce, Key, Slice, Unformable, Withdraw

if TYPE_CHECKING:
    from gradsync.daemon.config import DaemonConfig
    from gradsync.daemon.core.matching import Job

#: A slice's payload as the links hand it on: a buffer (memoryview, bytes, a
#: ZeroMQ frame's buffer) or, for a slice received in place, its placement.
Frame = Any

log = logging.getLogger("gradsync.daemon.cluster")


#: Link costs assumed until a peer's have been measured.
DEFAULT_ALPHA_S = 50e-6
DEFAULT_BETA_S_PER_BYTE = 1 / 1e9


@dataclasses.dataclass
class ClusterCounters:
    """What the cluster core counts of the peers' messages (dropped ones, mostly)."""

    #: Undecodable, or failing the peer protocol's checks.
    malformed: int = 0
    #: For a generation of a job that has ended or not formed here.
    stale_generation: int = 0
    #: Announcements and withdrawals overtaken by a newer one from the same daemon.
    stale_membership: int = 0
    dropped_unknown_job: int = 0
    #: Slices received straight into their collective's buffer.
    slices_placed: int = 0
    #: Jobs ended because a peer sent more early slices than max_shm_bytes.
    early_refused: int = 0

    @contextlib.contextmanager
    def dropping_bad(self, header: Mapping[str, Any], peer: str,
                     logger: logging.Logger) -> Iterator[None]:
        """Handle one peer message: one that fails the protocol's checks, or whose
        handling hits a bug, is counted as malformed, logged and dropped; the daemon
        keeps serving."""
        try:
            yield
        except ProtocolError as exc:
            self.malformed += 1
            logger.warning("dropped a bad %r message from peer %s: %s", header.get("kind"),
                           peer, exc)
        except Exception:  # a bug: say so, drop the message, keep serving
            self.malformed += 1
            logger.exception("failed to handle a %r message from %s", header.get("kind"), peer)


class ClusterJobs:
    """Cross-daemon state of every multi-node job on this daemon."""

    def __init__(
        self,
        config: DaemonConfig,
        jobs: dict[str, Job],
        clock: Callable[[], float],
        stats: StatsRecorder | None = None,
    ) -> None:
        self.config = config
        #: The daemon's jobs (DaemonState.jobs), as the request handlers keep them.
        self.jobs = jobs
        self.stats = stats
        self.counters = ClusterCounters()
        self.remote: dict[str, dict[str, Announcement]] = {}
        #: The newest incarnation of each (job, peer) that peer withdrew.
        self.withdrawn = Withdrawals()
        self.unformed = UnformedJobs(clock)  # broken before forming, for lost peers' return
        #: Peers whose link went down (after being up) and has not come back.
        self.lost: set[str] = set()
        self.transport: PeerTransport = NOT_CONNECTED
        self.failures: FailedCollectives | None = None
        #: What this daemon announces for `auto` compression: its codec rates (by
        #: rate name) and whether all its peers are on this host (run/codec_rates.py
        #: measures them on first use; none until the runner is wired in).
        self.codec_facts: Callable[[], tuple[tuple[tuple[str, float], ...], bool]] = (
            lambda: ((), False))

    def connect(self, transport: PeerTransport, failures: FailedCollectives) -> None:
        """Send through `transport` (the peer links, which report to this object:
        it is their `PeerEvents`, see daemon/peers/events.py); fail collectives
        through `failures` (the daemon's one failure path)."""
        self.transport = transport
        self.failures = failures

    # -- PeerEvents: the links report here, from the event loop ---------------

    def message(self, message: IncomingMessage) -> None:
        """An accepted peer message."""
        self.on_message(message.peer, message.header, message.payloads)

    # -- membership ---------------------------------------------------------

    def local_complete(self, job: Job) -> None:
        """All local ranks joined: announce this daemon's share to every peer."""
        measured = self.transport.link_costs()
        costs = measured or (DEFAULT_ALPHA_S, DEFAULT_BETA_S_PER_BYTE)
        codec_Bps, loopback = self.codec_facts()
        job.across.incarnation = new_incarnation()
        job.across.announcement = Announcement(self.transport.endpoint, Announce(
            job.name, job.across.incarnation, BOOT, job.world_size, tuple(sorted(job.members)),
            costs[0], costs[1], codec_Bps, loopback, measured is None,
        ))
        announce = job.across.announcement.share.to_wire()
        for peer in self.transport.peers:
            self.transport.post(peer, announce)
        self._try_form(job)
        self._fail_if_unformable(job)

    def peer_up(self, peer: str) -> None:
        """A link (re)connected: tell it our jobs, and which of its broke here unformed."""
        self.lost.discard(peer)
        for name, table in list(self.remote.items()):
            self.unformed.tell(peer, table.get(peer), self.jobs.get(name), self.transport)
        for job in list(self.jobs.values()):
            if job.across.announcement is not None and job.broken is None:
                self.transport.post(peer, job.across.announcement.share.to_wire())
                self._try_form(job)  # it may have waited for this very link

    def withdraw(self, job: Job, error: GradsyncError) -> None:
        """The local job broke or ended: peers must stop counting on it.

        The reason travels with its error code, so a peer's clients see the
        cause (a rank lost, a peer lost) rather than a generic failure.
        """
        if job.across.announcement is None or job.across.withdrawn:
            return
        job.across.withdrawn = True
        origin, reason = job.across.end_origin or (self.transport.endpoint, error.message)
        withdraw = Withdraw(job.name, job.across.incarnation, BOOT, reason, error.code, origin,
                            job.across.ended_cleanly).to_wire()
        for peer in self.transport.peers:
            self.transport.post(peer, withdraw)

    # -- what the layers above report: this object alone writes `job.across` --

    def run_started(self, job: Job, key: Key, run: CollectiveRun) -> None:
        """Collective `key` began its inter-daemon phase here: its slices go to `run`."""
        job.across.runs[key] = run

    def feed_early(self, job: Job, key: Key, run: CollectiveRun) -> None:
        """Hand `run` (just started) the slices that came for it before it ran."""
        for peer, message, frames in job.across.early.take(key):
            self.replay(job, peer, message, frames)
        if job.broken is not None:  # it broke while this run's task was queued
            job.across.fail_if_waiting_on_gone(run, job.broken)

    def run_ended(self, job: Job, key: Key) -> None:
        """Collective `key`'s inter-daemon phase is over here (done or failed); a
        withdrawal that waited for the job's running collectives goes out now."""
        job.across.runs.pop(key, None)
        if job.across.withdrawal is not None and not job.across.runs:
            self.withdraw(job, job.across.withdrawal)

    def ended_cleanly(self, job: Job) -> None:
        """A rank said bye with nothing in flight: the job's normal end, which its
        withdrawal tells the peers, so that they do not warn."""
        job.across.ended_cleanly = True

    def broke_here(self, job: Job, error: GradsyncError) -> None:
        """The job broke on this daemon (a rank lost): fail its running collectives
        here and on every member, and withdraw it."""
        for key in list(job.across.runs):
            self.abort(job, key, as_collective_error(error))
        self.withdraw(job, error)

    def _try_form(self, job: Job) -> None:
        across = job.across
        ours = across.announcement
        if across.formation is not None or ours is None or job.broken is not None:
            return
        announcements = dict(self.remote.get(job.name, {}))
        announcements[self.transport.endpoint] = ours
        problem = conflicts(announcements, job.world_size)
        if problem is not None:
            log.warning("%s cannot form yet: %s", job.describe(), problem)
            return
        formation = form(announcements, job.world_size)
        if formation is None:
            return
        down = [d for d in formation.daemons
                if d != self.transport.endpoint and not self.transport.is_up(d)]
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
        if self.stats is not None:
            self.stats.job_formed(job.name, formation.alpha_s, formation.beta_s_per_byte)
        if not job.across.formed.done():
            job.across.formed.set_result(formation)
        for peer, message, frames in job.across.early.take_unformed():
            self.replay(job, peer, message, frames)

    # -- messages from peers ------------------------------------------------

    def on_message(
        self, peer: str, header: dict[str, Any], frames: Sequence[Frame]
    ) -> None:
        """Dispatch one peer message; malformed content is counted and dropped."""
        with self.counters.dropping_bad(header, peer, log):
            message = peer_wire.from_wire(header)
            job = self.jobs.get(message.job)
            if isinstance(message, Announce):
                self._on_announce(peer, message, job)
            elif isinstance(message, Withdraw):
                self._on_withdraw(peer, message, job)
            elif isinstance(message, Slice):
                if job is None:
                    self.counters.dropped_unknown_job += 1
                else:
                    self.on_slice(job, peer, message, frames)
            elif isinstance(message, Abort):
                self._on_abort(peer, message, job)
            elif isinstance(message, Unformable):
                error = self.unformed.heard(peer, message, job)
                if job is not None and error is not None:
                    self._break(job, error)
            else:
                self._on_costs(peer, message, job)

    def _on_announce(self, peer: str, message: Announce, job: Job | None) -> None:
        if self.withdrawn.overtook(message.job, peer, message.boot, message.incarnation):
            self.counters.stale_membership += 1  # its withdrawal overtook it
            return
        table = self.remote.setdefault(message.job, {})
        previous = table.get(peer)
        table[peer] = Announcement(peer, message)
        self.unformed.tell(peer, table[peer], job, self.transport)
        if job is None:
            return
        if (previous is not None
                and (previous.share.boot, previous.share.incarnation)
                != (message.boot, message.incarnation)
                and job.across.formation is not None and peer in job.across.formation.daemons):
            self._break(job, PeerLostError(
                f"peer daemon {peer} re-created {job.describe()} (its ranks restarted); "
                "this generation cannot continue",
                {"job": job.name, "peer": peer},
            ))
            return
        self._try_form(job)

    def _on_withdraw(self, peer: str, message: Withdraw, job: Job | None) -> None:
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
        origin, clean = message.origin, message.clean
        table = self.remote.get(name, {})
        held = table.get(peer)
        if held is not None and held.share.boot == boot and held.share.incarnation > incarnation:
            self.counters.stale_membership += 1
            return
        self.withdrawn.remember(name, peer, boot, incarnation)
        if held is not None:
            del table[peer]
            if not table:
                del self.remote[name]
        formation = job.across.formation if job is not None else None
        if job is not None and formation is not None and peer in formation.daemons:
            level = logging.DEBUG
            if job.broken is not None:
                # Already ended here, and logged why: most often this is the peer's
                # answer to our own withdrawal, which would only echo our reason.
                error = job.broken
            else:
                reason = message.reason or "its part of the job ended"
                code = message.code or RankLostError.code
                error = error_from_wire(
                    code, f"{job.describe()} on peer daemon {origin}: {reason}",
                    {"job": name, "peer": origin},
                )
                job.across.end_origin = (origin, reason)
                job.across.ended_cleanly = clean
                level = logging.INFO if clean else logging.WARNING
            error = as_collective_error(error, RankLostError)
            job.across.gone.add(peer)
            self._break(job, error, fail_runs=False, level=level)
            for run in list(job.across.runs.values()):
                job.across.fail_if_waiting_on_gone(run, error)

    def _on_abort(self, peer: str, message: Abort, job: Job | None) -> None:
        formation = job.across.formation if job is not None else None
        if job is None or formation is None or message.gen != formation.generation:
            self.counters.stale_generation += 1
            return
        key = message.key
        error = as_collective_error(
            error_from_wire(message.code, message.message, message.details))
        job.remember_failure(key, error)
        run = job.across.runs.get(key)
        if run is not None:
            run.fail(error)

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

    def place(
        self, peer: str, header: dict[str, Any], sizes: list[int]
    ) -> list[PlacedPayload] | None:
        """Where a slice's payload can go before it arrives (see `CollectiveRun.place`).

        Only a slice that `on_slice` would hand to a running collective's current
        step is placed; everything else (and everything odd) arrives the usual
        way and is judged there.  Never raises (the links call it mid-stream).
        """
        try:
            return self._placement(peer, header, sizes)
        except Exception:
            log.exception("placing a slice from %s failed; it arrives the usual way", peer)
            return None

    def _placement(
        self, peer: str, header: dict[str, Any], sizes: list[int]
    ) -> list[PlacedPayload] | None:
        if header.get("kind") != Slice.kind or len(sizes) != 1:
            return None
        try:
            message = Slice.from_wire(header)
        except ProtocolError:
            return None
        job = self.jobs.get(message.job)
        formation = job.across.formation if job is not None else None
        if job is None or formation is None or message.gen != formation.generation:
            return None
        run = job.across.runs.get(message.key)
        if (run is None or message.key in job.failed or peer not in formation.daemons
                or message.fp != run.fingerprint):
            return None
        placement = run.place(formation.index_of(peer), message.step, message.t, message.off,
                              sizes[0])
        if placement is None:
            return None
        self.counters.slices_placed += 1
        return [placement]

    def on_slice(self, job: Job, peer: str, message: Slice, frames: Sequence[Frame]) -> None:
        formation = job.across.formation
        if formation is None:
            self._keep_early(job, peer, message, frames, None)
            return
        if message.gen != formation.generation:
            self.counters.stale_generation += 1
            log.debug("dropped a slice of an old generation of %s from %s", job.describe(), peer)
            return
        if peer not in formation.daemons or len(frames) != 1:
            raise ProtocolError(f"slice from {peer}, not a member of {job.describe()}")
        key = message.key
        if key in job.failed:
            return  # that collective already failed here; its stragglers are moot
        run = job.across.runs.get(key)
        if run is None:
            if is_placed(frames[0]):
                return  # placed while its collective ran here; that one has ended since
            self._keep_early(job, peer, message, frames, key)
            return
        # A placed slice's fingerprint was checked when it was placed (`place`).
        if not is_placed(frames[0]) and message.fp != run.fingerprint:
            self._mismatch(job, key, run, peer, message)
            return
        if self.stats is not None:
            self.stats.peer_traffic(job.name, peer, received=len(frames[0]),
                                    received_raw=run.raw_nbytes(len(frames[0])))
        try:
            run.deliver(formation.index_of(peer), message.step, message.t, message.off,
                        frames[0])
        except ProtocolError as exc:
            self.abort(job, key, CollectiveError(
                f"key {key!r} of {job.describe()}: bad slice from peer {peer}: {exc}",
                {"job": job.name, "key": key, "peer": peer},
            ))

    def _keep_early(
        self, job: Job, peer: str, message: Slice, frames: Sequence[Frame], key: Key | None,
    ) -> None:
        """Keep a slice until its job forms (`key` None) or its collective starts here.

        Legitimate early slices belong to collectives this daemon's ranks have
        not submitted yet, whose buffers fit in max_shm_bytes; a peer that sends
        more than that ends the job with an error naming it, instead of filling
        this daemon's memory.
        """
        if job.broken is not None:
            return  # nothing of this generation will run any more
        nbytes = payload_bytes([(peer, message, frames)])
        limit = self.config.max_shm_bytes
        early = job.across.early
        if early.nbytes + nbytes > limit:
            self.counters.early_refused += 1
            held = early.nbytes
            early.clear()
            self._break(job, CollectiveError(
                f"peer daemon {peer} sent {held + nbytes} bytes of slices for collectives "
                f"of {job.describe()} not started on {self.transport.endpoint}, more than "
                f"max_shm_bytes ({limit}): ranks out of step, or a faulty peer",
                {"job": job.name, "peer": peer, "limit": limit},
            ))
            return
        early.keep(key, (peer, message, frames), nbytes)

    def replay(self, job: Job, peer: str, message: Slice, frames: Sequence[Frame]) -> None:
        """Hand on a slice that came early; a bad one is dropped, not the ones after it."""
        try:
            self.on_slice(job, peer, message, frames)
        except ProtocolError as exc:
            self.counters.malformed += 1
            log.warning("dropped an early slice of %s from %s: %s", job.describe(), peer, exc)

    def _mismatch(self, job: Job, key: Key, run: CollectiveRun, peer: str, message: Slice) -> None:
        theirs = message.fp.describe()
        formation = job.across.formation
        assert formation is not None
        peer_ranks = list(formation.ranks_by_daemon[formation.index_of(peer)])
        ours = run.fingerprint.describe() if run.fingerprint is not None else "?"
        error = MismatchError(
            f"key {key!r} of {job.describe()}: ranks disagree: ranks {peer_ranks} (daemon "
            f"{peer}) sent {theirs}; ranks {sorted(job.members)} (daemon "
            f"{self.transport.endpoint}) sent {ours}",
            # The same keys as a mismatch between the ranks of one daemon (matching.py).
            {"job": job.name, "key": key, "sent": {
                **{str(rank): theirs for rank in peer_ranks},
                **{str(rank): ours for rank in sorted(job.members)},
            }},
        )
        self.abort(job, key, error)

    # -- failures -----------------------------------------------------------

    def abort(self, job: Job, key: Key, error: CollectiveError) -> None:
        """Fail one collective here and on every member daemon (once per key)."""
        already_known = key in job.failed
        job.remember_failure(key, error)
        job.across.early.take(key)  # now useless
        run = job.across.runs.get(key)
        if run is not None:
            run.fail(error)
        formation = job.across.formation
        if formation is None or already_known:
            return
        abort = Abort(job.name, formation.generation, key, error.code, error.message,
                      error.details).to_wire()
        for peer in formation.daemons:
            if peer != self.transport.endpoint:
                self.transport.post(peer, abort)

    def peer_lost(self, peer: str, why: str = "") -> None:
        """Fail every collective of every job that spans the lost peer, and of every
        job still forming that counted on it for missing ranks; `why` (the links'
        words: its connection closed, or the failure detector's verdict) goes into
        the errors."""
        self.lost.add(peer)
        held_ranks = set()
        for name, table in list(self.remote.items()):
            if table.pop(peer, None) is not None:
                held_ranks.add(name)
            if not table:
                del self.remote[name]
        why = why or "its connection closed"
        self._break_jobs_with(peer, f"was lost ({why})")
        for job in list(self.jobs.values()):
            self._fail_if_unformable(job, peer if job.name in held_ranks else None, why)

    def _fail_if_unformable(self, job: Job, announced: str | None = None,
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
        others = [p for p in self.transport.peers if p != self.transport.endpoint]
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
        self._break(job, error)
        self.unformed.remember(job.name, gone, error)

    def stream_broken(self, peer: str, why: str) -> None:
        """A data stream with `peer` broke and may have lost slices, of running
        collectives or of ones not started here yet: the jobs spanning it end
        their generation as on a lost peer, here and on every member, instead
        of waiting for their deadlines.  The link itself is up: a new stream
        opens, and the job can form again."""
        self._break_jobs_with(peer, f"lost slices ({why})")

    def _break_jobs_with(self, peer: str, what: str) -> None:
        for job in list(self.jobs.values()):
            if job.across.formation is None or peer not in job.across.formation.daemons:
                continue
            steps = ", ".join(
                f"key {key!r} at step {run.step + 1}/{run.steps} of {run.algorithm}"
                for key, run in job.across.runs.items()
            ) or "between collectives"
            job.across.gone.add(peer)
            self._break(job, PeerLostError(
                f"peer daemon {peer} of {job.describe()} {what}; {steps}",
                {"job": job.name, "peer": peer},
            ))

    def _break(
        self, job: Job, error: GradsyncError, fail_runs: bool = True,
        level: int = logging.WARNING,
    ) -> None:
        """No new collectives for this generation; pending ones fail now.

        Running ones fail too unless `fail_runs` is False: a peer that withdraws
        after finishing its part (its ranks exited) must not fail collectives
        that already hold everything they need from it.  `level`: how loud the
        log line is (a job's normal end is no warning).
        """
        if job.broken is None:
            job.broken = error
        log.log(level, "%s", error.message)
        job.across.auto.epochs.fail(error)
        if fail_runs:
            for run in list(job.across.runs.values()):
                run.fail(error)
        if not job.across.formed.done():
            job.across.formed.set_exception(error)
        assert self.failures is not None, "ClusterJobs.connect() was not called"
        for pending in list(job.pending.values()):
            job.pending.pop(pending.key, None)
            self.failures.fail(pending, error)
        if fail_runs or not job.across.runs:
            self.withdraw(job, error)
        elif job.across.withdrawal is None:
            # The collectives still running here may send slices their peers need
            # yet: the withdrawal follows them, once they end (see `_on_withdraw`).
            job.across.withdrawal = error
