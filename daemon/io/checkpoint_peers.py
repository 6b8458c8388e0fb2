"""Checkpoints across daemons: the commit, replicas on peers, and the pull on open
(issue 50, part 2).

- Commit.  A job's coordinator commits a step on its own daemon, but its other
  ranks put their parts on theirs.  The daemon asks every peer which parts of
  the step it holds ("held"), and only when every part is held somewhere tells
  the holders to commit their parts ("commit"), then commits its own.
- Replicas.  After a commit, each daemon sends the parts its own ranks put to
  the next `copies` daemons in the ring of all daemons sorted by endpoint
  (skipping those that are down): every part then lives on two daemons, so
  losing any one node keeps a full copy.  Parts travel in chunks of
  `CHUNK_BYTES` as `CkptChunk` messages, over the data stream to that peer
  (sealed on CURVE links; over the CURVE ZeroMQ link while no stream is open),
  one chunk at a time per peer.  A chunk waits while a collective of any job
  spanning that peer runs here (at most `YIELD_AT_MOST_S`, so that replicas
  are never starved): replicas fill the link's idle time between collectives.
  The receiver answers once the replica is whole (or dropped: see
  daemon/checkpoint_replicas.py); the sender records who confirmed what.
- A holder lost.  A lost peer's confirmations are forgotten (its memory is
  gone).  Where it held (or was receiving) the newest complete checkpoint of
  a job, that checkpoint's own parts are pushed at once, the same way, to the
  next live daemons in the ring that neither hold them nor are getting them,
  as many as bring the live copies back to `copies`: our parts then survive
  the loss of one more node, with no replacement and no new save (the lost
  node's own parts are not copied on: they stay where it had put them).  With no
  such daemon up, one log line says so; a daemon that comes up at a target's
  address later gets the newest checkpoint then (`peer_up`).
- Open.  A rank opens the newest step whose every part is here (its own, or
  replicas); else its daemon asks every peer what it holds, takes the newest
  step whose every part is held somewhere, pulls the parts it lacks ("pull":
  the holder sends them back as chunks) and serves them like its own.  That
  is how a replacement node's ranks load what the lost node's ranks saved.
- The pull is pipelined: the opening daemon asks for up to `PULL_PARTS` parts
  at once, and a holder queues a pulled part's chunks on the data stream
  without waiting for each to reach the kernel, up to `PULL_WINDOW_BYTES` per
  peer (shared by that peer's pulls: the copies queued stay bounded), so that
  the stream never runs dry between chunks or parts.  Chunks of one part
  arrive in order on one stream (the receiver places them in order); a pull
  never yields to collectives (a rank's load waits for it).  Without a data
  stream (ZeroMQ only) a pulled part goes a chunk at a time, as pushes do.

Every wait has a deadline (`ANSWER_TIMEOUT_S`); a peer lost fails what waits
on it at once, and so does a data stream from it that breaks mid-pull (its
chunks are lost), dropping what it left half-pulled.  Nothing here ever fails
the job's training: a replica not made is a log line.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from gradsync.daemon.backends import Slab
from gradsync.daemon.checkpoint_replicas import (
    ReplicaBusy,
    ReplicaDropped,
    ReplicaKey,
    ReplicaStore,
)
from gradsync.daemon.checkpoints import Checkpoint, CheckpointStore
from gradsync.daemon.core.cluster_context import ClusterCounters
from gradsync.daemon.peers.links import PeerLinks
from gradsync.protocol.errors import (
    CheckpointError,
    GradsyncError,
    InvalidArgumentError,
    PeerLostError,
    ProtocolError,
)
from gradsync.protocol.peer import (
    CkptAnswer,
    CkptAsk,
    CkptChunk,
    CkptHeld,
    CkptPart,
    CkptWhere,
    ckpt_from_wire,
)

log = logging.getLogger("gradsync.daemon.checkpoints")

#: Bytes of a part per chunk: a collective waits behind at most one of them.
CHUNK_BYTES = 1 << 20
#: Chunks of pulled parts queued for one peer beyond what the kernel took, at most
#: (`PULL_WINDOW_BYTES`): enough that the stream never runs dry between chunks.
PULL_WINDOW_CHUNKS = 8
PULL_WINDOW_BYTES = PULL_WINDOW_CHUNKS * CHUNK_BYTES
#: Parts one open pulls at once.
PULL_PARTS = 4
#: How long a chunk yields to running collectives, at most.
YIELD_AT_MOST_S = 2.0
#: How often a waiting chunk looks again whether the collectives are done.
_YIELD_POLL_S = 0.001
#: How long any answer from a peer is waited for.
ANSWER_TIMEOUT_S = 30.0
#: A replica whose chunks stopped coming this long is dropped.
REPLICA_IDLE_S = 60.0
_BYTE = np.dtype(np.uint8)
#: Where a part can be had: (holder daemon, origin daemon, bytes).
Source = tuple[str, str, int]


class CheckpointPeers:
    """The checkpoint messages of one daemon's peer links, and what they do."""

    def __init__(self, store: CheckpointStore, replicas: ReplicaStore, links: PeerLinks,
                 copies: int, busy: Callable[[str], bool],
                 counters: ClusterCounters | None = None) -> None:
        """`copies`: peers each part is replicated to; `busy(peer)`: whether a
        collective spanning `peer` runs now (replicas wait for it to end);
        `counters`: where malformed messages are counted (the daemon's `malformed`)."""
        self.store = store
        self.replicas = replicas
        self.links = links
        self.copies = copies
        self.busy = busy
        self._reqs = itertools.count(1)
        #: What we wait for an answer to, by req: (peer, future).
        self._pending: dict[int, tuple[str, asyncio.Future[CkptAnswer]]] = {}
        #: Our pulls under way: req -> the replica key they fill.
        self._pulls: dict[int, ReplicaKey] = {}
        #: Pushes we dropped (peer, req): their later chunks are ignored quietly.
        self._refused: set[tuple[str, int]] = set()
        self._queues: dict[str, collections.deque[tuple[str, int]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._workers: dict[str, asyncio.Task[None]] = {}
        #: Per job, held while an open asks the peers and pulls.
        self._opening: dict[str, asyncio.Lock] = {}
        #: Per peer, the chunks of pulls by it we may still queue (`_stream_pulled`).
        self._windows: dict[str, asyncio.Semaphore] = {}
        #: Pulls we gave up: their later chunks are ignored quietly.
        self._abandoned: set[int] = set()
        #: Per peer, the (job, step) whose parts are being pushed to it now.
        self._sending: dict[str, tuple[str, int]] = {}
        self.counters = counters or ClusterCounters()

    @property
    def endpoint(self) -> str:
        return self.links.endpoint

    def start(self) -> None:
        self._spawn(self._expire(), "checkpoint replicas expiry")

    async def close(self) -> None:
        tasks = [*self._tasks, *self._workers.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, waiter in self._pending.values():
            if not waiter.done():
                waiter.cancel()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(REPLICA_IDLE_S / 4)
            self.replicas.expire(REPLICA_IDLE_S)

    # -- the links' events ----------------------------------------------------

    def message(self, peer: str, header: Mapping[str, Any], payloads: Sequence[Any]) -> None:
        """One checkpoint message from `peer`; a malformed one is counted and logged."""
        with self.counters.dropping_bad(header, peer, log):
            message = ckpt_from_wire(header)
            if isinstance(message, CkptChunk):
                self._on_chunk(peer, message, payloads)
            elif isinstance(message, CkptAnswer):
                self._on_answer(peer, message)
            else:
                self._on_ask(peer, message)

    def peer_lost(self, peer: str, why: str) -> None:
        """Drop the replicas `peer` had not finished; forget the ones it confirmed (a
        lost node's memory is gone: the daemon that comes up at its address gets our
        newest checkpoints again, `peer_up`); fail what waits on it; and push the
        newest checkpoints it held (or was receiving) to other live peers now
        (`_rereplicate`), so that losing one more node still keeps a copy."""
        held = self._held_by(peer)
        self.replicas.drop_from(peer, f"was lost ({why})")
        for checkpoints in self.store.jobs.values():
            for checkpoint in checkpoints.values():
                checkpoint.replicas.pop(peer, None)
        for asked, waiter in list(self._pending.values()):
            if asked == peer and not waiter.done():
                waiter.set_exception(CheckpointError(
                    f"peer daemon {peer} was lost ({why})", {"peer": peer}))
        self._rereplicate(peer, held)

    def peer_up(self, peer: str) -> None:
        """A peer (back, or a replacement node): if it is one of our targets, it gets
        the newest complete checkpoint of each job it has not confirmed."""
        if peer not in self.targets():
            return
        for job in list(self.store.jobs):
            newest = next(iter(self.store.complete(job)), None)
            if newest is not None and peer not in newest.replicated_on():
                self.replicate(newest, only=peer)

    def stream_broken(self, peer: str, why: str) -> None:
        """Chunks from `peer` may be lost: what it had not finished is dropped, and our
        pulls from it fail at once (their replicas are among the dropped)."""
        self.replicas.drop_from(peer, f"broke the data stream ({why})")
        for req in list(self._pulls):
            asked, waiter = self._pending.get(req, (None, None))
            if asked == peer and waiter is not None and not waiter.done():
                waiter.set_exception(CheckpointError(
                    f"the data stream with peer daemon {peer} broke mid-pull ({why})",
                    {"peer": peer}))

    # -- asking and answering -------------------------------------------------

    async def ask(self, peer: str, job: str, what: str, step: int,
                  parts: tuple[CkptPart, ...] = (), part: CkptWhere | None = None,
                  req: int | None = None) -> CkptAnswer:
        """Ask `peer` and wait for its answer (`CheckpointError` when none comes)."""
        req = next(self._reqs) if req is None else req
        waiter = self._expect(peer, req)
        try:
            await self.links.send(peer, CkptAsk(job, req, what, step, parts, part).to_wire())
            return await asyncio.wait_for(waiter, ANSWER_TIMEOUT_S)
        except TimeoutError:
            raise CheckpointError(f"peer daemon {peer} did not answer a checkpoint {what!r} of "
                                  f"job {job!r} within {ANSWER_TIMEOUT_S:g}s",
                                  {"peer": peer, "job": job}) from None
        except GradsyncError as exc:
            raise CheckpointError(f"asking peer daemon {peer} ({what!r} of job {job!r}) "
                                  f"failed: {exc.message}", {"peer": peer, "job": job}) from None
        finally:
            self._pending.pop(req, None)

    def _expect(self, peer: str, req: int) -> asyncio.Future[CkptAnswer]:
        waiter: asyncio.Future[CkptAnswer] = asyncio.get_running_loop().create_future()
        self._pending[req] = (peer, waiter)
        return waiter

    def _on_answer(self, peer: str, answer: CkptAnswer) -> None:
        asked, waiter = self._pending.get(answer.req, (None, None))
        if waiter is None or asked != peer:
            log.debug("an answer (req %d) from %s that nothing waits for", answer.req, peer)
        elif not waiter.done():
            waiter.set_result(answer)

    def _answer(self, peer: str, answer: CkptAnswer) -> None:
        """Send an answer in the background (a lost peer needs none)."""
        async def send() -> None:
            try:
                try:
                    await self.links.send(peer, answer.to_wire())
                except InvalidArgumentError as exc:  # a listing beyond the header's limit
                    log.warning("checkpoint answer to %s too large: %s", peer, exc.message)
                    await self.links.send(peer, CkptAnswer(
                        answer.job, answer.req, False, exc.message[:1000]).to_wire())
            except GradsyncError as exc:
                log.info("checkpoint answer to %s not sent: %s", peer, exc.message)
        self._spawn(send(), f"checkpoint answer to {peer}")

    def _on_ask(self, peer: str, ask: CkptAsk) -> None:
        if ask.what == "held":
            held = self.holdings(ask.job, None if ask.step < 0 else ask.step)
            self._answer(peer, CkptAnswer(ask.job, ask.req, True, held=held))
        elif ask.what == "commit":
            self._answer(peer, self._commit_here(ask))
        else:
            self._spawn(self._serve_pull(peer, ask), f"checkpoint pull by {peer}")

    def _commit_here(self, ask: CkptAsk) -> CkptAnswer:
        """A peer's coordinator committed the step: mark our parts of it complete."""
        try:
            checkpoint = self.store.commit(ask.job, ask.step, ask.parts,
                                           elsewhere=frozenset(ask.parts))
        except GradsyncError as exc:
            return CkptAnswer(ask.job, ask.req, False, exc.message[:1000])
        log.debug("%s complete (committed by a peer): %d bytes here", checkpoint.describe(),
                  checkpoint.nbytes)
        self.replicate(checkpoint)
        return CkptAnswer(ask.job, ask.req, True)

    def holdings(self, job: str, step: int | None) -> tuple[CkptHeld, ...]:
        """What this daemon holds of the job's steps (all, or `step`): its own parts
        (complete: committed), and its whole replicas (of committed steps)."""
        held = []
        for checkpoint in list(self.store.jobs.get(job, {}).values()):
            if step is None or checkpoint.step == step:
                complete = checkpoint.committed_at is not None
                held.append(CkptHeld(
                    checkpoint.step, complete,
                    tuple(sorted(checkpoint.every_part)) if complete else (),
                    tuple((self.endpoint, rank, item, slab.nbytes)
                          for (rank, item), slab in sorted(checkpoint.parts.items()))))
        for replica_step in self.replicas.steps(job):
            if step is None or replica_step == step:
                whole = self.replicas.whole(job, replica_step)
                held.append(CkptHeld(replica_step, True, (), tuple(
                    (*where, replica.nbytes) for where, replica in sorted(whole.items()))))
        return tuple(held)

    async def ask_all(self, job: str, step: int) -> dict[str, CkptAnswer | Exception]:
        """Every peer that is up, asked what it holds (step -1: of every step)."""
        peers = [p for p in self.links.peers if self.links.is_up(p)]
        answers = await asyncio.gather(*(self.ask(p, job, "held", step) for p in peers),
                                       return_exceptions=True)
        return {p: a if isinstance(a, CkptAnswer | Exception) else Exception(str(a))
                for p, a in zip(peers, answers, strict=True)}

    # -- the commit -------------------------------------------------------------

    async def commit(self, job: str, step: int, parts: tuple[CkptPart, ...]) -> Checkpoint:
        """Commit a step whose parts are not all here: only once every part is held
        by some peer, whose parts are committed first."""
        local = self.store.jobs.get(job, {}).get(step)
        missing = set(parts) - set(local.parts if local is not None else ())
        holders: dict[str, set[CkptPart]] = {}
        answers = await self.ask_all(job, step)
        for peer, answer in answers.items():
            if isinstance(answer, CkptAnswer):
                for held in answer.held:
                    holders.setdefault(peer, set()).update(
                        (rank, item) for origin, rank, item, _ in held.held if origin == peer)
        unheld = sorted(missing - set().union(*holders.values()))
        if unheld:
            silent = {p: str(a) for p, a in answers.items() if isinstance(a, Exception)}
            raise CheckpointError(
                f"checkpoint step {step} of job {job!r} cannot be committed: parts "
                f"{unheld[:8]} (rank, item) are held by no daemon"
                + (f" (no answer from {silent})" if silent else ""), {"job": job, "step": step})
        owners = [p for p, held in holders.items() if held & missing]
        results = await asyncio.gather(*(self.ask(p, job, "commit", step, parts)
                                         for p in owners), return_exceptions=True)
        for peer, result in zip(owners, results, strict=True):
            if isinstance(result, BaseException) or not result.ok:
                why = result if isinstance(result, BaseException) else result.error
                raise CheckpointError(f"checkpoint step {step} of job {job!r}: peer daemon "
                                      f"{peer} did not commit its parts: {why}",
                                      {"job": job, "step": step, "peer": peer})
        checkpoint = self.store.commit(job, step, parts, elsewhere=frozenset(missing))
        self.replicate(checkpoint)
        return checkpoint

    # -- replicas: pushing ------------------------------------------------------

    def targets(self) -> list[str]:
        """The daemons that get our parts: the next `copies` after us, in the ring of
        every daemon sorted by endpoint, that are up."""
        after = [p for p in self._ring_after() if self.links.is_up(p)]
        return after[:self.copies]

    def _ring_after(self) -> list[str]:
        """Every peer, in the ring of all daemons sorted by endpoint, from ours on."""
        ring = sorted({self.endpoint, *self.links.peers})
        at = ring.index(self.endpoint)
        return ring[at + 1:] + ring[:at]

    def replicate(self, checkpoint: Checkpoint, only: str | None = None) -> None:
        """Send our parts of a committed step to the target peers (or to `only`), in
        the background."""
        if not self.copies or not checkpoint.parts:
            return
        for peer in self.targets() if only is None else [only]:
            self._queues.setdefault(peer, collections.deque()).append(
                (checkpoint.job, checkpoint.step))
            worker = self._workers.get(peer)
            if worker is None or worker.done():
                self._workers[peer] = asyncio.get_running_loop().create_task(
                    self._push_worker(peer), name=f"checkpoint replicas to {peer}")

    def _held_by(self, peer: str) -> list[Checkpoint]:
        """The newest complete checkpoint of each job whose parts `peer` confirmed
        (some or all), is being sent, or has queued."""
        queued = set(self._queues.get(peer, ()))
        sending = self._sending.get(peer)
        held = []
        for job in list(self.store.jobs):
            newest = next(iter(self.store.complete(job)), None)
            if newest is not None and newest.parts and (
                    peer in newest.replicas or (job, newest.step) in queued
                    or sending == (job, newest.step)):
                held.append(newest)
        return held

    def _rereplicate(self, lost: str, held: list[Checkpoint]) -> None:
        """`lost` held replicas of `held`: push each to the next live peers in the
        ring that neither hold it nor are getting it, as many as bring its live
        copies back to `copies`; with nowhere to go, one log line."""
        nowhere = []
        for checkpoint in held if self.copies else []:
            holders = self._live_holders(checkpoint)
            ring = [p for p in self._ring_after() if self.links.is_up(p) and p not in holders]
            chosen = ring[:max(0, self.copies - len(holders))]
            if not chosen and len(holders) < self.copies:
                nowhere.append(checkpoint.describe())
            for peer in chosen:
                log.info("%s: its replica on peer %s was lost; replicating it on %s",
                         checkpoint.describe(), lost, peer)
                self.replicate(checkpoint, only=peer)
        if nowhere:
            log.warning("peer %s, which held replicas of %s, was lost, and no other live "
                        "peer can take them: they live on this daemon alone until a peer "
                        "comes up", lost, ", ".join(nowhere))

    def _live_holders(self, checkpoint: Checkpoint) -> set[str]:
        """The live peers that hold every part of `checkpoint` here, or are getting it
        (from a worker that runs: one that stopped at a loss left its queue)."""
        key = (checkpoint.job, checkpoint.step)
        getting = {p for p, queue in self._queues.items()
                   if (key in queue or self._sending.get(p) == key)
                   and p in self._workers and not self._workers[p].done()}
        return {p for p in {*checkpoint.replicated_on(), *getting} if self.links.is_up(p)}

    async def _push_worker(self, peer: str) -> None:
        queue = self._queues[peer]
        while queue:
            job, step = queue.popleft()
            if any(j == job and s > step for j, s in queue):
                continue  # a newer step of the job waits: only the newest matters
            checkpoint = self.store.jobs.get(job, {}).get(step)
            if checkpoint is None or checkpoint.committed_at is None:
                continue
            self._sending[peer] = (job, step)
            try:
                if not await self._push(peer, checkpoint):
                    break
            finally:
                self._sending.pop(peer, None)

    async def _push(self, peer: str, checkpoint: Checkpoint) -> bool:
        """Send every part of `checkpoint` held here to `peer`; False if the peer is
        gone (the rest of its queue is dropped)."""
        started = asyncio.get_running_loop().time()
        for rank, item in sorted(checkpoint.parts):
            req = next(self._reqs)
            waiter = self._expect(peer, req)
            where = (self.endpoint, rank, item)
            try:
                await self._send_part(peer, req, False, checkpoint.job, checkpoint.step,
                                      where, waiter)
                answer = await asyncio.wait_for(waiter, ANSWER_TIMEOUT_S)
            except (GradsyncError, TimeoutError, ConnectionError) as exc:
                log.warning("the replica of %s, rank %d, item %r on %s was not made: %s",
                            checkpoint.describe(), rank, item, peer,
                            getattr(exc, "message", None) or type(exc).__name__)
                return self.links.is_up(peer)
            finally:
                self._pending.pop(req, None)
            if not answer.ok:
                log.warning("peer %s dropped the replica of %s, rank %d, item %r: %s", peer,
                            checkpoint.describe(), rank, item, answer.error)
                return True
            checkpoint.replicas.setdefault(peer, set()).add((rank, item))
        log.info("%s replicated on %s (%d bytes, %.2fs)", checkpoint.describe(), peer,
                 checkpoint.nbytes, asyncio.get_running_loop().time() - started)
        return True

    def _part(self, job: str, step: int, where: CkptWhere) -> Slab | None:
        """The segment of a part held here (ours committed, or a whole replica)."""
        origin, rank, item = where
        checkpoint = self.store.jobs.get(job, {}).get(step)
        if (origin == self.endpoint and checkpoint is not None
                and checkpoint.committed_at is not None and (rank, item) in checkpoint.parts):
            return checkpoint.parts[(rank, item)]
        # A part of our origin held as a replica: one fetched by a replacement daemon
        # (same address) from its lost predecessor's.
        replica = self.replicas.whole(job, step).get(where)
        return None if replica is None else replica.slab

    async def _send_part(self, peer: str, req: int, pull: bool, job: str, step: int,
                         where: CkptWhere, stop: asyncio.Future[Any] | None = None) -> None:
        """Send one part as chunks: a pushed one a chunk at a time, each once the link
        is idle (or waited long enough); a pulled one at once, pipelined over the data
        stream (`_stream_pulled`).  Stops early when `stop` is done (the receiver
        answered: dropped)."""
        nbytes = self._held(job, step, where).nbytes
        if pull and self.links.stream_open(peer):
            await self._stream_pulled(peer, req, job, step, where, nbytes)
            return
        for off in range(0, nbytes, CHUNK_BYTES):
            if stop is not None and stop.done():
                return
            if not pull:
                # A pull never yields: a rank's load waits for it, and that rank's job
                # often waits in a collective for the load (DCP gathers the plans),
                # which would hold every chunk back for YIELD_AT_MOST_S.
                await self._idle(peer)
            await self.links.send(peer, *self._chunk(req, pull, job, step, where, nbytes, off))

    def _held(self, job: str, step: int, where: CkptWhere) -> Slab:
        """The segment of a part held here (`CheckpointError` if not held)."""
        slab = self._part(job, step, where)
        if slab is None:
            raise CheckpointError(f"part {where} of step {step} of job {job!r} is not held "
                                  f"on {self.endpoint}")
        return slab

    def _chunk(self, req: int, pull: bool, job: str, step: int, where: CkptWhere,
               nbytes: int, off: int) -> tuple[dict[str, Any], list[bytes]]:
        """The chunk of a part at `off`: its header and a copy of its bytes (the
        segment may be released while the chunk is on its way)."""
        slab = self._part(job, step, where)
        if slab is None or slab.nbytes != nbytes:
            raise CheckpointError(f"part {where} of step {step} of job {job!r} was "
                                  "dropped here while being sent (a newer one pruned it)")
        view = slab.view(off, min(CHUNK_BYTES, nbytes - off), _BYTE)
        data = view.tobytes()
        del view
        return CkptChunk(job, req, pull, step, *where, nbytes, off).to_wire(), [data]

    async def _stream_pulled(self, peer: str, req: int, job: str, step: int,
                             where: CkptWhere, nbytes: int) -> None:
        """Queue a pulled part's chunks on the data stream to `peer` without waiting
        for each: up to `PULL_WINDOW_BYTES` (shared by the peer's pulls) beyond what
        the kernel took, so that the stream never runs dry between chunks and the
        copies stay bounded.  Returns once the kernel has them all."""
        window = self._windows.setdefault(peer, asyncio.Semaphore(PULL_WINDOW_CHUNKS))
        queued: list[asyncio.Future[Any]] = []
        for off in range(0, nbytes, CHUNK_BYTES):
            await _within(window.acquire(), f"room to send a pulled chunk to {peer}")
            try:
                if not self.links.stream_open(peer):  # it broke: the pull fails there
                    raise PeerLostError(f"the data stream to peer daemon {peer} closed "
                                        "mid-pull", {"peer": peer})
                sent = self.links.send_nowait(
                    peer, *self._chunk(req, True, job, step, where, nbytes, off))
            except BaseException:
                window.release()
                raise
            sent.add_done_callback(lambda _: window.release())
            queued.append(sent)
            while queued and queued[0].done():
                _check_sent(peer, queued.pop(0))
        if queued:
            done, _ = await asyncio.wait(queued, timeout=ANSWER_TIMEOUT_S,
                                         return_when=asyncio.FIRST_EXCEPTION)
            for sent in queued:
                if sent not in done or sent.exception() is not None:
                    _check_sent(peer, sent)

    async def _idle(self, peer: str) -> None:
        """Wait while a collective spanning `peer` runs here, `YIELD_AT_MOST_S` at most."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + YIELD_AT_MOST_S
        while self.busy(peer) and loop.time() < deadline:
            await asyncio.sleep(_YIELD_POLL_S)

    # -- replicas: receiving ----------------------------------------------------

    def _on_chunk(self, peer: str, chunk: CkptChunk, payloads: Sequence[Any]) -> None:
        if len(payloads) != 1 or not isinstance(payloads[0], memoryview | bytes):
            raise ProtocolError("ckpt_chunk: one payload of bytes expected")
        data = memoryview(payloads[0]).cast("B")
        key = (chunk.job, chunk.step, chunk.origin, chunk.rank, chunk.item)
        if chunk.pull and chunk.req in self._abandoned:
            return
        if chunk.pull and self._pulls.get(chunk.req) != key:
            raise ProtocolError(f"ckpt_chunk: a pull (req {chunk.req}) we did not ask for")
        if not chunk.pull and (peer, chunk.req) in self._refused:
            return
        try:
            replica = self.replicas.chunk(key, (peer, chunk.req, chunk.pull), chunk.nbytes,
                                          chunk.off, data)
        except ReplicaDropped as exc:
            if not isinstance(exc, ReplicaBusy):
                log.warning("dropping the replica of checkpoint step %d of job %r, rank %d, "
                            "item %r from %s: %s", chunk.step, chunk.job, chunk.rank,
                            chunk.item, peer, exc)
            if not chunk.pull:  # answered now; the rest of its chunks are ignored
                if len(self._refused) > 1024:
                    self._refused.clear()
                self._refused.add((peer, chunk.req))
                self._answer(peer, CkptAnswer(chunk.job, chunk.req, False, str(exc)[:1000]))
            return
        if replica.complete and not chunk.pull:
            self._answer(peer, CkptAnswer(chunk.job, chunk.req, True))

    # -- the open: pulling what is missing ---------------------------------------

    async def _serve_pull(self, peer: str, ask: CkptAsk) -> None:
        assert ask.part is not None
        answer = CkptAnswer(ask.job, ask.req, True)
        try:
            await self._send_part(peer, ask.req, True, ask.job, ask.step, ask.part)
        except CheckpointError as exc:
            answer = CkptAnswer(ask.job, ask.req, False, exc.message[:1000])
        except GradsyncError as exc:
            log.info("sending part %s of job %r to %s failed: %s", ask.part, ask.job, peer,
                     exc.message)
            return
        self._answer(peer, answer)

    def local_parts(self, job: str, step: int | None) -> tuple[int, dict[CkptPart, Slab]] | None:
        """The newest complete step (or `step`) whose every part is here, if any."""
        for checkpoint in self.store.complete(job):
            if step is None or checkpoint.step == step:
                parts = {(rank, item): replica.slab for (_, rank, item), replica
                         in self.replicas.whole(job, checkpoint.step).items()}
                parts.update(checkpoint.parts)
                if checkpoint.every_part <= set(parts):
                    return checkpoint.step, {p: parts[p] for p in checkpoint.every_part}
                return None
        return None

    async def open(self, job: str, step: int | None) -> tuple[int, dict[CkptPart, Slab]]:
        """The parts of the newest step (or `step`) complete across the daemons, fetched
        here where missing."""
        here = self.local_parts(job, step)
        if here is not None:
            return here
        # The ranks of a node open together: one asks and pulls, the others find the
        # parts here then (two pulls of one part would restart each other's replica).
        async with self._opening.setdefault(job, asyncio.Lock()):
            return await self._open_across(job, step)

    async def _open_across(self, job: str, step: int | None
                           ) -> tuple[int, dict[CkptPart, Slab]]:
        clock = asyncio.get_running_loop().time
        started = clock()
        answers = await self.ask_all(job, -1 if step is None else step)
        entries = [(self.endpoint, held) for held in self.holdings(job, step)]
        entries += [(peer, held) for peer, answer in answers.items()
                    if isinstance(answer, CkptAnswer) for held in answer.held]
        chosen, sources = choose_step(job, step, entries)
        asked = clock()
        lacking = [part for part, where in sources.items()
                   if all(self._part(job, chosen, (origin, *part)) is None
                          for _, origin, _ in where)]
        parts = await self._fetch_all(job, chosen, sources)
        pulled = sum(parts[part].nbytes for part in lacking)
        log.info("checkpoint step %d of job %r opened from the peers' parts and replicas: "
                 "asked in %.3fs, %d parts (%d bytes) pulled in %.3fs", chosen, job,
                 asked - started, len(lacking), pulled, clock() - asked)
        return chosen, parts

    async def _fetch_all(self, job: str, step: int, sources: Mapping[CkptPart, list[Source]]
                         ) -> dict[CkptPart, Slab]:
        """Every part here, `PULL_PARTS` pulled at once; the first that cannot be
        fetched fails the open at once, and the others' pulls stop."""
        room = asyncio.Semaphore(PULL_PARTS)

        async def fetch(part: CkptPart, where: list[Source]) -> Slab:
            async with room:
                return await self._fetch(job, step, part, where)

        loop = asyncio.get_running_loop()
        tasks = {part: loop.create_task(fetch(part, where), name=f"pull of part {part}")
                 for part, where in sorted(sources.items())}
        try:
            await asyncio.gather(*tasks.values())
        finally:
            for task in tasks.values():
                task.cancel()
        return {part: task.result() for part, task in tasks.items()}

    async def _fetch(self, job: str, step: int, part: CkptPart,
                     sources: list[Source]) -> Slab:
        """A part here, pulled from the first source that sends it whole."""
        errors = []
        for holder, origin, _ in sorted(sources, key=lambda s: (s[0] != self.endpoint,
                                                               s[0] != s[1])):
            slab = self._part(job, step, (origin, *part))
            if slab is not None:
                return slab
            if holder == self.endpoint:
                continue
            req = next(self._reqs)
            key = self._pulls[req] = (job, step, origin, *part)
            try:
                answer = await self.ask(holder, job, "pull", step, part=(origin, *part), req=req)
            except CheckpointError as exc:
                errors.append(exc.message)
                continue
            finally:
                self._end_pull(req, key, holder)
            slab = self._part(job, step, (origin, *part))
            if answer.ok and slab is not None:
                return slab
            errors.append(answer.error or f"{holder} sent part {part} incompletely")
        raise CheckpointError(f"part {part} (rank, item) of checkpoint step {step} of job "
                              f"{job!r} could not be fetched: {'; '.join(errors)}",
                              {"job": job, "step": step})

    def _end_pull(self, req: int, key: ReplicaKey, holder: str) -> None:
        """A pull is over: a replica it left unfinished is released now (not at its
        expiry), and chunks still on their way are ignored."""
        self._pulls.pop(req, None)
        self.replicas.drop_unfinished(key, (holder, req, True))
        if len(self._abandoned) > 1024:
            self._abandoned.clear()
        self._abandoned.add(req)


async def _within(waited: Awaitable[Any], what: str) -> Any:
    """What `waited` gives, or `CheckpointError` after `ANSWER_TIMEOUT_S`."""
    try:
        return await asyncio.wait_for(waited, ANSWER_TIMEOUT_S)
    except TimeoutError:
        raise CheckpointError(f"no {what} within {ANSWER_TIMEOUT_S:g}s") from None


def _check_sent(peer: str, sent: asyncio.Future[Any]) -> None:
    """Raise why a queued chunk is not with the kernel: not within the deadline
    (`CheckpointError`), or the stream broke or the peer was lost (`GradsyncError`)."""
    if not sent.done():
        raise CheckpointError(f"chunks pulled by peer daemon {peer} were not sent within "
                              f"{ANSWER_TIMEOUT_S:g}s", {"peer": peer})
    exc = sent.exception()
    if isinstance(exc, GradsyncError):
        raise exc
    if exc is not None:
        raise PeerLostError(f"the data stream to peer daemon {peer} broke: {exc}",
                            {"peer": peer})


def choose_step(job: str, step: int | None, entries: Iterable[tuple[str, CkptHeld]]
                ) -> tuple[int, dict[CkptPart, list[Source]]]:
    """The newest step (or `step`) whose every part some daemon holds, and where each
    part is; entries are (holder, what it holds of a step)."""
    known: dict[int, frozenset[CkptPart]] = {}
    where: dict[int, dict[CkptPart, list[Source]]] = {}
    for holder, held in entries:
        if not held.complete:
            continue  # a save not (yet) committed there
        if held.parts:  # every daemon that committed the step lists the same parts
            known[held.step] = known.get(held.step, frozenset()) | frozenset(held.parts)
        for origin, rank, item, nbytes in held.held:
            where.setdefault(held.step, {}).setdefault((rank, item), []).append(
                (holder, origin, nbytes))
    for candidate in sorted(known, reverse=True):
        if step is not None and candidate != step:
            continue
        sources = where.get(candidate, {})
        if known[candidate] <= set(sources):
            return candidate, {part: sources[part] for part in known[candidate]}
    steps = {s: f"{len(set(where.get(s, {})) & p)}/{len(p)} parts" for s, p in known.items()}
    raise CheckpointError(
        f"job {job!r} has no complete checkpoint{'' if step is None else f' of step {step}'} "
        f"on this daemon or its peers (steps seen: {steps or 'none'})", {"job": job})
