"""Running collectives on this daemon: matched requests become results.

The request handlers (io/service.py) match what the local ranks submit; once
every local rank is in, they hand the collective here.  A single-node
collective is reduced in place (inline when small, else cut into ranges on
the thread pool; device buffers on their backend's streams); a multi-node one
goes to the inter-daemon phase (multi_node.py).  Every end is answered here:
the result, or one error for every member (and, across daemons, the core's
abort, so peers' clients do not wait for their deadlines).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from gradsync.daemon.backends import Backend, Buffers, Slab
from gradsync.daemon.backends.reduce import split_ranges
from gradsync.daemon.core.cluster import ClusterJobs
from gradsync.daemon.core.collectives import MatchedCollective, run_local
from gradsync.daemon.core.deadlines import Deadlines
from gradsync.daemon.core.matching import CollectiveCall, Job
from gradsync.daemon.run.multi_node import CrossDaemonRunner
from gradsync.daemon.run.offload import Offload
from gradsync.daemon.state import DaemonState
from gradsync.daemon.stats import StatsRecorder
from gradsync.daemon.trace import TraceRecorder
from gradsync.protocol.dtypes import DTYPES, ReduceOp
from gradsync.protocol.errors import (
    DaemonShuttingDownError,
    GradsyncError,
    MismatchError,
    as_collective_error,
)
from gradsync.protocol.requests import ALLREDUCE

log = logging.getLogger("gradsync.daemon")


class CollectiveRuns:
    """The collectives this daemon runs, from matched to answered."""

    def __init__(
        self,
        state: DaemonState,
        loop: asyncio.AbstractEventLoop,
        buffers: Buffers,
        executor: concurrent.futures.ThreadPoolExecutor,
        stats: StatsRecorder,
        trace: TraceRecorder,
        offload: Offload,
    ) -> None:
        self.state = state
        self.config = state.config
        self.loop = loop
        self.buffers = buffers
        self.executor = executor
        self.stats = stats
        self.trace = trace
        self.offload = offload
        #: Tasks of running collectives, and the collectives themselves (by id).
        self.running: set[asyncio.Task[None]] = set()
        self.in_flight: dict[int, CollectiveCall] = {}
        #: The multi-node side, when this daemon has peers (`join_cluster`).
        self.cluster: ClusterJobs | None = None
        self.runner: CrossDaemonRunner | None = None

    def join_cluster(self, cluster: ClusterJobs, runner: CrossDaemonRunner) -> None:
        self.cluster, self.runner = cluster, runner

    def start(self, job: Job, ready: CollectiveCall, collective: MatchedCollective) -> None:
        """Run a matched collective: a single-node allreduce straight on its
        backend, every other one (and every multi-node one) through its plan."""
        if collective.kind == ALLREDUCE and not job.multi_node:
            assert collective.op is not None
            self._reduce_here(job, ready, collective.op)
        else:
            self._spawn(ready, self._run(job, ready, collective))

    def fail_in_flight(self, error: GradsyncError) -> None:
        """Answer every running collective with `error` (the daemon is stopping)."""
        for pending in list(self.in_flight.values()):
            self.fail(pending, error)

    async def _run(self, job: Job, ready: CollectiveCall, collective: MatchedCollective) -> None:
        """Run a collective here (`run_local`) or across daemons (its plan), on
        host copies where its buffers are on a device that cannot run it."""
        kind, op, root, chunk, dtype = (collective.kind, collective.op, collective.root,
                                        collective.chunk, collective.dtype)
        order = sorted(ready.submissions)
        nbytes = chunk * dtype.itemsize * job.world_size * max(1, len(order))
        first = ready.submissions[order[0]].fingerprint
        views = [ready.submissions[rank].view for rank in order]
        views += [ready.submissions[rank].out for rank in order]

        def by_rank(arrays: list[Any]) -> tuple[dict[int, Any], dict[int, Any]]:
            """(inputs, outputs) by rank, from `views` or their host copies."""
            return (dict(zip(order, arrays[: len(order)], strict=True)),
                    dict(zip(order, arrays[len(order):], strict=True)))

        async def here(arrays: list[Any]) -> None:
            ins, outs = by_rank(arrays)
            await self.offload.run(
                lambda: run_local(kind, ins, outs, job.world_size, chunk, op, root), nbytes
            )

        async def across(arrays: list[Any]) -> None:
            assert self.runner is not None
            await self.runner.run_plan(job, ready, collective, *by_rank(arrays))

        try:
            slabs, backend = self._backend(ready)
            on_device = (
                backend is not self.buffers.host
                and len({slab.device for slab in slabs}) == 1
                and not (op is not None and first.dtype == "bfloat16")
            )
            if collective.moves_nothing():
                pass  # nothing to move; every rank agreed on the fingerprint locally
            elif on_device and not job.multi_node:
                ins, outs = by_rank(views)
                with backend.running(slabs):
                    run_local(kind, ins, outs, job.world_size, chunk, op, root)
            else:
                # Host memory as it is; device slabs through host copies: between
                # nodes (the links send host memory), across GPUs, and for bfloat16
                # reductions, which cupy's kernels cannot express.
                await self._staged(backend, slabs, views, dtype,
                                   across if job.multi_node else here)
        except Exception as exc:
            self._collective_failed(job, ready, exc)
            return
        self._succeed(job, ready)

    def _backend(self, ready: CollectiveCall) -> tuple[list[Slab], Backend]:
        """The slabs of a matched collective and their one backend.

        Raises MismatchError when some local ranks pass host memory and others
        device memory: the daemon cannot reduce across the two in one kernel.
        """
        order = sorted(ready.submissions)
        slabs = [slab for rank in order for slab in ready.submissions[rank].slabs]
        kinds = {slab.backend.kind for slab in slabs}
        if len(kinds) > 1:
            where = ", ".join(
                f"rank {rank}: {'/'.join(s.backend.kind for s in ready.submissions[rank].slabs)}"
                for rank in order if ready.submissions[rank].slabs
            )
            raise MismatchError(
                f"key {ready.key!r} mixes host and device buffers ({where}); every local "
                "rank must pass the same kind of memory"
            )
        return slabs, slabs[0].backend if slabs else self.buffers.host

    async def _staged(
        self, backend: Backend, slabs: list[Slab], views: list[Any], dtype: np.dtype,
        run: Callable[[list[Any]], Coroutine[Any, Any, None]],
    ) -> None:
        """Run `run` over host copies of device views (the peer links send host memory)."""
        if backend is self.buffers.host:
            await run(views)
            return
        with backend.running(slabs):
            pass  # the daemon's streams now wait for the clients' writes
        hosts, copy_back = await self.loop.run_in_executor(
            self.executor, backend.to_host, views, dtype
        )
        await run(hosts)
        with backend.running(slabs):
            copied = copy_back()  # queued, then the clients' done events after them
        await self.loop.run_in_executor(self.executor, copied)

    def _reduce_here(self, job: Job, ready: CollectiveCall, op: ReduceOp) -> None:
        """A single-node allreduce: inline when small (or only queued, on a device),
        else cut into ranges on the thread pool."""
        order = sorted(ready.submissions)
        slots = [v for v in (ready.submissions[r].view for r in order) if v is not None]
        dtype = ready.submissions[order[0]].fingerprint.dtype
        try:
            slabs, backend = self._backend(ready)
        except MismatchError as exc:
            self.fail(ready, exc)
            return
        if (backend.parallel_ranges and slots
                and slots[0].nbytes * len(slots) > self.config.inline_reduce_bytes):
            self._spawn(ready, self._reduce_on_pool(job, ready, op, slots, backend, dtype))
            return
        # A thread hand-off costs more than reducing a few hundred KiB here, and
        # device kernels are only queued.
        try:
            with backend.running(slabs):
                if slots:
                    backend.reduce(slots, op, dtype, 0, slots[0].size)
        except Exception as exc:  # a kernel failing is a bug; fail loudly, keep serving
            self._kernel_failed(job, ready, exc)
            return
        self._succeed(job, ready)

    def _spawn(self, ready: CollectiveCall, work: Coroutine[Any, Any, None]) -> None:
        """Run a collective's coroutine as a task the shutdown can find."""
        number = id(ready)
        self.in_flight[number] = ready
        task = self.loop.create_task(work)
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        # Answering drops it from in_flight (`_answered`); this catches a task that
        # ends otherwise.  It holds the number alone: `ready` holds views of the
        # buffers, which must not outlive the answer.
        task.add_done_callback(lambda _: self.in_flight.pop(number, None))

    def _answered(self, ready: CollectiveCall) -> None:
        """Forget a collective as its members are answered: a client may free its
        segment the moment it has the answer, and the space in /dev/shm comes
        back only once no view of the daemon's maps it (a done callback of the
        task would run too late: the free can arrive first)."""
        self.in_flight.pop(id(ready), None)

    async def _reduce_on_pool(
        self, job: Job, ready: CollectiveCall, op: ReduceOp, slots: list[np.ndarray],
        backend: Backend, dtype: str,
    ) -> None:
        try:
            parts = split_ranges(slots[0].size, slots[0].itemsize, self.config.threads)
            await asyncio.gather(
                *(
                    self.loop.run_in_executor(
                        self.executor, backend.reduce, slots, op, dtype, begin, end
                    )
                    for begin, end in parts
                )
            )
        except Exception as exc:
            self._kernel_failed(job, ready, exc)
            return
        self._succeed(job, ready)

    def _collective_failed(self, job: Job, ready: CollectiveCall, exc: Exception) -> None:
        """Answer every member with the error; tell peer daemons of a multi-node job."""
        if isinstance(exc, GradsyncError):
            error = exc
        else:
            log.error("collective %r of %s failed", ready.key, job.describe(), exc_info=exc)
            error = GradsyncError(f"key {ready.key!r} of {job.describe()} failed in the "
                                  f"daemon: {exc}")
        if job.multi_node and self.cluster is not None:
            if ready.key not in job.failed:  # else aborted where it failed (run/multi_node.py)
                # Tell the other daemons, so their clients do not wait for the deadline.
                self.cluster.abort(job, ready.key, as_collective_error(error))
        else:
            job.remember_failure(ready.key, error)
        self.fail(ready, error)

    def _succeed(self, job: Job, ready: CollectiveCall) -> None:
        if self.state.shutting_down:
            # The clients were already told; the result may not be complete everywhere.
            self.fail(ready, DaemonShuttingDownError("daemon shutting down"))
            return
        job.completed += 1
        now = time.monotonic()
        self.state.requests.collectives += 1
        first = ready.submissions[min(ready.submissions)]
        itemsize = DTYPES[first.fingerprint.dtype].itemsize
        if self.trace.active:
            track = f"job {job.name}"
            what = first.fingerprint.describe()
            self.trace.add(track, "wait for local ranks", ready.first_seen, ready.matched_at,
                           key=repr(ready.key), collective=what)
            self.trace.add(track, f"{first.fingerprint.collective} (run)", ready.matched_at, now,
                           key=repr(ready.key), collective=what)
        self.stats.collective_done(
            job.name, first.fingerprint.collective, first.fingerprint.algorithm,
            first.fingerprint.count * itemsize, job.world_size, now - ready.first_seen,
        )
        self._answered(ready)
        for submission in ready.submissions.values():
            submission.respond(None, {
                "submitted": submission.submitted_at, "matched": ready.matched_at,
                "completed": now,
            })

    def _kernel_failed(self, job: Job, ready: CollectiveCall, exc: Exception) -> None:
        log.error("reduction of key %r of %s failed", ready.key, job.describe(), exc_info=exc)
        self.fail(ready, GradsyncError(f"reduction failed in the daemon: {exc}"))

    def fail(self, pending: CollectiveCall, error: GradsyncError) -> None:
        Deadlines.settled(pending)
        self.state.requests.failed += 1
        self.stats.collective_failed(pending.job_name or None, error.code)
        self._answered(pending)
        for submission in pending.submissions.values():
            submission.respond(error)
