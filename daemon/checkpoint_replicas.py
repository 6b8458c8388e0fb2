"""Replicas of peer daemons' checkpoint parts, held in this daemon's memory (issue 50, part 2).

A replica is one part (rank, item) of a committed step of a job, put by a rank
on another daemon (its `origin`), keyed by (job, step, origin, rank, item).
Its bytes arrive in chunks, in order, into a segment allocated here when the
first chunk comes (within `max_shm_bytes`: one that does not fit is dropped
with a log line, never an error for anyone); a chunk out of order, or a
sender lost midway, drops the replica.  Only whole replicas count.  Parts
fetched for a `ckpt_open` (daemon/io/checkpoint_peers.py) are held the same way.

Replicas are not this daemon's own ranks' checkpoints (`CheckpointStore`): they
are listed apart, and per job only those of the newest `kept` steps stay.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from gradsync.daemon.backends import Buffers, Slab
from gradsync.protocol.errors import ShmExhaustedError

log = logging.getLogger("gradsync.daemon.checkpoints")

#: (job, step, origin daemon, rank, item)
ReplicaKey = tuple[str, int, str, int, str]
_BYTE = np.dtype(np.uint8)


#: One transfer of a part: (sender, its request number, whether we pulled it).
Transfer = tuple[str, int, bool]


class ReplicaDropped(Exception):
    """A replica could not be kept (it does not fit, or its chunks broke off)."""


class ReplicaBusy(ReplicaDropped):
    """The chunk's part is arriving here by another transfer."""


@dataclasses.dataclass
class Replica:
    """One part held for a peer: its bytes so far, who sends them, since when."""

    key: ReplicaKey
    nbytes: int
    slab: Slab
    transfer: Transfer
    last_heard: float
    got: int = 0

    @property
    def sender(self) -> str:
        return self.transfer[0]

    @property
    def complete(self) -> bool:
        return self.got == self.nbytes

    def describe(self) -> str:
        job, step, origin, rank, item = self.key
        return (f"replica of checkpoint step {step} of job {job!r}, rank {rank}, "
                f"item {item!r} (from {origin})")


class ReplicaStore:
    """Every replica this daemon holds, allocated from `buffers`."""

    def __init__(self, buffers: Buffers, kept: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.buffers = buffers
        self.kept = kept
        self.clock = clock
        self.replicas: dict[ReplicaKey, Replica] = {}

    def chunk(self, key: ReplicaKey, transfer: Transfer, nbytes: int, off: int,
              data: memoryview) -> Replica:
        """Write one chunk of `transfer`; the replica (complete once `got == nbytes`).
        A first chunk (off 0) starts the replica afresh (a whole one is replaced),
        unless another transfer is bringing it (`ReplicaBusy`; but a pull, which a
        rank waits for, takes over from a push).  Raises `ReplicaDropped`."""
        replica = self.replicas.get(key)
        if replica is not None and replica.transfer != transfer:
            if not (off == 0 and (replica.complete or (transfer[2] and not replica.transfer[2]))):
                raise ReplicaBusy(f"{replica.describe()} is arriving from {replica.sender}")
            self._release(replica)
            replica = None
        if off == 0 and replica is None:
            replica = self._start(key, transfer, nbytes)
        if replica is None or replica.complete or replica.nbytes != nbytes:
            raise ReplicaDropped(f"a chunk at {off} of a replica not being received")
        if off != replica.got or off + data.nbytes > nbytes:
            self._release(replica)
            raise ReplicaDropped(f"{replica.describe()}: a chunk at {off} (+{data.nbytes}) "
                                 f"from {transfer[0]} after {replica.got} of {nbytes} bytes")
        if data.nbytes:
            target = replica.slab.view(off, data.nbytes, _BYTE)
            target[:] = np.frombuffer(data, dtype=_BYTE)
            del target
        replica.got += data.nbytes
        replica.last_heard = self.clock()
        if replica.complete:
            self._prune(key[0])
        return replica

    def _start(self, key: ReplicaKey, transfer: Transfer, nbytes: int) -> Replica:
        job, step, _, rank, item = key
        newest = self.steps(key[0])
        if len(newest) >= self.kept and step < newest[self.kept - 1]:
            raise ReplicaDropped(f"step {step} of job {job!r} is older than the {self.kept} "
                                 "newest held")
        owner = f"replica of checkpoint step {step} of job {job!r}, rank {rank}, item {item!r}"
        try:
            slab = self.buffers.allocate(nbytes, owner, {})
        except ShmExhaustedError as exc:
            raise ReplicaDropped(f"it does not fit: {exc}") from None
        replica = self.replicas[key] = Replica(key, nbytes, slab, transfer, self.clock())
        return replica

    def steps(self, job: str) -> list[int]:
        """The steps of `job` with a whole replica here, newest first."""
        return sorted({k[1] for k, r in self.replicas.items() if k[0] == job and r.complete},
                      reverse=True)

    def _prune(self, job: str) -> None:
        """Keep the whole replicas of the job's newest `kept` steps (and those arriving
        for newer ones)."""
        steps = self.steps(job)
        if len(steps) <= self.kept:
            return
        oldest_kept = steps[self.kept - 1]
        for key in [k for k in self.replicas if k[0] == job and k[1] < oldest_kept]:
            self._release(self.replicas[key])

    def _release(self, replica: Replica) -> None:
        if self.replicas.get(replica.key) is replica:
            del self.replicas[replica.key]
        self.buffers.release(replica.slab.segment_id)

    def drop_from(self, sender: str, why: str) -> None:
        """The sender was lost (or its stream broke): drop what it had not finished."""
        for replica in [r for r in self.replicas.values()
                        if r.sender == sender and not r.complete]:
            log.warning("dropping the %s: %d of %d bytes came before %s %s", replica.describe(),
                        replica.got, replica.nbytes, sender, why)
            self._release(replica)

    def drop_unfinished(self, key: ReplicaKey, transfer: Transfer) -> None:
        """Release the replica `transfer` left unfinished, if any (a pull given up)."""
        replica = self.replicas.get(key)
        if replica is not None and replica.transfer == transfer and not replica.complete:
            self._release(replica)

    def expire(self, idle_s: float) -> None:
        """Drop replicas whose chunks stopped coming for `idle_s` (every wait has a
        deadline)."""
        now = self.clock()
        for replica in [r for r in self.replicas.values()
                        if not r.complete and now - r.last_heard > idle_s]:
            log.warning("dropping the %s: no chunk for %.0fs after %d of %d bytes",
                        replica.describe(), idle_s, replica.got, replica.nbytes)
            self._release(replica)

    def whole(self, job: str, step: int) -> dict[tuple[str, int, str], Replica]:
        """The whole replicas of (job, step), by (origin, rank, item)."""
        return {(k[2], k[3], k[4]): r for k, r in self.replicas.items()
                if k[0] == job and k[1] == step and r.complete}

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        """Per job, the replicas held here (whole and arriving), newest step first."""
        jobs: dict[str, list[dict[str, Any]]] = {}
        for (job, step, origin, rank, item), replica in sorted(
                self.replicas.items(), key=lambda kv: (kv[0][0], -kv[0][1], kv[0][2:])):
            jobs.setdefault(job, []).append({
                "step": step, "origin": origin, "rank": rank, "item": item,
                "bytes": replica.nbytes, "complete": replica.complete, "got": replica.got})
        return jobs

    def release_all(self) -> None:
        for replica in list(self.replicas.values()):
            self._release(replica)
