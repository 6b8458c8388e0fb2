"""Running a collective across daemons: the inter-daemon phase of a job.

The request handlers hand a collective here once all local ranks have
submitted it.  The runner reduces the local slots into the first one, waits
until the job is formed across daemons (core/cluster.py), agrees `auto`'s
link costs for the key's epoch (core/cost_epochs.py), settles `auto`
compression's format on them (core/compression_policy.py), runs the plan's
schedule over the peer links (executor.py), then writes the result back to
every local slot.  Failures go through the core (`ClusterJobs.abort`), which
tells the other members.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from gradsync.daemon.algorithms.calibration import CostMeter
from gradsync.daemon.backends.wire_codec import CODECS, WireCodec
from gradsync.daemon.core.auto import epoch_of, epoch_to_offer, wants_auto
from gradsync.daemon.core.cluster import ClusterJobs
from gradsync.daemon.core.collectives import (
    MatchedCollective,
    Plan,
    Views,
    chooses_algorithm,
    make_plan,
)
from gradsync.daemon.core.compression_policy import choose_format
from gradsync.daemon.core.interfaces import PeerTransport
from gradsync.daemon.core.membership import Formation, ranks_not_here
from gradsync.daemon.run.codec_rates import measure_codec_rates, peers_on_this_host
from gradsync.daemon.run.executor import ScheduleRun, SendFailed, raw_nbytes
from gradsync.daemon.run.outcomes import settled
from gradsync.daemon.run.receives import ChunkPool
from gradsync.daemon.run.residuals import Residuals, fold_in
from gradsync.daemon.stats import StatsRecorder
from gradsync.daemon.trace import TraceRecorder
from gradsync.protocol.compression import allowed_formats, is_auto
from gradsync.protocol.dtypes import ReduceOp
from gradsync.protocol.errors import CollectiveTimeoutError, InvalidArgumentError, PeerLostError
from gradsync.protocol.peer import Slice

if TYPE_CHECKING:
    from gradsync.daemon.config import DaemonConfig
    from gradsync.daemon.core.matching import CollectiveCall, Job

log = logging.getLogger("gradsync.daemon.cluster")

#: The most the event loop waits, once, for the codec rates to be measured.
CODEC_MEASURE_S = 1.0


class CrossDaemonRunner:
    """Runs the collectives of multi-node jobs over the peer links."""

    def __init__(
        self,
        cluster: ClusterJobs,
        loop: asyncio.AbstractEventLoop,
        offload: Callable[[Callable[[], None], int], Awaitable[None]],
        stats: StatsRecorder | None = None,
        trace: TraceRecorder | None = None,
        alive: Callable[[int], bool] = lambda segment: True,
    ) -> None:
        self.cluster = cluster
        self.config: DaemonConfig = cluster.config
        self.transport: PeerTransport = cluster.transport
        self.loop = loop
        self.offload = offload
        self.stats = stats
        self.trace = trace
        #: Timings of this daemon's allreduces, from which it fits `auto`'s figures.
        self.meter = CostMeter()
        #: Reduce chunks that placed slices of every run take turns with.
        self.chunks = ChunkPool()
        #: Error feedback's residuals, by buffer; `alive(segment)`: not yet freed.
        self.residuals = Residuals(alive)
        #: Compressed runs' encodes and decodes on `codec_lanes` threads
        #: (run/codec_lane.py); started when first needed.
        self._codec_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._codec_pool_lock = threading.Lock()
        #: What this daemon announces for `auto` compression (`codec_facts`).
        self._codec_facts: tuple[tuple[tuple[str, float], ...], bool] | None = None
        #: Set once, by the measuring thread (`codec_facts`).
        self._codec_rates: dict[str, float] | None = None
        self._codec_rates_told = False
        # Measured now, off the loop, so that the first job's announcement has them.
        threading.Thread(target=self._measure_codecs, name="gradsync-codec-rates",
                         daemon=True).start()

    async def run_plan(
        self,
        job: Job,
        ready: CollectiveCall,
        collective: MatchedCollective,
        ins: Views,
        outs: Views,
    ) -> None:
        """Any collective across daemons, phase by phase: wait for the job to form,
        agree link costs and choose the algorithm, plan, run the local phase, drive
        the schedule, write back.  Raises the error the clients should get.

        An allreduce's plan runs the algorithm asked for or `auto`'s pick,
        which sees the link costs the members agreed for this key's epoch.
        """
        deadline = ready.first_seen + ready.deadline_s
        formation = await self._formation(job, ready, deadline)
        me = formation.index_of(self.transport.endpoint)
        formation, algorithm = await self._algorithm(job, ready, collective, formation, deadline)
        collective = self._compression(job, ready, collective, formation)
        plan = make_plan(collective, formation, me, ins, outs, job.world_size, algorithm)
        codec, residual = self._codec(job, ready, collective, plan)
        await self._local_phase(job, ready, plan, residual)
        run = self._schedule_run(job, ready, collective, formation, me, plan, codec, residual)
        await self._drive_run(job, ready, collective, formation, me, plan, run, deadline)
        phase_start = time.monotonic()
        if plan.after is not None:
            await self.offload(plan.after, plan.work.nbytes)
        self._trace(job, "write-back", phase_start, ready.key)

    async def _formation(self, job: Job, ready: CollectiveCall, deadline: float) -> Formation:
        """The job's formation across daemons, once every rank has joined somewhere."""
        formation = job.across.formation
        if formation is not None:
            return formation
        try:
            return await settled(job.across.formed, deadline - time.monotonic())
        except TimeoutError:
            missing = ranks_not_here(job.members, job.world_size)
            raise CollectiveTimeoutError(
                f"key {ready.key!r} of {job.describe()} timed out after "
                f"{ready.deadline_s:g}s: the job never formed: of ranks {missing} (the ones "
                "not on this daemon) some did not join on any peer daemon, or the job's "
                f"coordinator ({self.cluster.forming.coordinators.get(job.name, 'none')}) "
                "could not reach them all",
                {"job": job.name, "key": ready.key, "missing": missing},
            ) from None

    async def _algorithm(
        self, job: Job, ready: CollectiveCall, collective: MatchedCollective,
        formation: Formation, deadline: float,
    ) -> tuple[Formation, str | None]:
        """Offer this daemon's link costs; for a kind whose algorithm is chosen per call,
        the one asked for or `auto`'s pick (on the costs the members agreed, which
        `auto` compression weighs too)."""
        self._offer_costs(job, formation, epoch_to_offer(ready.key))
        chooses = chooses_algorithm(collective.kind)
        if ((chooses and wants_auto(collective.algorithm, self.config.algorithm))
                or is_auto(collective.compression)):
            formation = await self._with_agreed_costs(job, formation, ready, deadline)
        if not chooses:
            return formation, None
        choice = job.across.auto.choose(
            collective.algorithm, self.config.algorithm, formation,
            collective.chunk * collective.dtype.itemsize, ready.key, self.stats, job.name)
        return formation, choice.algorithm

    def _compression(
        self, job: Job, ready: CollectiveCall, collective: MatchedCollective,
        formation: Formation,
    ) -> MatchedCollective:
        """The collective with `auto` compression settled: the format (or none) every
        member picks alike from the agreed figures, recorded in the statistics."""
        asked = collective.compression
        if asked is None or not is_auto(asked):
            return collective
        choice = choose_format(
            allowed_formats(asked), collective.dtype.name, collective.dtype.itemsize,
            1.0 / max(formation.beta_s_per_byte, 1e-15), dict(formation.codec_Bps),
            formation.loopback, formation.links_measured)
        if self.stats is not None:
            self.stats.compression_chosen(job.name, asked, choice, epoch_of(ready.key))
        return dataclasses.replace(collective, compression=choice.format)

    def codec_facts(self) -> tuple[tuple[tuple[str, float], ...], bool]:
        """This daemon's codec rates with its lanes and whether its peers are all on
        this host: what it announces with every job.

        The rates are measured once, on a thread of their own started with the
        runner (the codec lanes busy for some 50 ms, cut short at
        `CODEC_MEASURE_S`): the event loop never waits for them (a loop that
        stalls could get this daemon suspected by its peers).  A job announced
        before they are in gets no rates, so `auto` compresses nothing for it.
        """
        if self._codec_facts is None:
            self._codec_facts = ((), peers_on_this_host(self.transport.peers))
        if self._codec_rates is not None and not self._codec_rates_told:
            self._codec_rates_told = True
            self._codec_facts = (tuple(sorted(self._codec_rates.items())),
                                 self._codec_facts[1])
            if self.stats is not None:
                self.stats.codec_measured(self.config.codec_lanes, self._codec_rates,
                                          self._codec_facts[1])
        return self._codec_facts

    def _measure_codecs(self) -> None:
        try:
            self._codec_rates = measure_codec_rates(
                self._codec_thread(), self.config.codec_lanes,
                self.config.pipeline_slice_bytes, timeout_s=CODEC_MEASURE_S)
        except RuntimeError as exc:  # the pool shut down: the daemon is stopping
            log.debug("codec rates not measured: %s", exc)

    def _codec(
        self, job: Job, ready: CollectiveCall, collective: MatchedCollective, plan: Plan
    ) -> tuple[WireCodec | None, np.ndarray | None]:
        """The wire codec of a compressed collective and its error-feedback residual."""
        codec = CODECS[collective.compression] if collective.compression else None
        if codec is None:
            return None, None
        if not isinstance(plan.work, np.ndarray):
            raise InvalidArgumentError(
                f"key {ready.key!r} of {job.describe()}: compression={codec.name!r} is for "
                "host buffers; device buffers are reduced exactly")
        return codec, self._residual(job, ready, collective)

    async def _local_phase(
        self, job: Job, ready: CollectiveCall, plan: Plan, residual: np.ndarray | None
    ) -> None:
        """Fill the work buffer from the local ranks (and fold the residual in)."""
        phase_start = time.monotonic()
        if plan.before is not None:
            await self.offload(plan.before, plan.work.nbytes)
        if residual is not None:
            work = plan.work
            await self.offload(lambda: fold_in(work, residual), work.nbytes)
        self._trace(job, "local phase", phase_start, ready.key)

    def _schedule_run(
        self, job: Job, ready: CollectiveCall, collective: MatchedCollective,
        formation: Formation, me: int, plan: Plan, codec: WireCodec | None,
        residual: np.ndarray | None,
    ) -> ScheduleRun:
        """The executor of `plan`'s schedule, sending through the peer links."""
        fingerprint = ready.submissions[min(ready.submissions)].fingerprint
        # What runs: the algorithm, and the format `auto` settled on (a member that
        # chose otherwise sends slices whose fingerprint does not match: refused).
        fp = dataclasses.replace(fingerprint, algorithm=plan.algorithm,
                                 compression=collective.compression)
        # Each slice's header: this, with the executor's step, transfer and offset.
        base = Slice(job.name, formation.generation, ready.key, fp, 0, 0, 0).to_wire()

        # `send` must not refer to `run`: that cycle (run -> send -> run) kept the run's
        # views of the client's segment alive until a garbage collection, and with them
        # the freed segment's /dev/shm space (tests/test_freed_space.py).
        itemsize = plan.work.dtype.itemsize

        def send(peer: int, header: dict[str, Any], payload: Any, zero_copy: bool) -> Any:
            return self.cluster.send(job, formation.daemons[peer], {**base, **header}, payload,
                                     zero_copy, raw_nbytes(codec, itemsize, len(payload)))

        return ScheduleRun(
            plan.schedule, plan.work, collective.op or ReduceOp.SUM, send,
            self.config.pipeline_slice_bytes, self.loop,
            fingerprint=fp, algorithm=plan.algorithm,
            agree_with=[
                index for index in range(len(formation.daemons)) if index != me
            ] if plan.agree_first else [],
            chunks=self.chunks,
            codec=codec, residual=residual,
            codec_pool=self._codec_thread() if codec is not None else None,
        )

    async def _drive_run(
        self, job: Job, ready: CollectiveCall, collective: MatchedCollective,
        formation: Formation, me: int, plan: Plan, run: ScheduleRun, deadline: float,
    ) -> None:
        """Drive the schedule to its end, then meter and trace it."""
        self.cluster.run_started(job, ready.key, run)
        data_phase = time.monotonic()
        try:
            await self._with_job_context(job, ready.key, run, self._drive(
                job, ready, run, formation, plan.algorithm, deadline))
        finally:
            self.cluster.run_ended(job, ready.key)
            await run.settle()  # no encode or decode touches the buffer past here
            run.release()
        # A compressed run's time is not the link's: it would bend `auto`'s figures.
        if plan.timed is not None and len(formation.daemons) > 1 and run.codec is None:
            self.meter.record(len(formation.daemons), plan.timed,
                              time.monotonic() - data_phase, plan.modelled)
        if self.trace is not None and self.trace.active:
            self._trace_run(job, ready, collective, formation, me, run, data_phase)

    def _trace_run(
        self, job: Job, ready: CollectiveCall, collective: MatchedCollective,
        formation: Formation, me: int, run: ScheduleRun, data_phase: float,
    ) -> None:
        assert self.trace is not None
        algorithm = run.algorithm
        for number, (started, ended, sources) in enumerate(run.step_times):
            for source in sources or [me]:
                self.trace.add(f"link {formation.daemons[source]}",
                               f"{algorithm} step {number + 1}/{run.steps}", started, ended,
                               job=job.name, key=repr(ready.key))
        ended = run.step_times[-1][1] if run.step_times else data_phase
        for peer, (wire, raw) in sorted(run.sent_to.items()):
            self.trace.add(f"link {formation.daemons[peer]}", f"{algorithm} sent", data_phase,
                           ended, job=job.name, key=repr(ready.key), bytes_sent=wire,
                           bytes_before_compression=raw,
                           compression=collective.compression or "none")

    def _codec_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._codec_pool_lock:  # the loop and the measuring thread may both ask
            if self._codec_pool is None:
                self._codec_pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.config.codec_lanes, thread_name_prefix="gradsync-codec")
            return self._codec_pool

    def _residual(
        self, job: Job, ready: CollectiveCall, collective: MatchedCollective
    ) -> np.ndarray | None:
        """The error-feedback residual of this collective's buffer (the lowest local
        rank's input slot: the work buffer's size), or None without error feedback
        or a buffer to key it by."""
        if not collective.error_feedback:
            return None
        first = ready.submissions[min(ready.submissions)]
        if first.view is None or not first.slabs or not isinstance(first.view, np.ndarray):
            return None
        address = first.view.__array_interface__["data"][0]
        key = (job.name, first.slabs[0].segment_id, address, first.view.size,
               collective.dtype.str, collective.compression or "")
        return self.residuals.take(key, collective.dtype)

    def _offer_costs(self, job: Job, formation: Formation, epoch: int) -> None:
        """Send this daemon's figures for `epoch` to every member, once."""
        costs = job.across.auto.offer(job.name, formation, epoch, self.transport.endpoint,
                                      self.meter, self.config.auto_explore_factor)
        if costs is None:
            return
        message = costs.to_wire()
        for peer in formation.daemons:
            if peer != self.transport.endpoint:
                self.transport.post(peer, message)

    async def _with_agreed_costs(
        self, job: Job, formation: Formation, ready: CollectiveCall, deadline: float,
    ) -> Formation:
        """The formation with the figures every member sent for this key's epoch."""
        epoch = epoch_of(ready.key)
        if epoch < 1 or len(formation.daemons) < 2:
            return formation
        policy = job.across.auto
        generation, daemons = formation.generation, formation.daemons
        agreement = policy.agreement(formation, ready.key)
        if agreement is None:
            self._offer_costs(job, formation, epoch)
            agreement = policy.agreement(formation, ready.key)
        if agreement is None:
            if job.broken is not None:
                raise job.broken
            try:
                agreement = await settled(policy.epochs.waiter(generation, epoch),
                                          deadline - time.monotonic())
            except TimeoutError:
                policy.epochs.forget_waiter(generation, epoch)
                missing = policy.epochs.missing(generation, epoch, daemons)
                raise CollectiveTimeoutError(
                    f"key {ready.key!r} of {job.describe()} timed out after "
                    f"{ready.deadline_s:g}s waiting for the link costs of epoch {epoch} "
                    f"(auto) from peer daemons {missing}",
                    {"job": job.name, "key": ready.key, "waiting_for": missing},
                ) from None
        return policy.priced(formation, agreement)

    @staticmethod
    async def _with_job_context(
        job: Job, key: Any, run: ScheduleRun, driving: Awaitable[None]
    ) -> None:
        """A link that went down under a send raises a bare "peer P is lost": say
        which job, key and step it broke, as the cluster's own notice would."""
        try:
            await driving
        except PeerLostError as exc:
            if job.name in exc.message:
                raise
            raise PeerLostError(
                f"peer daemon {exc.details.get('peer', '?')} of {job.describe()} was lost "
                f"(key {key!r} at step {run.step + 1}/{run.steps} of {run.algorithm})",
                {**exc.details, "job": job.name, "key": key},
            ) from None

    async def _drive(
        self, job: Job, ready: CollectiveCall, run: ScheduleRun, formation: Formation,
        algorithm: str, deadline: float,
    ) -> None:
        """Start the schedule, feed it what came early, wait until done and sent."""
        run.start()
        self.cluster.feed_early(job, ready.key, run)
        try:
            await asyncio.wait_for(
                asyncio.shield(run.done), max(0.0, deadline - time.monotonic())
            )
        except TimeoutError:
            waiting = [formation.daemons[i] for i in run.waiting_for()]
            error = CollectiveTimeoutError(
                f"key {ready.key!r} of {job.describe()} timed out after "
                f"{ready.deadline_s:g}s at step {run.step + 1}/{run.steps} of {algorithm}, "
                f"waiting for peer daemons {waiting}",
                {"job": job.name, "key": ready.key, "waiting_for": waiting},
            )
            self.cluster.abort(job, ready.key, error)
            raise error from None
        try:
            await run.wait_sent(max(1.0, deadline - time.monotonic()))
        except SendFailed as exc:  # a data stream broke under our last slices
            peer = formation.daemons[exc.peer]
            lost = PeerLostError(
                f"key {ready.key!r} of {job.describe()}: sending this daemon's last slices "
                f"of {algorithm} to peer daemon {peer} failed: {exc.cause}",
                {"job": job.name, "key": ready.key, "peer": peer},
            )
            self.cluster.abort(job, ready.key, lost)
            raise lost from None

    def _trace(self, job: Job, name: str, started: float, key: Any) -> None:
        if self.trace is not None and self.trace.active:
            self.trace.add(f"job {job.name}", name, started, time.monotonic(), key=repr(key))
