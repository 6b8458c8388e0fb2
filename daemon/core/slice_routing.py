"""Slices both ways.  This daemon's go out to the job's members through the
links (`send`).  A peer's slice goes straight into its running collective's
buffer (placed before it arrives), is handed to that collective, or is kept
until its job forms or its collective starts here, within max_shm_bytes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gradsync.daemon.core.cluster_context import ClusterContext, Frame, log
from gradsync.daemon.core.cluster_job import payload_bytes
from gradsync.daemon.core.interfaces import CollectiveRun, PlacedPayload, is_placed
from gradsync.daemon.core.job_failures import JobFailures
from gradsync.protocol.errors import CollectiveError, MismatchError, ProtocolError
from gradsync.protocol.peer import Key, Slice

if TYPE_CHECKING:
    from gradsync.daemon.core.matching import Job


class SliceRouting:
    """The peers' slices of every multi-node job, and the runs they go to."""

    def __init__(self, context: ClusterContext, failures: JobFailures) -> None:
        self.context = context
        self.failures = failures

    def send(self, job: Job, peer: str, header: dict[str, Any], payload: Any,
             zero_copy: bool, raw_nbytes: int) -> Any:
        """Send one of this daemon's slices of `job` to member `peer` (what the
        links' `post` returns); counted as `on_slice` counts the peers' slices.
        `raw_nbytes`: what the payload is before compression."""
        stats = self.context.stats
        if stats is not None:
            stats.peer_traffic(job.name, peer, sent=len(payload), sent_raw=raw_nbytes)
        return self.context.transport.post(peer, header, (payload,), zero_copy)

    def run_started(self, job: Job, key: Key, run: CollectiveRun) -> None:
        """Collective `key` began its inter-daemon phase here: its slices go to `run`."""
        job.across.runs[key] = run

    def feed_early(self, job: Job, key: Key, run: CollectiveRun) -> None:
        """Hand `run` (just started) the slices that came for it before it ran."""
        for peer, message, frames in job.across.early.take(key):
            self.replay(job, peer, message, frames)
        if job.broken is not None:  # it broke while this run's task was queued
            job.across.fail_if_waiting_on_gone(run, job.broken)

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
        job = self.context.jobs.get(message.job)
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
        self.context.counters.slices_placed += 1
        return [placement]

    def on_slice(self, job: Job, peer: str, message: Slice, frames: Sequence[Frame]) -> None:
        formation = job.across.formation
        if formation is None:
            self._keep_early(job, peer, message, frames, None)
            return
        if message.gen != formation.generation:
            self.context.counters.stale_generation += 1
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
        stats = self.context.stats
        if stats is not None:
            stats.peer_traffic(job.name, peer, received=len(frames[0]),
                               received_raw=run.raw_nbytes(len(frames[0])))
        try:
            run.deliver(formation.index_of(peer), message.step, message.t, message.off,
                        frames[0])
        except ProtocolError as exc:
            self.failures.abort(job, key, CollectiveError(
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
        limit = self.context.config.max_shm_bytes
        early = job.across.early
        if early.nbytes + nbytes > limit:
            self.context.counters.early_refused += 1
            held = early.nbytes
            early.clear()
            self.failures.break_job(job, CollectiveError(
                f"peer daemon {peer} sent {held + nbytes} bytes of slices for collectives "
                f"of {job.describe()} not started on {self.context.transport.endpoint}, more "
                f"than max_shm_bytes ({limit}): ranks out of step, or a faulty peer",
                {"job": job.name, "peer": peer, "limit": limit},
            ))
            return
        early.keep(key, (peer, message, frames), nbytes)

    def replay(self, job: Job, peer: str, message: Slice, frames: Sequence[Frame]) -> None:
        """Hand on a slice that came early; a bad one is dropped, not the ones after it."""
        try:
            self.on_slice(job, peer, message, frames)
        except ProtocolError as exc:
            self.context.counters.malformed += 1
            log.warning("dropped an early slice of %s from %s: %s", job.describe(), peer, exc)

    def _mismatch(self, job: Job, key: Key, run: CollectiveRun, peer: str, message: Slice) -> None:
        theirs = message.fp.describe()
        formation = job.across.formation
        assert formation is not None
        peer_ranks = list(formation.ranks_by_daemon[formation.index_of(peer)])
        ours = run.fingerprint.describe() if run.fingerprint is not None else "?"
        endpoint = self.context.transport.endpoint
        error = MismatchError(
            f"key {key!r} of {job.describe()}: ranks disagree: ranks {peer_ranks} (daemon "
            f"{peer}) sent {theirs}; ranks {sorted(job.members)} (daemon "
            f"{endpoint}) sent {ours}",
            # The same keys as a mismatch between the ranks of one daemon (matching.py).
            {"job": job.name, "key": key, "sent": {
                **{str(rank): theirs for rank in peer_ranks},
                **{str(rank): ours for rank in sorted(job.members)},
            }},
        )
        self.failures.abort(job, key, error)
