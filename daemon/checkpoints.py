"""Checkpoints in daemon memory: each job's newest complete ones (issue 50, part 1).

A checkpoint is (job, step); each rank puts its parts (`item`s) into segments
the daemon creates and owns, so they outlive the trainer processes.  A
checkpoint can be opened only once it is committed (torch DCP's coordinator
commits in `finish()`, after every rank's write results are in): a save that
dies midway leaves the previous complete checkpoint as the newest.  Per job
the last `kept` complete checkpoints stay; a commit drops older ones and the
unfinished saves they supersede.  The bytes count against `max_shm_bytes` like
every other segment: a part that does not fit is an error for that save only.

The job name is the scope: only sessions of the job may put, commit, list or
open its checkpoints (io/service.py checks who asks).  The daemon never reads
the data; its clients write and read it through their own mappings.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from gradsync.daemon.backends import Buffers, Slab
from gradsync.protocol.errors import CheckpointError, ShmExhaustedError

log = logging.getLogger("gradsync.daemon.checkpoints")


@dataclasses.dataclass
class Checkpoint:
    """One (job, step): its parts by (rank, item), and whether it is complete."""

    job: str
    step: int
    created: float
    parts: dict[tuple[int, str], Slab] = dataclasses.field(default_factory=dict)
    committed_at: float | None = None

    @property
    def nbytes(self) -> int:
        return sum(slab.nbytes for slab in self.parts.values())

    def describe(self) -> str:
        return f"checkpoint step {self.step} of job {self.job!r}"


class CheckpointStore:
    """Every job's checkpoints on this daemon, allocated from `buffers`."""

    def __init__(self, buffers: Buffers, kept: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.buffers = buffers
        self.kept = kept
        self.clock = clock
        self.jobs: dict[str, dict[int, Checkpoint]] = {}

    def put(self, job: str, step: int, rank: int, item: str, nbytes: int) -> Slab:
        """A fresh segment for `item` of `rank` in (job, step); a part put again
        (a save retried after a crash) replaces the old one."""
        steps = self.jobs.setdefault(job, {})
        checkpoint = steps.get(step)
        if checkpoint is not None and checkpoint.committed_at is not None:
            raise CheckpointError(
                f"{checkpoint.describe()} is already complete; save under a new step",
                {"job": job, "step": step})
        if checkpoint is None:
            checkpoint = steps[step] = Checkpoint(job, step, self.clock())
        old = checkpoint.parts.pop((rank, item), None)
        if old is not None:
            self.buffers.release(old.segment_id)
        owner = f"{checkpoint.describe()}, rank {rank}, item {item!r}"
        try:
            slab = self._allocate(job, step, nbytes, owner)
        except ShmExhaustedError as exc:
            # This save cannot complete: give back what it holds, keep the complete ones.
            self._drop(checkpoint)
            raise ShmExhaustedError(
                f"{exc} (the checkpoint is not saved; the complete checkpoints of job "
                f"{job!r} take {self.complete_bytes(job)} bytes; keep fewer with "
                "--checkpoints-kept or raise --max-shm-bytes)", exc.details) from None
        checkpoint.parts[(rank, item)] = slab
        return slab

    def _allocate(self, job: str, step: int, nbytes: int, owner: str) -> Slab:
        """Allocate; when out of room, first drop the job's unfinished saves older than
        `step` (saves a crash abandoned: they can never complete) and try again."""
        try:
            return self.buffers.allocate(nbytes, owner, {})
        except ShmExhaustedError:
            stale = [c for s, c in self.jobs.get(job, {}).items()
                     if s < step and c.committed_at is None]
            if not stale:
                raise
            for checkpoint in stale:
                self._drop(checkpoint)
            return self.buffers.allocate(nbytes, owner, {})

    def commit(self, job: str, step: int, parts: tuple[tuple[int, str], ...]) -> Checkpoint:
        """Mark (job, step) complete once every part in `parts` is in; prune the job."""
        checkpoint = self.jobs.get(job, {}).get(step)
        if checkpoint is None:
            raise CheckpointError(f"no parts of checkpoint step {step} of job {job!r} were put "
                                  "(a rank's save failed, or the daemon restarted)",
                                  {"job": job, "step": step})
        missing = sorted(set(parts) - set(checkpoint.parts))
        if missing:
            raise CheckpointError(
                f"{checkpoint.describe()} cannot be committed: parts {missing[:8]} "
                f"(rank, item) were never put", {"job": job, "step": step})
        extra = set(checkpoint.parts) - set(parts)
        for key in extra:  # left by an earlier try of this step: not part of it
            self.buffers.release(checkpoint.parts.pop(key).segment_id)
        if checkpoint.committed_at is None:
            checkpoint.committed_at = self.clock()
        self._prune(job)
        return checkpoint

    def _prune(self, job: str) -> None:
        steps = self.jobs.get(job, {})
        complete = sorted((s for s, c in steps.items() if c.committed_at is not None),
                          reverse=True)
        newest = complete[0] if complete else None
        doomed = [steps[s] for s in complete[self.kept:]]
        doomed += [c for s, c in steps.items()
                   if c.committed_at is None and newest is not None and s < newest]
        for checkpoint in doomed:
            self._drop(checkpoint)

    def _drop(self, checkpoint: Checkpoint) -> None:
        for slab in checkpoint.parts.values():
            self.buffers.release(slab.segment_id)
        checkpoint.parts.clear()
        steps = self.jobs.get(checkpoint.job, {})
        steps.pop(checkpoint.step, None)
        if not steps:
            self.jobs.pop(checkpoint.job, None)

    def complete(self, job: str) -> list[Checkpoint]:
        """The job's complete checkpoints, newest first."""
        return sorted((c for c in self.jobs.get(job, {}).values() if c.committed_at is not None),
                      key=lambda c: c.step, reverse=True)

    def complete_bytes(self, job: str) -> int:
        return sum(c.nbytes for c in self.complete(job))

    def open(self, job: str, step: int | None) -> Checkpoint:
        """Complete checkpoint `step` of the job, or its newest with step None."""
        complete = self.complete(job)
        if step is None:
            if not complete:
                raise CheckpointError(f"job {job!r} has no complete checkpoint on this daemon",
                                      {"job": job})
            return complete[0]
        found = next((c for c in complete if c.step == step), None)
        if found is None:
            raise CheckpointError(
                f"job {job!r} has no complete checkpoint of step {step} on this daemon "
                f"(complete: {[c.step for c in complete] or 'none'})", {"job": job, "step": step})
        return found

    def describe(self, checkpoint: Checkpoint) -> dict[str, Any]:
        """A checkpoint as `ckpt_list` and the statistics show it."""
        now = self.clock()
        return {
            "step": checkpoint.step, "bytes": checkpoint.nbytes,
            "age_s": now - (checkpoint.committed_at or checkpoint.created),
            "complete": checkpoint.committed_at is not None,
            "ranks": sorted({rank for rank, _ in checkpoint.parts}),
        }

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        """Every job's checkpoints, complete and under way, newest first."""
        return {
            job: [self.describe(steps[s]) for s in sorted(steps, reverse=True)]
            for job, steps in sorted(self.jobs.items())
        }

    def release_all(self) -> None:
        for steps in list(self.jobs.values()):
            for checkpoint in list(steps.values()):
                self._drop(checkpoint)
