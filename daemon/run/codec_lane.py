"""One thread, in order, for a compressed run's encodes and decodes.

Coding a 4 MiB slice to fp8 takes about 1.6 ms of one core.  Done on the event
loop, those milliseconds add up, per step, to time in which the loop does not
feed the links' sockets, so the wire stands idle while the daemon codes (on a
2 Gbit/s link fp8 reached 2.8x the link rate of the 3.9x its bytes allow).
The lane runs them on one worker thread instead (the C codec releases the
GIL), and runs what follows each (the send of an encoded slice) back on the
loop, in submission order.  One worker keeps every encode and decode in the
order the synchronous schedule gives them, so the buffer sees the same
sequence of reads and writes, and the sends leave in the same order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import Any

from gradsync.protocol.errors import GradsyncError, ProtocolError

__all__ = ["OFFLOAD_BYTES", "CodecLane"]

#: Slices smaller than this are coded inline when nothing waits in the lane:
#: a thread hand-off costs tens of microseconds.
OFFLOAD_BYTES = 256 * 1024


class CodecLane:
    """Runs `work` off the loop (or inline: no pool, or small and nothing queued),
    then `then(result)` on the loop, every job after all earlier ones."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        pool: concurrent.futures.Executor | None,
        fails: asyncio.Future[None],
    ) -> None:
        """`pool` must run one job at a time (one worker): that is the order.
        When a job or its follow-up raises, `error` holds it and `fails` (the
        run's `done`; not the run itself, which a cycle would keep alive) gets it
        if still pending.  Once `fails` holds an error (this one, or the run's
        abort), later follow-ups are skipped: nothing more is sent."""
        self._loop = loop
        self._pool = pool
        self._fails = fails
        self._pending = 0
        self._tail: asyncio.Future[Any] | None = None
        self.error: GradsyncError | None = None

    def submit(self, work: Callable[[], Any], then: Callable[[Any], None], nbytes: int) -> None:
        if self._pool is None or (self._pending == 0 and nbytes < OFFLOAD_BYTES):
            then(work())
            return
        self._pending += 1
        future = self._loop.run_in_executor(self._pool, work)
        self._tail = future
        future.add_done_callback(functools.partial(self._finished, then))

    @property
    def busy(self) -> bool:
        """Whether a job or its follow-up is still to run."""
        return self._pending > 0

    def _finished(self, then: Callable[[Any], None], future: asyncio.Future[Any]) -> None:
        self._pending -= 1
        failed = self._fails.done() and not self._fails.cancelled() and self._fails.exception()
        if self.error is not None or failed or future.cancelled():
            return
        try:
            then(future.result())
        except Exception as exc:  # a job's or its send's error (PeerLostError) fails the run
            self.error = exc if isinstance(exc, GradsyncError) else ProtocolError(
                f"coding a slice failed: {exc!r}")
            if not self._fails.done():
                self._fails.set_exception(self.error)

    async def settle(self) -> None:
        """Wait until every job submitted and its follow-up have run (the buffer is
        then the lane's no longer)."""
        while self._pending and self._tail is not None:
            # `_finished` was registered first, so it has run once this wakes.
            await asyncio.wait([self._tail])
