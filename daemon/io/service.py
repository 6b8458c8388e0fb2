"""The daemon's request handlers: sessions, jobs, buffers, matching.

`GradsyncService` checks each decoded request (`session.py` feeds them in),
keeps the sessions' jobs and segments, and matches what the local ranks
submit, with each collective's deadline; a matched collective runs in
`run/runs.py`.  `server.py` runs the lifecycle.  Everything here runs on the
event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
from collections.abc import Coroutine, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from gradsync.daemon.backends import Buffers, Slab
from gradsync.daemon.checkpoint_manifest import ManifestFile
from gradsync.daemon.checkpoint_replicas import ReplicaStore
from gradsync.daemon.checkpoints import RESERVE_WAIT_S, CheckpointStore
from gradsync.daemon.core.cluster import ClusterJobs
from gradsync.daemon.core.collectives import MatchedCollective, chunk_count
from gradsync.daemon.core.deadlines import Deadlines
from gradsync.daemon.core.matching import CollectiveCall, Job, Member, Submission
from gradsync.daemon.io.loop_clock import LoopClock
from gradsync.daemon.run.fast_path import FastPages
from gradsync.daemon.run.multi_node import CrossDaemonRunner
from gradsync.daemon.run.offload import Offload
from gradsync.daemon.run.runs import CollectiveRuns
from gradsync.daemon.state import DaemonState
from gradsync.daemon.stats import StatsRecorder
from gradsync.daemon.trace import TraceRecorder
from gradsync.protocol import messages
from gradsync.protocol.codec import Message
from gradsync.protocol.dtypes import DTYPES
from gradsync.protocol.endpoint import parse_ipc_endpoint
from gradsync.protocol.errors import (
    CheckpointError,
    DaemonShuttingDownError,
    GradsyncError,
    InvalidArgumentError,
    JobError,
    ProtocolError,
    ShmExhaustedError,
)
from gradsync.protocol.peer import Fingerprint
from gradsync.protocol.requests import (
    ROOTED,
    Alloc,
    Attach,
    CheckpointCommit,
    CheckpointList,
    CheckpointOpen,
    CheckpointPut,
    Collective,
    Free,
    GroupInfo,
    Hello,
    parse_checkpoint_session_job,
    parse_request,
)
from gradsync.protocol.version import PROTOCOL_VERSION, __version__

if TYPE_CHECKING:
    from gradsync.daemon.io.checkpoint_peers import CheckpointPeers
    from gradsync.daemon.io.session import ClientSession

log = logging.getLogger("gradsync.daemon")



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
        #: Where the checkpoints' spares get their pages and pruned ones give them
        #: back: the kernel's zeroing and freeing, off the event loop.
        self.checkpoint_pages = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="gradsync-ckpt-pages")
        #: The jobs' checkpoints: segments owned by the daemon, not by a session.
        self.checkpoints = CheckpointStore(
            self.buffers, config.checkpoints_kept,
            manifest=ManifestFile(parse_ipc_endpoint(config.socket)),
            background=self.checkpoint_pages)
        #: Peer daemons' checkpoint parts held here (and parts fetched for an open).
        self.replicas = ReplicaStore(self.buffers, config.checkpoints_kept)
        #: Checkpoints across daemons (commit, replicas, pulls), when this daemon has peers.
        self.checkpoint_peers: CheckpointPeers | None = None
        self._checkpoint_tasks: set[asyncio.Task[None]] = set()
        self.sessions = state.sessions
        #: Sessions that said hello to a job: the idle exit (`--exit-when-idle-s`)
        #: sees a job that came and went between two of its polls.
        self.members_joined = 0
        #: The multi-node side, when this daemon has peers (`join_cluster`).
        self.cluster: ClusterJobs | None = None
        self.stats = StatsRecorder()
        self.trace = TraceRecorder()
        #: Reduction work inline or on the pool (the inter-daemon phase uses it too).
        self.offload = Offload(loop, self.executor, config.inline_reduce_bytes)
        #: Where matched collectives run and are answered.
        self.runs = CollectiveRuns(state, loop, self.buffers, self.executor, self.stats,
                                   self.trace, self.offload)
        #: The single-node jobs' shared-memory fast path.
        self.fast = FastPages(self.buffers, config.fast_path_bytes, loop)
        state.fast_counters = self.fast.counters
        #: Time as the core sees it: the event loop's clock and timers.
        self.clock = LoopClock(loop)
        state.deadline_timers = lambda: self.clock.armed
        #: Every waiting key's deadline (the core decides; the loop only calls back).
        self.deadlines = Deadlines(self.jobs, self.clock, self.fast.fast_ranks, self.runs.fail)

    def join_cluster(self, cluster: ClusterJobs, runner: CrossDaemonRunner) -> None:
        """Serve multi-node jobs too: membership through `cluster`, the
        inter-daemon phase through `runner`."""
        self.cluster = cluster
        self.runs.join_cluster(cluster, runner)

    # -- sessions -----------------------------------------------------------

    def session_opened(self, session: ClientSession) -> None:
        self.sessions[session.session_id] = session

    def session_closed(self, session: ClientSession) -> None:
        """A client went away: free its segments, break its job for the others."""
        self.sessions.pop(session.session_id, None)
        for segment_id in session.segments:
            self.buffers.release(segment_id)
        session.segments.clear()
        scope = parse_checkpoint_session_job(session.job_name or "")
        if scope is not None:  # its checkpoints stay; the spares for its next save go
            self.checkpoints.release_spares(*scope)
        elif session.job_name and session.rank is not None:
            self.checkpoints.release_spares(session.job_name, session.rank)
        job = self.jobs.get(session.job_name) if session.job_name else None
        if job is None or session.rank is None:
            return
        reason = "disconnected" if session.closed_cleanly else "died (connection lost)"
        was_broken = job.broken is not None
        failed = job.remove_member(session.rank, reason)
        if job.broken is not None:
            self.fast.break_job(job.name)
        for pending in failed:
            self.runs.fail(pending, job.broken or JobError(f"{job.describe()} broke"))
        if self.cluster is not None and job.multi_node:
            if not was_broken and session.closed_cleanly and not failed:
                self.cluster.ended_cleanly(job)
            if job.broken is not None:
                self.cluster.broke_here(job, job.broken)
        level = logging.INFO if session.closed_cleanly else logging.WARNING
        log.log(level, "rank %d (pid %s) of %s %s", session.rank, session.pid,
                job.describe(), reason)
        if not job.members:
            del self.jobs[job.name]
            self.stats.fast_path_done(job.name, *self.fast.release(job.name))
            log.info("%s ended (no members left)", job.describe())

    # -- dispatch -----------------------------------------------------------

    def handle(self, session: ClientSession, message: Message) -> None:
        """Serve one validated request; every error becomes an error reply."""
        request_id = message["id"]
        try:
            if self.state.shutting_down:
                raise DaemonShuttingDownError("daemon shutting down")
            kind = message["kind"]
            if kind == "ping":
                session.reply(messages.ok_reply(request_id, **self._identity()))
            elif kind == "bye":
                session.closed_cleanly = True
                session.outstanding.discard(request_id)
            elif kind == "hello":
                self._hello(session, Hello.from_wire(message), request_id)
            elif session.job_name is None:
                raise ProtocolError(f"{kind!r} before 'hello': introduce the client first")
            else:
                if kind == Collective.kind:
                    # Ranks waiting for this key on the fast page follow it to the
                    # socket, whatever becomes of this request.
                    self.fast.note_socket(session.job_name, session.rank or 0, message["key"])
                request = parse_request(message)
                if isinstance(request, Collective):
                    self._collective(session, request, request_id)
                elif isinstance(request, Alloc):
                    self._alloc(session, request, request_id)
                elif isinstance(request, Free):
                    self._free(session, request, request_id)
                elif isinstance(request, Attach):
                    self._attach(session, request, request_id)
                elif isinstance(request, GroupInfo):
                    self._group_info(session, request_id)
                elif isinstance(request, CheckpointPut | CheckpointCommit | CheckpointList
                                | CheckpointOpen):
                    self._checkpoint(session, request, request_id)
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
            "peers": len(self.cluster.transport.peers) if self.cluster is not None else 0,
        }

    def _hello(self, session: ClientSession, hello: Hello, request_id: int) -> None:
        if session.job_name is not None:
            raise ProtocolError("second 'hello' on one connection")
        job_name, rank = hello.job, hello.rank
        world, local_world = hello.world_size, hello.local_world_size
        if world != local_world and self.cluster is None:
            raise JobError(
                f"world_size {world} > local_world_size {local_world} needs peer daemons; "
                "this daemon has none (start it with --listen and --peers)"
            )
        job = self.jobs.get(job_name)
        forming = job is None
        if job is None:
            job = Job(job_name, world, local_world, self.clock.now)
        job.check_compatible(world, local_world)
        job.add_member(Member(rank, hello.local_rank, hello.pid, session.session_id))
        self.jobs[job_name] = job
        if forming and not job.multi_node:
            self._create_fast_page(job)
        session.job_name, session.rank, session.pid = job_name, rank, hello.pid
        self.members_joined += 1
        fast_page = self.fast.describe(job_name)
        extra = {} if fast_page is None else {"fast_page": fast_page}
        session.reply(messages.ok_reply(request_id, **self._identity(), **extra))
        log.debug("rank %d (pid %d) joined %s", rank, hello.pid, job.describe())
        if job.multi_node and len(job.members) == job.local_world_size and self.cluster:
            self.cluster.local_complete(job)

    def _create_fast_page(self, job: Job) -> None:
        """The job's fast page; without one (no room) the job simply runs on sockets."""
        try:
            self.fast.create(job.name, job.local_world_size, job.describe())
        except (ShmExhaustedError, OSError) as exc:
            log.warning("%s runs without the shared-memory fast path: %s", job.describe(), exc)

    def _alloc(self, session: ClientSession, alloc: Alloc, request_id: int) -> None:
        nbytes = alloc.nbytes
        if nbytes > self.config.max_shm_bytes:
            raise ShmExhaustedError(
                f"allocating {nbytes} bytes for rank {session.rank} of job "
                f"{session.job_name!r} would exceed max_shm_bytes={self.config.max_shm_bytes}; "
                "raise --max-shm-bytes",
                {"requested": nbytes, "limit": self.config.max_shm_bytes},
            )
        slab = self.buffers.allocate(
            nbytes, f"rank {session.rank} of job {session.job_name!r}",
            {"device": alloc.device, "event": alloc.event},
        )
        session.segments.add(slab.segment_id)
        session.reply(
            messages.ok_reply(
                request_id, segment=slab.segment_id, nbytes=slab.nbytes,
                **slab.backend.export(slab),
            )
        )

    def _attach(self, session: ClientSession, attach: Attach, request_id: int) -> None:
        """Map memory the client shares by a descriptor of its own: zero-copy from then on.

        Only for a client of the daemon's own user, checked by the kernel's
        credentials (SO_PEERCRED); others get an error and keep staging.
        """
        fd, nbytes = attach.fd, attach.nbytes
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
        session.reply(messages.ok_reply(request_id, segment=slab.segment_id))

    def _group_info(self, session: ClientSession, request_id: int) -> None:
        """Which ranks of the caller's job are connected here (to size a sub-group)."""
        job = self.jobs[session.job_name or ""]
        session.reply(messages.ok_reply(
            request_id, members=sorted(job.members),
            complete=len(job.members) == job.local_world_size,
        ))

    def _free(self, session: ClientSession, free: Free, request_id: int) -> None:
        segment_id = free.segment
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
        session.reply(messages.ok_reply(request_id))

    # -- checkpoints ----------------------------------------------------------

    def _checkpoint(
        self, session: ClientSession,
        request: CheckpointPut | CheckpointCommit | CheckpointList | CheckpointOpen,
        request_id: int,
    ) -> None:
        """Checkpoint requests (daemon/checkpoints.py); a job's own ranks alone may
        use its checkpoints."""
        rank = _checkpoint_rank(session, request.job)
        if rank is None:
            raise CheckpointError(
                f"rank {session.rank} of job {session.job_name!r} may not use the checkpoints "
                f"of job {request.job!r}: only that job's ranks may",
                {"job": request.job, "caller_job": session.job_name})
        store = self.checkpoints
        if isinstance(request, CheckpointPut):
            pending = store.reservation_for(request.job, rank, request.item, request.nbytes)
            if pending is None:
                session.reply(self._put(request, rank, request_id))
            else:  # its spare's pages are still being reserved: wait off the loop
                self._reply_later(session, request_id,
                                  self._put_once_reserved(pending, request, rank, request_id))
        elif isinstance(request, CheckpointCommit):
            self._commit(session, request, request_id)
        elif isinstance(request, CheckpointList):
            session.reply(messages.ok_reply(request_id, checkpoints=[
                store.describe(checkpoint) for checkpoint in store.complete(request.job)]))
        elif self.checkpoint_peers is None:
            checkpoint = store.open(request.job, request.step)
            session.reply(_opened(request_id, checkpoint.step, checkpoint.parts))
        else:
            self._reply_later(session, request_id, self._open_across(
                self.checkpoint_peers, request.job, request.step, request_id))

    def _commit(self, session: ClientSession, request: CheckpointCommit,
                request_id: int) -> None:
        """Commit a step: here, or across the daemons where parts are on peers."""
        store, job, step = self.checkpoints, request.job, request.step
        local = store.jobs.get(job, {}).get(step)
        held_here = set(local.parts) if local is not None else set()
        if self.checkpoint_peers is not None and not set(request.parts) <= held_here:
            self._reply_later(session, request_id, self._commit_across(
                self.checkpoint_peers, request, request_id))
            return
        checkpoint = store.commit(job, step, request.parts, settle=False)
        log.debug("%s complete: %d bytes in %d parts", checkpoint.describe(),
                  checkpoint.nbytes, len(checkpoint.parts))
        if self.checkpoint_peers is not None:
            self.checkpoint_peers.replicate(checkpoint)
        session.reply(messages.ok_reply(request_id, **store.describe(checkpoint)))
        # Freeing the pruned checkpoint and making spares: once the saver goes on.
        self.loop.call_soon(store.settle)

    async def _commit_across(self, peers: CheckpointPeers, request: CheckpointCommit,
                             request_id: int) -> Message:
        checkpoint = await peers.commit(request.job, request.step, request.parts)
        log.debug("%s complete across daemons: %d bytes here", checkpoint.describe(),
                  checkpoint.nbytes)
        return messages.ok_reply(request_id, **self.checkpoints.describe(checkpoint))

    async def _open_across(self, peers: CheckpointPeers, job: str, step: int | None,
                           request_id: int) -> Message:
        return _opened(request_id, *await peers.open(job, step))

    def _put(self, request: CheckpointPut, rank: int, request_id: int) -> Message:
        """The segment for the part, and the spare its next save goes into (set aside
        by an earlier commit's `settle`): the client maps that one ahead of time.
        Never waits for pages (`_put_once_reserved` did, where there were any)."""
        store = self.checkpoints
        slab = store.put(request.job, request.step, rank, request.item, request.nbytes,
                         wait_s=0.0)
        spare = store.spare_for(request.job, rank, request.item)
        return messages.ok_reply(
            request_id, nbytes=slab.nbytes, **slab.backend.export(slab),
            **({} if spare is None else {
                "spare": [spare.backend.export(spare)["name"], spare.nbytes]}))

    async def _put_once_reserved(self, pending: concurrent.futures.Future[None],
                                 request: CheckpointPut, rank: int, request_id: int) -> Message:
        """`_put`, once the spare it gets has its pages (or the wait is over: then the
        put takes fresh pages instead)."""
        # asyncio.wait, not wait_for: at the deadline the reservation must go on (a
        # cancel would reach the thread's queue); how it went, the put sees.
        waiting = asyncio.wrap_future(pending)
        await asyncio.wait({waiting}, timeout=RESERVE_WAIT_S)
        waiting.add_done_callback(_seen)
        return self._put(request, rank, request_id)

    def _reply_later(self, session: ClientSession, request_id: int,
                     answer: Coroutine[Any, Any, Message]) -> None:
        """Reply with what `answer` gives once it is done (an error reply if it fails)."""
        async def reply() -> None:
            try:
                session.reply(await answer)
            except GradsyncError as exc:
                session.reply_error(request_id, exc)
            except Exception as exc:  # a bug: say so, keep serving
                log.exception("a checkpoint request of %s failed", session.describe())
                session.reply_error(request_id, GradsyncError(
                    f"internal error in the daemon: {type(exc).__name__}: {exc}"))
        task = self.loop.create_task(reply(), name="checkpoint request")
        self._checkpoint_tasks.add(task)
        task.add_done_callback(self._checkpoint_tasks.discard)

    # -- collectives ----------------------------------------------------------

    def _collective(self, session: ClientSession, request: Collective, request_id: int) -> None:
        """Every collective, its values checked by `Collective.from_wire`; here what
        needs the job: the root's range and the buffers' sizes and segments."""
        job = self.jobs[session.job_name or ""]
        kind, op, root = request.collective, request.op, request.root
        if kind in ROOTED and (root is None or not 0 <= root < job.world_size):
            raise InvalidArgumentError(
                f"{kind} needs a root rank in [0, {job.world_size}), got {root}"
            )
        rank = session.rank or 0
        dtype = DTYPES[request.dtype]
        chunk = chunk_count(kind, rank, root, request.count, request.out_count, job.world_size)
        view, slab = self._view(session, request.segment, request.offset, dtype, request.count)
        out, out_slab = None, None
        if request.out_count is not None:
            out, out_slab = self._view(session, request.out_segment, request.out_offset, dtype,
                                       request.out_count)
        submission = Submission(
            rank=rank,
            fingerprint=Fingerprint(kind, request.dtype, chunk, op.value if op else None,
                                    request.algorithm, root, request.compression),
            view=view,
            respond=lambda error, timing=None: session.complete(request_id, error, timing),
            timeout_s=request.timeout_s or self.config.collective_timeout_s,
            out=out,
            slabs=tuple(x for x in (slab, out_slab) if x is not None),
        )
        ready = self._submit(job, request.key, submission, request.waited_s)
        if ready is None:
            return
        self.runs.start(job, ready, MatchedCollective(
            kind, dtype, chunk, op, root, request.algorithm, request.compression,
            request.error_feedback))

    def _submit(
        self, job: Job, key: Any, submission: Submission, waited_s: float = 0.0
    ) -> CollectiveCall | None:
        """Match a submission; the collective once all local ranks are in and agree.

        `waited_s`: how long the submitter already waited for this key on the
        fast path (its deadline counts from then, see core/deadlines.py).
        """
        ready = job.submit(key, submission)
        if ready is None:
            self.deadlines.waiting(job, job.pending[key], submission, waited_s)
            return None
        self.deadlines.settled(ready)
        mismatch = job.mismatch(ready)
        if mismatch is not None:
            log.warning("%s", mismatch.message)
            self.runs.fail(ready, mismatch)
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

    def report_stalls(self) -> None:
        """Log, once per collective, one waiting longer than `stall_warn_s` and for whom
        (on the jobs' fast pages, on the socket path, and between daemons)."""
        limit = self.config.stall_warn_s
        for job in list(self.jobs.values()):
            self.fast.report_stalls(job.name, limit, job.describe(),
                                    job.local_world_size - len(job.members))
        self.deadlines.report_stalls(limit, self.runs.in_flight.values())

    def shut_down(self) -> None:
        """Fail everything in flight, unlink every segment."""
        self.state.shutting_down = True
        self.fast.close_all()  # ranks waiting on a fast page come to the socket
        error = DaemonShuttingDownError("daemon shutting down")
        for job in list(self.jobs.values()):
            pendings = list(job.pending.values())
            job.pending.clear()
            for pending in pendings:
                self.runs.fail(pending, error)
        self.runs.fail_in_flight(error)
        for session in list(self.sessions.values()):
            session.close()
        for task in self._checkpoint_tasks:
            task.cancel()
        self.checkpoints.close(keep=self.config.checkpoints_survive_exit)
        self.checkpoint_pages.shutdown(wait=True)  # their pages back before the exit
        self.replicas.release_all()
        self.buffers.release_all()

    async def drain(self, timeout_s: float) -> bool:
        """Wait (off the event loop) up to `timeout_s` for reductions already on the
        thread pool; True if they all finished (queued ones run too: a buffer is
        never left half reduced)."""
        shutdown = functools.partial(self.executor.shutdown, wait=True, cancel_futures=False)
        try:
            await asyncio.wait_for(asyncio.to_thread(shutdown), timeout_s)
        except TimeoutError:
            return False
        return True


def _seen(future: asyncio.Future[None]) -> None:
    """Mark a reservation's failure as seen: the put that waited for it has dealt with it."""
    if not future.cancelled():
        future.exception()


def _opened(request_id: int, step: int, parts: Mapping[tuple[int, str], Slab]) -> Message:
    """The reply to `ckpt_open`: the step, and each part's segment."""
    return messages.ok_reply(request_id, step=step, parts=[
        [owner, item, slab.backend.export(slab)["name"], slab.nbytes]
        for (owner, item), slab in sorted(parts.items())])


def _checkpoint_rank(session: ClientSession, job: str) -> int | None:
    """The rank whose checkpoints of `job` this session stores: its own in job `job`,
    R in `checkpoint:job#R`; None for a session of any other job."""
    if session.job_name == job:
        return session.rank or 0
    scope = parse_checkpoint_session_job(session.job_name or "")
    return scope[1] if scope is not None and scope[0] == job else None
