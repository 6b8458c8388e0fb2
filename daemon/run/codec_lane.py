"""A compressed run's encodes and decodes, off the loop, on one or more threads.

Coding a 4 MiB slice to fp8 takes a millisecond or two of one core.  Done on
the event loop, those milliseconds add up, per step, to time in which the loop
does not feed the links' sockets, so the wire stands idle while the daemon
codes.  The lane runs them on the daemon's codec threads instead (the C codec
releases the GIL), and runs what follows each (the send of an encoded slice)
back on the loop.

Several threads (`codec_lanes`) code different slices at once, and the result
stays the one a single thread gives, bit for bit: what fixes the result is the
order of the reads and writes of each element (a slice's decode-and-add, then
its re-encode, which rounds it in place), not the order in which slices are
coded.  So every job names the element range `span` it reads and writes, and
starts only once every job submitted before it that touches that range has
finished (`_claim` keeps, per element range, the last job that claimed it);
jobs on disjoint ranges run side by side.  The executor submits them in the
order the synchronous schedule gives (executor.py), so each element sees the
same sequence of operations whatever the number of threads.

A job goes to the pool at once and, on its thread, first waits for those
earlier jobs: the pool starts jobs in the order they came, so they have all
started by then (on other threads), and none waits for a later one.  Waiting
there rather than on the loop keeps a slice's re-encode right behind its
decode, without a trip through a loop busy with the sockets.  Follow-ups run
as their jobs finish: slices name their place, so a peer takes them in any
order.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

from gradsync.protocol.errors import CollectiveTimeoutError, GradsyncError, ProtocolError

__all__ = ["OFFLOAD_BYTES", "WHOLE", "CodecLane"]

#: Slices smaller than this are coded inline when nothing waits in the lane:
#: a thread hand-off costs tens of microseconds.
OFFLOAD_BYTES = 256 * 1024
#: The span of a job that may touch anything: it waits for every earlier one.
WHOLE = (0, sys.maxsize)
#: How long a job waits for an earlier one (milliseconds of work; a bound, not a pace).
EARLIER_JOB_TIMEOUT_S = 120.0
#: What a job that did not run (the run had failed) hands its follow-up.
_SKIPPED = object()


class _Job:
    """One job handed to the pool: set once it ran (or was skipped)."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


class CodecLane:
    """Runs `work` off the loop (or inline: no pool, or small and nothing queued),
    then `then(result)` on the loop; a job starts once every earlier one whose
    span overlaps its own has finished."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        pool: concurrent.futures.Executor | None,
        fails: asyncio.Future[None],
    ) -> None:
        """`pool` runs jobs, as many at once as it has threads, starting them in
        the order they came (a ThreadPoolExecutor).  When a job or its follow-up
        raises, `error` holds it and `fails` (the run's `done`; not the run
        itself, which a cycle would keep alive) gets it if still pending.  Once
        `fails` holds an error (this one, or the run's abort), jobs not yet
        started skip their work and later follow-ups are skipped: nothing more
        touches the buffer or is sent."""
        self._loop = loop
        self._pool = pool
        self._fails = fails
        #: Jobs handed to the pool whose follow-up has not run yet.
        self._pending = 0
        #: Read by the codec threads: the run failed, start nothing more.
        self._stopped = False
        #: Set while nothing is pending (cleared by a `settle` that waits).
        self._idle = asyncio.Event()
        #: Element ranges [starts[i], starts[i + 1]) and the last job that claimed each.
        self._starts: list[int] = [0]
        self._owners: list[_Job | None] = [None]
        self.error: GradsyncError | None = None

    def submit(
        self, work: Callable[[], Any], then: Callable[[Any], None], nbytes: int,
        span: tuple[int, int] = WHOLE,
    ) -> None:
        """Run `work` (which reads and writes elements [span) of the buffer), then
        `then` with its result.  Inline when there is no pool, or when `nbytes` is
        small and nothing is pending (then no earlier job can be running on it).
        After the run failed nothing more runs."""
        if self._failed():
            return
        if self._pool is None or (self._pending == 0 and nbytes < OFFLOAD_BYTES):
            then(work())
            return
        job = _Job()
        earlier = self._claim(span, job)
        self._pending += 1
        future = self._loop.run_in_executor(
            self._pool, functools.partial(self._run, job, earlier, work))
        future.add_done_callback(functools.partial(self._finished, then))

    @property
    def busy(self) -> bool:
        """Whether a job or its follow-up is still to run."""
        return self._pending > 0

    def _claim(self, span: tuple[int, int], job: _Job) -> list[_Job]:
        """Make `job` the last claimant of [span); the earlier claimants not done."""
        lo, hi = span
        starts, owners = self._starts, self._owners
        for point in (lo, hi):
            index = bisect.bisect_right(starts, point) - 1
            if starts[index] != point:
                starts.insert(index + 1, point)
                owners.insert(index + 1, owners[index])
        first = bisect.bisect_left(starts, lo)
        last = bisect.bisect_left(starts, hi)
        earlier = {id(owner): owner for owner in owners[first:last]
                   if owner is not None and not owner.done.is_set()}
        starts[first:last] = [lo]
        owners[first:last] = [job]
        return list(earlier.values())

    def _run(self, job: _Job, earlier: list[_Job], work: Callable[[], Any]) -> Any:
        """On a codec thread: wait for the earlier jobs on this span, then work."""
        try:
            for other in earlier:
                if not other.done.wait(EARLIER_JOB_TIMEOUT_S):
                    raise CollectiveTimeoutError(
                        f"a slice's coding waited {EARLIER_JOB_TIMEOUT_S:g}s for the one "
                        "before it on the same elements")
            return _SKIPPED if self._stopped else work()
        finally:
            job.done.set()

    def _failed(self) -> bool:
        failed = self.error is not None or bool(
            self._fails.done() and not self._fails.cancelled() and self._fails.exception())
        self._stopped = self._stopped or failed
        return failed

    def _finished(self, then: Callable[[Any], None], future: asyncio.Future[Any]) -> None:
        self._pending -= 1
        try:
            if self._failed() or future.cancelled():
                return
            try:
                result = future.result()
                if result is not _SKIPPED:
                    then(result)
            except Exception as exc:  # a job's or its send's error (PeerLostError)
                self.error = exc if isinstance(exc, GradsyncError) else ProtocolError(
                    f"coding a slice failed: {exc!r}")
                self._stopped = True
                if not self._fails.done():
                    self._fails.set_exception(self.error)
        finally:
            if self._pending == 0:
                self._idle.set()

    async def settle(self) -> None:
        """Wait until every job submitted and its follow-up have run, or were
        skipped (the buffer is then the lane's no longer)."""
        self._failed()
        while self._pending:
            self._idle.clear()  # set again only once `_pending` is 0: no wake-up is lost
            await self._idle.wait()
