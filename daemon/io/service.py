"""The daemon's request handling: sessions, jobs, buffers and reductions.

`GradsyncService` owns the state; `session.py` feeds it decoded requests and
`server.py` runs its lifecycle.  Everything here runs on the event loop except
large reductions, which go to a thread pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import os
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import numpy as np

from gradsync.daemon.backends import Backend, Buffers, Slab
from gradsync.daemon.backends.reduce import split_ranges
from gradsync.daemon.core.cluster import ClusterJobs
from gradsync.daemon.core.matching import Job, Member, PendingCollective, Submission
from gradsync.daemon.core.membership import Formation
from gradsync.daemon.core.plans import (
    KINDS,
    REDUCING,
    ROOTED,
    Plan,
    chunk_count,
    make_plan,
    run_local,
)
from gradsync.daemon.run.multi_node import CrossDaemonRunner
from gradsync.daemon.state import DaemonState
from gradsync.daemon.stats import StatsRecorder
from gradsync.daemon.trace import TraceRecorder
from gradsync.protocol import messages
from gradsync.protocol.codec import Message
from gradsync.protocol.dtypes import DTYPES, ReduceOp, check_op_for_dtype, parse_reduce_op
from gradsync.protocol.errors import (
    CollectiveError,
    DaemonShuttingDownError,
    GradsyncError,
    InvalidArgumentError,
    JobError,
    MismatchError,
    ProtocolError,
    ShmExhaustedError,
)
from gradsync.protocol.peer import ALGORITHM_CHOICES, Fingerprint
from gradsync.protocol.version import PROTOCOL_VERSION, __version__

if TYPE_CHECKING:
    from gradsync.daemon.io.session import ClientSession

log = logging.getLogger("gradsync.daemon")

MAX_LOCAL_RANKS = 1024
MAX_WORLD_SIZE = 1 << 20


class GradsyncService:
    """State and request handlers of one daemon."""

    def __init__(self, state: DaemonState, loop: asyncio.AbstractEventLoop) -> None:
        config = state.config
        self.state = state
        self.config = config
        self.loop = loop
        self.buffers = Buffers(
            config.max_shm_bytes, shm_mode=0o660 if config.group_access else 0o600
        )
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.threads, thread_name_prefix="gradsync-reduce"
        )
        self.jobs = state.jobs
        self.sessions = state.sessions
        self.running: set[asyncio.Task[None]] = set()
        self.in_flight: dict[int, PendingCollective] = {}
        self.shutting_down = False
        #: The multi-node side, when this daemon has peers (`join_cluster`).
        self.cluster: ClusterJobs | None = None
        self.runner: CrossDaemonRunner | None = None
        self.stats = StatsRecorder()
        self.trace = TraceRecorder()

    def join_cluster(self, cluster: ClusterJobs, runner: CrossDaemonRunner) -> None:
        """Serve multi-node jobs too: membership through `cluster`, the
        inter-daemon phase through `runner`."""
        self.cluster, self.runner = cluster, runner

    # -- sessions -----------------------------------------------------------

    def session_opened(self, session: ClientSession) -> None:
        self.sessions[session.session_id] = session

    def session_closed(self, session: ClientSession) -> None:
        """A client went away: free its segments, break its job for the others."""
        self.sessions.pop(session.session_id, None)
        for segment_id in session.segments:
            self.buffers.release(segment_id)
        session.segments.clear()
        job = self.jobs.get(session.job_name) if session.job_name else None
        if job is None or session.rank is None:
            return
        reason = "disconnected" if session.closed_cleanly else "died (connection lost)"
        was_broken = job.broken is not None
        failed = job.remove_member(session.rank, reason)
        for pending in failed:
            self._fail(pending, job.broken or JobError(f"{job.describe()} broke"))
        if not was_broken and session.closed_cleanly and not failed:
            # A rank that said bye with nothing in flight: the job's normal end,
            # which the withdrawal tells the peers, so that they do not warn.
            job.ended_cleanly = True
        if job.multi_node and self.cluster is not None and job.broken is not None:
            error = job.broken
            for key in list(job.runs):
                self.cluster.abort(job, key, error if isinstance(error, CollectiveError)
                                   else CollectiveError(error.message, error.details))
            self.cluster.withdraw(job, error)
        level = logging.INFO if session.closed_cleanly else logging.WARNING
        log.log(level, "rank %d (pid %s) of %s %s", session.rank, session.pid,
                job.describe(), reason)
        if not job.members:
            del self.jobs[job.name]
            log.info("%s ended (no members left)", job.describe())

    # -- dispatch -----------------------------------------------------------

    def handle(self, session: ClientSession, message: Message) -> None:
        """Serve one validated request; every error becomes an error reply."""
        request_id = message["id"]
        try:
            if self.shutting_down:
                raise DaemonShuttingDownError("daemon shutting down")
            kind = message["kind"]
            if kind == "ping":
                session.reply(messages.ok_reply(request_id, **self._identity()))
            elif kind == "bye":
                session.closed_cleanly = True
                session.outstanding.discard(request_id)
            elif kind == "hello":
                self._hello(session, message)
            elif session.job_name is None:
                raise ProtocolError(f"{kind!r} before 'hello': introduce the client first")
            elif kind == "alloc":
                self._alloc(session, message)
            elif kind == "free":
                self._free(session, message)
            elif kind == "attach":
                self._attach(session, message)
            elif kind == "group_info":
                self._group_info(session, message)
            elif kind == "allreduce":
                self._allreduce(session, message)
            elif kind == "collective":
                self._collective(session, message)
        except GradsyncError as exc:
            session.reply_error(request_id, exc)
        except Exception as exc:  # a bug: say so to the client and the log, keep serving
            log.exception("handling %r from %s failed", message.get("kind"), session.describe())
            session.reply_error(request_id, GradsyncError(
                f"internal error in the daemon while handling {message.get('kind')!r}: "
                f"{type(exc).__name__}: {exc}"
            ))

    def _identity(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "collective_timeout_s": self.config.collective_timeout_s,
            "counters": self.state.counters(),
            "jobs": len(self.jobs),
            "shm_in_use": self.buffers.in_use,
            "shm_attached": self.buffers.attached,
            "segments": len(self.buffers),
            # Whether multi-node jobs can form here (gradsync launch --nnodes asks).
            "peers": len(self.cluster.transport.peers()) if self.cluster is not None else 0,
        }

    def _hello(self, session: ClientSession, message: Message) -> None:
        if session.job_name is not None:
            raise ProtocolError("second 'hello' on one connection")
        job_name, rank = message["job"], message["rank"]
        world, local_world = message["world_size"], message["local_world_size"]
        local_rank = message["local_rank"]
        if not job_name or len(job_name) > 128:
            raise InvalidArgumentError("job name must have 1 to 128 characters")
        if local_world > MAX_LOCAL_RANKS or world > MAX_WORLD_SIZE:
            raise InvalidArgumentError(
                f"at most {MAX_LOCAL_RANKS} ranks per daemon and {MAX_WORLD_SIZE} in a job, "
                f"got local_world_size={local_world}, world_size={world}"
            )
        if not (0 < local_world <= world):
            raise InvalidArgumentError(
                f"need 0 < local_world_size <= world_size, got {local_world} and {world}"
            )
        if not (0 <= rank < world) or not (0 <= local_rank < local_world):
            raise InvalidArgumentError(
                f"rank {rank} / local_rank {local_rank} out of range for "
                f"world_size {world} / local_world_size {local_world}"
            )
        if world != local_world and self.cluster is None:
            raise JobError(
                f"world_size {world} > local_world_size {local_world} needs peer daemons; "
                "this daemon has none (start it with --listen and --peers)"
            )
        job = self.jobs.get(job_name)
        if job is None:
            job = Job(job_name, world, local_world, self.loop)
        job.check_compatible(world, local_world)
        job.add_member(Member(rank, local_rank, message["pid"], session.session_id))
        self.jobs[job_name] = job
        session.job_name, session.rank, session.pid = job_name, rank, message["pid"]
        session.reply(messages.ok_reply(message["id"], **self._identity()))
        log.debug("rank %d (pid %d) joined %s", rank, message["pid"], job.describe())
        if job.multi_node and len(job.members) == job.local_world_size and self.cluster:
            self.cluster.local_complete(job)

    def _alloc(self, session: ClientSession, message: Message) -> None:
        nbytes = message["nbytes"]
        if nbytes <= 0:
            raise InvalidArgumentError(f"alloc needs a positive size, got {nbytes}")
        if nbytes > self.config.max_shm_bytes:
            raise ShmExhaustedError(
                f"allocating {nbytes} bytes for rank {session.rank} of job "
                f"{session.job_name!r} would exceed max_shm_bytes={self.config.max_shm_bytes}; "
                "raise --max-shm-bytes",
                {"requested": nbytes, "limit": self.config.max_shm_bytes},
            )
        slab = self.buffers.allocate(
            nbytes, f"rank {session.rank} of job {session.job_name!r}", message
        )
        session.segments.add(slab.segment_id)
        session.reply(
            messages.ok_reply(
                message["id"], segment=slab.segment_id, nbytes=slab.nbytes,
                **slab.backend.export(slab),
            )
        )

    def _attach(self, session: ClientSession, message: Message) -> None:
        """Map memory the client shares by a descriptor of its own: zero-copy from then on.

        Only for a client of the daemon's own user, checked by the kernel's
        credentials (SO_PEERCRED); others get an error and keep staging.
        """
        fd, nbytes = message["fd"], message["nbytes"]
        who = f"rank {session.rank} of job {session.job_name!r}"
        if session.peer_pid is None or session.peer_uid != os.getuid():
            raise InvalidArgumentError(
                f"attach from {who}: only processes of the daemon's own user may share "
                "their memory with it; their tensors are staged instead"
            )
        if fd < 0 or nbytes <= 0:
            raise InvalidArgumentError(f"attach from {who}: bad fd {fd} or size {nbytes}")
        try:
            slab = self.buffers.attach(f"/proc/{session.peer_pid}/fd/{fd}", nbytes, who)
        except (OSError, ValueError) as exc:
            raise InvalidArgumentError(
                f"attach from {who}: cannot map its descriptor {fd} ({nbytes} bytes): {exc}"
            ) from None
        session.segments.add(slab.segment_id)
        session.reply(messages.ok_reply(message["id"], segment=slab.segment_id))

    def _group_info(self, session: ClientSession, message: Message) -> None:
        """Which ranks of the caller's job are connected here (to size a sub-group)."""
        job = self.jobs[session.job_name or ""]
        session.reply(messages.ok_reply(
            message["id"], members=sorted(job.members),
            complete=len(job.members) == job.local_world_size,
        ))

    def _free(self, session: ClientSession, message: Message) -> None:
        segment_id = message["segment"]
        owner = next(
            (
                other for other in [session, *self.sessions.values()]
                if segment_id in other.segments
                and (other is session
                     or (other.peer_pid is not None and other.peer_pid == session.peer_pid))
            ),
            None,
        )
        if owner is None:
            raise InvalidArgumentError(f"segment {segment_id} does not belong to this client")
        owner.segments.discard(segment_id)
        self.buffers.release(segment_id)
        session.reply(messages.ok_reply(message["id"]))

    # -- allreduce ----------------------------------------------------------

    @staticmethod
    def _dtype(message: Message) -> np.dtype:
        dtype = DTYPES.get(message["dtype"])
        if dtype is None:
            raise InvalidArgumentError(
                f"unsupported dtype {messages.clip(message['dtype'])}; "
                f"supported: {', '.join(DTYPES)}"
            )
        return dtype

    @staticmethod
    def _op(name: str, dtype_name: str) -> ReduceOp:
        try:
            op = parse_reduce_op(name)
            check_op_for_dtype(op, dtype_name)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        return op

    def _timeout(self, message: Message) -> float:
        timeout_s = message.get("timeout_s") or self.config.collective_timeout_s
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise InvalidArgumentError(f"timeout_s must be positive and finite, got {timeout_s}")
        return float(timeout_s)

    def _allreduce(self, session: ClientSession, message: Message) -> None:
        job = self.jobs[session.job_name or ""]
        dtype_name, count = message["dtype"], message["count"]
        dtype = self._dtype(message)
        op = self._op(message["op"], dtype_name)
        algorithm = message.get("algorithm")
        if algorithm is not None and algorithm not in ALGORITHM_CHOICES:
            raise InvalidArgumentError(
                f"unknown algorithm {messages.clip(algorithm)}; expected one of "
                f"{', '.join(ALGORITHM_CHOICES)}"
            )
        view, slab = self._view(session, message["segment"], message["offset"], dtype, count)
        request_id = message["id"]
        submission = Submission(
            rank=session.rank or 0,
            fingerprint=Fingerprint("allreduce", dtype_name, count, op.value, algorithm),
            view=view,
            slabs=(slab,) if slab is not None else (),
            respond=lambda error, timing=None: session.complete(request_id, error, timing),
            timeout_s=self._timeout(message),
        )
        ready = self._submit(job, message["key"], submission)
        if ready is None:
            return
        if job.multi_node:
            self._start_multi_node(job, ready, op)
        else:
            self._start(job, ready, op)

    def _collective(self, session: ClientSession, message: Message) -> None:
        """broadcast, reduce, all_gather, reduce_scatter, gather, scatter, all_to_all."""
        job = self.jobs[session.job_name or ""]
        kind = message["collective"]
        if kind not in KINDS:
            raise InvalidArgumentError(
                f"unknown collective {messages.clip(kind)}; expected one of {', '.join(KINDS)}"
            )
        dtype_name = message["dtype"]
        dtype = self._dtype(message)
        op = self._op(message.get("op") or "", dtype_name) if kind in REDUCING else None
        root = message.get("root")
        if kind in ROOTED:
            if root is None or not 0 <= root < job.world_size:
                raise InvalidArgumentError(
                    f"{kind} needs a root rank in [0, {job.world_size}), got {root}"
                )
        else:
            root = None
        rank = session.rank or 0
        count, out_count = message["count"], message.get("out_count")
        chunk = chunk_count(kind, rank, root, count, out_count, job.world_size)
        view, slab = self._view(session, message["segment"], message["offset"], dtype, count)
        out, out_slab = None, None
        if out_count is not None:
            out, out_slab = self._view(session, message.get("out_segment"),
                                       message.get("out_offset", 0), dtype, out_count)
        request_id = message["id"]
        submission = Submission(
            rank=rank,
            fingerprint=Fingerprint(kind, dtype_name, chunk, op.value if op else None,
                                    None, root),
            view=view,
            respond=lambda error, timing=None: session.complete(request_id, error, timing),
            timeout_s=self._timeout(message),
            out=out,
            slabs=tuple(x for x in (slab, out_slab) if x is not None),
        )
        ready = self._submit(job, message["key"], submission)
        if ready is None:
            return
        self._spawn(ready, self._run_collective(job, ready, kind, op, root, chunk, dtype))

    async def _run_collective(
        self, job: Job, ready: PendingCollective, kind: str, op: ReduceOp | None,
        root: int | None, chunk: int, dtype: np.dtype,
    ) -> None:
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
            await self.run_call(
                lambda: run_local(kind, ins, outs, job.world_size, chunk, op, root), nbytes
            )

        async def across(arrays: list[Any]) -> None:
            assert self.runner is not None
            ins, outs = by_rank(arrays)

            def plan_for(formation: Formation, me: int) -> Plan:
                return make_plan(kind, me, formation.ranks_by_daemon, ins, outs,
                                 job.world_size, chunk, op, root, dtype)

            await self.runner.run_plan(
                job, ready, op or ReduceOp.SUM,
                first, plan_for,
            )

        try:
            slabs, backend = self._backend(ready)
            on_device = (
                backend is not self.buffers.host
                and len({slab.device for slab in slabs}) == 1
                and not (op is not None and first.dtype == "bfloat16")
            )
            if chunk == 0:
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

    def _submit(self, job: Job, key: Any, submission: Submission) -> PendingCollective | None:
        """Match a submission; the collective once all local ranks are in and agree."""
        ready = job.submit(key, submission)
        if ready is None:
            pending = job.pending[key]
            # The earliest deadline any submitter asked for wins.
            now = time.monotonic()
            deadline = now + submission.timeout_s
            if pending.timer is None or deadline < pending.first_seen + pending.deadline_s:
                if pending.timer is not None:
                    pending.timer.cancel()
                pending.deadline_s = deadline - pending.first_seen
                pending.timer = self.loop.call_later(
                    submission.timeout_s, self._expire, job.name, key
                )
            return None
        if ready.timer is not None:
            ready.timer.cancel()
        mismatch = job.mismatch(ready)
        if mismatch is not None:
            log.warning("%s", mismatch.message)
            self._fail(ready, mismatch)
            return None
        return ready

    def _may_use(self, session: ClientSession, segment_id: int) -> bool:
        """A client's own segments, or those of another connection of the same process
        (a sub-group's connection uses its parent's `empty()` buffers)."""
        if segment_id in session.segments:
            return True
        return any(
            segment_id in other.segments
            for other in self.sessions.values()
            if other.peer_pid is not None and other.peer_pid == session.peer_pid
        )

    def _view(
        self, session: ClientSession, segment_id: int | None, offset: int, dtype: np.dtype,
        count: int,
    ) -> tuple[Any, Slab | None]:
        """The submitter's slot as a typed array, after checking its bounds, and its slab."""
        if count < 0 or offset < 0:
            raise InvalidArgumentError(f"negative count {count} or offset {offset}")
        if count == 0:
            return None, None
        if segment_id is None or not self._may_use(session, segment_id):
            raise InvalidArgumentError(f"segment {segment_id} does not belong to this client")
        slab = self.buffers.get(segment_id)
        if slab is None:
            raise InvalidArgumentError(f"segment {segment_id} was freed")
        end = offset + count * dtype.itemsize
        if end > slab.nbytes or offset % dtype.itemsize:
            raise InvalidArgumentError(
                f"{count} x {dtype} at offset {offset} does not fit segment "
                f"{segment_id} of {slab.nbytes} bytes (or is misaligned)"
            )
        return slab.view(offset, count, dtype), slab

    def _backend(self, ready: PendingCollective) -> tuple[list[Slab], Backend]:
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

    def _start(self, job: Job, ready: PendingCollective, op: ReduceOp) -> None:
        """Run a matched collective: inline when small (or only queued, on a device),
        else cut into ranges on the thread pool."""
        order = sorted(ready.submissions)
        slots = [v for v in (ready.submissions[r].view for r in order) if v is not None]
        dtype = ready.submissions[order[0]].fingerprint.dtype
        try:
            slabs, backend = self._backend(ready)
        except MismatchError as exc:
            self._fail(ready, exc)
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

    def _spawn(self, ready: PendingCollective, work: Coroutine[Any, Any, None]) -> None:
        """Run a collective's coroutine as a task the shutdown can find."""
        self.in_flight[id(ready)] = ready
        task = self.loop.create_task(work)
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        task.add_done_callback(lambda _: self.in_flight.pop(id(ready), None))

    async def _reduce_on_pool(
        self, job: Job, ready: PendingCollective, op: ReduceOp, slots: list[np.ndarray],
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

    def _start_multi_node(self, job: Job, ready: PendingCollective, op: ReduceOp) -> None:
        self._spawn(ready, self._run_multi_node(job, ready, op))

    async def _run_multi_node(self, job: Job, ready: PendingCollective, op: ReduceOp) -> None:
        assert self.runner is not None
        runner = self.runner
        order = sorted(ready.submissions)
        first = ready.submissions[order[0]].fingerprint
        slots = [v for v in (ready.submissions[r].view for r in order) if v is not None]

        async def across(hosts: list[Any]) -> None:
            await runner.run(
                job, ready, op, hosts, first.count, first.algorithm, first,
            )

        try:
            slabs, backend = self._backend(ready)
            await self._staged(backend, slabs, slots, DTYPES[first.dtype], across)
        except Exception as exc:
            self._collective_failed(job, ready, exc)
            return
        self._succeed(job, ready)

    def _collective_failed(self, job: Job, ready: PendingCollective, exc: Exception) -> None:
        """Answer every member with the error; tell peer daemons of a multi-node job."""
        if isinstance(exc, GradsyncError):
            error = exc
        else:
            log.error("collective %r of %s failed", ready.key, job.describe(), exc_info=exc)
            error = GradsyncError(f"key {ready.key!r} of {job.describe()} failed in the "
                                  f"daemon: {exc}")
        if job.multi_node and self.cluster is not None:
            # Tell the other daemons, so their clients do not wait for the deadline.
            self.cluster.abort(job, ready.key, error if isinstance(error, CollectiveError)
                               else CollectiveError(error.message, error.details))
        else:
            job.remember_failure(ready.key, error)
        self._fail(ready, error)

    async def run_call(self, work: Callable[[], None], nbytes: int) -> None:
        """Run `work` inline when it touches little memory, else on the thread pool."""
        if nbytes <= self.config.inline_reduce_bytes:
            work()
        else:
            await self.loop.run_in_executor(self.executor, work)

    async def run_ranges(
        self, kernel: Any, slots: list[np.ndarray], count: int, *extra: Any
    ) -> None:
        """Run `kernel(slots, start, stop, *extra)` over [0, count): inline or on the pool."""
        if not slots or count == 0:
            return
        if slots[0].nbytes * len(slots) <= self.config.inline_reduce_bytes:
            kernel(slots, 0, count, *extra)
            return
        parts = split_ranges(count, slots[0].itemsize, self.config.threads)
        await asyncio.gather(
            *(
                self.loop.run_in_executor(self.executor, kernel, slots, begin, end, *extra)
                for begin, end in parts
            )
        )

    def _succeed(self, job: Job, ready: PendingCollective) -> None:
        if self.shutting_down:
            # The clients were already told; the result may not be complete everywhere.
            self._fail(ready, DaemonShuttingDownError("daemon shutting down"))
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
        for submission in ready.submissions.values():
            submission.respond(None, {
                "submitted": submission.submitted_at, "matched": ready.matched_at,
                "completed": now,
            })

    def _kernel_failed(self, job: Job, ready: PendingCollective, exc: Exception) -> None:
        log.error("reduction of key %r of %s failed", ready.key, job.describe(), exc_info=exc)
        self._fail(ready, GradsyncError(f"reduction failed in the daemon: {exc}"))

    def _expire(self, job_name: str, key: Any) -> None:
        job = self.jobs.get(job_name)
        expired = job.expire(key) if job else None
        if expired is not None:
            pending, error = expired
            log.warning("%s", error.message)
            self._fail(pending, error)

    def _fail(self, pending: PendingCollective, error: GradsyncError) -> None:
        if pending.timer is not None:
            pending.timer.cancel()
        self.state.requests.failed += 1
        self.stats.collective_failed(pending.job_name or None, error.code)
        for submission in pending.submissions.values():
            submission.respond(error)

    # -- stall reports ------------------------------------------------------

    def report_stalls(self) -> None:
        """Log, once per collective, one waiting longer than `stall_warn_s` and for whom."""
        now = time.monotonic()
        limit = self.config.stall_warn_s
        for job in list(self.jobs.values()):
            for pending in job.pending.values():
                if not pending.stall_reported and now - pending.first_seen > limit:
                    pending.stall_reported = True
                    missing = sorted(set(job.members) - set(pending.submissions))
                    absent = job.local_world_size - len(job.members)
                    log.warning(
                        "key %r of %s has waited %.0fs for ranks %s%s", pending.key,
                        job.describe(), now - pending.first_seen, missing,
                        f" ({absent} local ranks not connected)" if absent else "",
                    )
            for key, run in list(job.runs.items()):
                ready = next((p for p in self.in_flight.values() if p.key == key
                              and p.job_name == job.name), None)
                if (ready is not None and not ready.stall_reported
                        and now - ready.first_seen > limit and job.formation is not None):
                    ready.stall_reported = True
                    log.warning(
                        "key %r of %s has waited %.0fs at step %d/%d of %s for peer daemons %s",
                        key, job.describe(), now - ready.first_seen, run.step + 1, run.steps,
                        run.algorithm, [job.formation.daemons[i] for i in run.waiting_for()],
                    )

    # -- shutdown -----------------------------------------------------------

    def shut_down(self) -> None:
        """Fail everything in flight, unlink every segment."""
        self.shutting_down = True
        error = DaemonShuttingDownError("daemon shutting down")
        for job in list(self.jobs.values()):
            pendings = list(job.pending.values())
            job.pending.clear()
            for pending in pendings:
                self._fail(pending, error)
        for pending in list(self.in_flight.values()):
            self._fail(pending, error)
        for session in list(self.sessions.values()):
            session.close()
        self.buffers.release_all()
        # Let running reductions finish: an empty() buffer is never left half reduced.
        self.executor.shutdown(wait=True, cancel_futures=False)
