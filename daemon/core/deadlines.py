"""Every collective's deadline and stall warning, decided from an injected clock.

The core owns time: when a key waits for local ranks, how long its deadline is
(the earliest any submitter asked for, counted from the first submission, on
the fast path if it began there), when it expires, and when a wait is long
enough to warn of.  `Clock` is how time comes in: the daemon gives the event
loop's (io/service.py), core tests a fake one they advance by hand, so a
collective runs past its deadline without anyone sleeping.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from gradsync.protocol.errors import CollectiveTimeoutError

if TYPE_CHECKING:
    from gradsync.daemon.core.matching import CollectiveCall, Job, Key, Submission

log = logging.getLogger("gradsync.daemon")

#: How long past a fast-path key's deadline the daemon waits for the ranks that
#: published it there to follow it to the socket, so that all get one error.
FAST_FOLLOW_S = 2.0
FAST_FOLLOW_POLL_S = 0.002


class Timer(Protocol):
    """A callback to come, which can be called off."""

    def cancel(self) -> None: ...


class Clock(Protocol):
    """Time as the core sees it (seconds of CLOCK_MONOTONIC in the daemon)."""

    def now(self) -> float: ...

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> Timer: ...


class Deadlines:
    """The deadlines of the keys that wait for local ranks, on every job."""

    def __init__(
        self,
        jobs: dict[str, Job],
        clock: Clock,
        fast_ranks: Callable[[str, Key], set[int]],
        expired: Callable[[CollectiveCall, CollectiveTimeoutError], None],
    ) -> None:
        self.jobs = jobs
        self.clock = clock
        #: Ranks that published a key on the job's fast page (they come to the socket).
        self._fast_ranks = fast_ranks
        #: Told of a key that timed out (it answers every submitter).
        self._expired = expired

    def waiting(self, job: Job, pending: CollectiveCall, submission: Submission,
                waited_s: float = 0.0) -> None:
        """`submission` joined `pending`, which still waits for other local ranks.

        `waited_s`: how long the submitter already waited for this key on the
        fast path; its deadline counts from then, as if it had come here first.
        """
        if pending.timer is None and waited_s > 0:
            pending.first_seen -= waited_s
        # The earliest deadline any submitter asked for wins; the first one's
        # counts from its submission (on the fast path, if it began there).
        remaining_s = max(0.0, submission.timeout_s - waited_s)
        deadline_s = (
            self.clock.now() - pending.first_seen + remaining_s if pending.timer
            else submission.timeout_s  # exactly its timeout_s, which errors quote
        )
        if pending.timer is None or deadline_s < pending.deadline_s:
            if pending.timer is not None:
                pending.timer.cancel()
            pending.deadline_s = deadline_s
            name, key = job.name, pending.key
            pending.timer = self.clock.call_later(remaining_s, lambda: self.expire(name, key))

    @staticmethod
    def settled(pending: CollectiveCall) -> None:
        """`pending` matched, or failed: its deadline no longer counts."""
        if pending.timer is not None:
            pending.timer.cancel()

    def expire(self, job_name: str, key: Key) -> None:
        """The deadline of `key` passed: fail it, unless ranks that published it
        on the fast path are still on their way to the socket (a short grace)."""
        job = self.jobs.get(job_name)
        pending = job.pending.get(key) if job else None
        if pending is not None and pending.timer is not None:
            # Ranks that published the key on the fast path follow a withdrawal to the
            # socket within milliseconds: wait for them, so that all get one error.
            coming = self._fast_ranks(job_name, key) - set(pending.submissions)
            overdue = self.clock.now() - pending.first_seen - pending.deadline_s
            if coming and overdue < FAST_FOLLOW_S:
                pending.timer = self.clock.call_later(
                    FAST_FOLLOW_POLL_S, lambda: self.expire(job_name, key)
                )
                return
        expired = job.expire(key) if job else None
        if expired is not None:
            pending, error = expired
            log.warning("%s", error.message)
            self._expired(pending, error)

    def report_stalls(self, limit_s: float, running: Iterable[CollectiveCall]) -> None:
        """Log, once per collective, one waiting longer than `limit_s` and for whom:
        for local ranks (pending), or for peer daemons (`running`, multi-node)."""
        now = self.clock.now()
        running_by_key: dict[tuple[str, Key], CollectiveCall] = {}
        for pending in running:
            running_by_key.setdefault((pending.job_name, pending.key), pending)
        for job in list(self.jobs.values()):
            for pending in job.pending.values():
                if not pending.stall_reported and now - pending.first_seen > limit_s:
                    pending.stall_reported = True
                    missing = sorted(set(job.members) - set(pending.submissions))
                    absent = job.local_world_size - len(job.members)
                    log.warning(
                        "key %r of %s has waited %.0fs for ranks %s%s", pending.key,
                        job.describe(), now - pending.first_seen, missing,
                        f" ({absent} local ranks not connected)" if absent else "",
                    )
            for key, run in list(job.across.runs.items()):
                ready = running_by_key.get((job.name, key))
                if (ready is not None and not ready.stall_reported
                        and now - ready.first_seen > limit_s
                        and job.across.formation is not None):
                    ready.stall_reported = True
                    log.warning(
                        "key %r of %s has waited %.0fs at step %d/%d of %s for peer daemons %s",
                        key, job.describe(), now - ready.first_seen, run.step + 1, run.steps,
                        run.algorithm, [job.across.formation.daemons[i] for i in run.waiting_for()],
                    )
