"""How a multi-node job fails: one collective (an abort, here and on every
member), or the whole generation (a rank lost, a peer lost or cut off, a
stream that lost slices).  Pending collectives fail through the daemon's one
failure path (`ClusterContext.failures`), so they are counted and their
timers cancelled; the peers hear of it through the job's withdrawal."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from gradsync.daemon.core.cluster_context import ClusterContext, log
from gradsync.protocol.errors import (
    CollectiveError,
    GradsyncError,
    PeerLostError,
    as_collective_error,
    error_from_wire,
)
from gradsync.protocol.peer import Abort, Key

if TYPE_CHECKING:
    from gradsync.daemon.core.matching import Job

#: Tells the peers that the job ended here (`JobForming.withdraw`).
Withdraw = Callable[["Job", GradsyncError], None]


class JobFailures:
    """Aborts and breaks of the daemon's multi-node jobs."""

    def __init__(self, context: ClusterContext, withdraw: Withdraw) -> None:
        self.context = context
        self.withdraw = withdraw

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
        transport = self.context.transport
        abort = Abort(job.name, formation.generation, key, error.code, error.message,
                      error.details).to_wire()
        for peer in formation.daemons:
            if peer != transport.endpoint:
                transport.post(peer, abort)

    def on_abort(self, peer: str, message: Abort, job: Job | None) -> None:
        """A member failed one collective of the job's current generation."""
        formation = job.across.formation if job is not None else None
        if job is None or formation is None or message.gen != formation.generation:
            self.context.counters.stale_generation += 1
            return
        key = message.key
        error = as_collective_error(
            error_from_wire(message.code, message.message, message.details))
        job.remember_failure(key, error)
        # Not run here if not begun: its late ranks fail at once (`Job.submit`).
        job.across.early.take(key)
        run = job.across.runs.get(key)
        if run is not None:
            run.fail(error)

    def broke_here(self, job: Job, error: GradsyncError) -> None:
        """The job broke on this daemon (a rank lost): fail its running collectives
        here and on every member, and withdraw it."""
        for key in list(job.across.runs):
            self.abort(job, key, as_collective_error(error))
        self.withdraw(job, error)

    def break_jobs_with(self, peer: str, what: str, lost: bool = False) -> None:
        """End the generation of every formed job that spans `peer`; `what`
        happened to it goes into the errors; `lost`: the peer was declared lost or
        cut off (the members hear it with our withdrawal: its data will not come)."""
        for job in list(self.context.jobs.values()):
            if job.across.formation is None or peer not in job.across.formation.daemons:
                continue
            steps = ", ".join(
                f"key {key!r} at step {run.step + 1}/{run.steps} of {run.algorithm}"
                for key, run in job.across.runs.items()
            ) or "between collectives"
            job.across.gone.add(peer)
            if lost and not job.across.lost:
                job.across.lost = peer
            self.break_job(job, PeerLostError(
                f"peer daemon {peer} of {job.describe()} {what}; {steps}",
                {"job": job.name, "peer": peer},
            ))

    def break_job(
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
        failures = self.context.failures
        assert failures is not None, "ClusterJobs.connect() was not called"
        for pending in list(job.pending.values()):
            job.pending.pop(pending.key, None)
            failures.fail(pending, error)
        if fail_runs or not job.across.runs:
            self.withdraw(job, error)
        elif job.across.withdrawal is None:
            # The collectives still running here may send slices their peers need
            # yet: the withdrawal follows them, once they end (`ClusterJobs.run_ended`).
            job.across.withdrawal = error
