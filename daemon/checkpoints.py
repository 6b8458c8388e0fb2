"""Checkpoints in daemon memory: each job's newest complete ones (issue 50, part 1).

A checkpoint is (job, step); each rank puts its parts (`item`s) into segments
the daemon creates and owns, so they outlive the trainer processes.  A
checkpoint can be opened only once it is committed (torch DCP's coordinator
commits in `finish()`, after every rank's write results are in): a save that
dies midway leaves the previous complete checkpoint as the newest.  Per job
the last `kept` complete checkpoints stay; a commit drops older ones and the
unfinished saves they supersede.  The bytes count against `max_shm_bytes` like
every other segment: a part that does not fit is an error for that save only.

Complete checkpoints also outlive the daemon (part 4): every commit rewrites
the manifest (checkpoint_manifest.py) that a daemon restarted on the same
socket reads at start-up (`take_over`) to adopt their segments.  At a clean
exit they are released, unless the daemon runs with `checkpoints_survive_exit`.

The job name is the scope: only sessions of the job may put, commit, list or
open its checkpoints (io/service.py checks who asks).  The daemon never reads
the data; its clients write and read it through their own mappings.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from gradsync.daemon.backends import Buffers, Slab
from gradsync.daemon.backends.shm_pool import pid_alive
from gradsync.daemon.checkpoint_manifest import (
    ManifestFile,
    SavedCheckpoint,
    SavedPart,
    plan_adoption,
    remove_segments,
    segment_size,
)
from gradsync.protocol.errors import CheckpointError, GradsyncError, ShmExhaustedError

log = logging.getLogger("gradsync.daemon.checkpoints")


@dataclasses.dataclass
class Checkpoint:
    """One (job, step): its parts by (rank, item), and whether it is complete."""

    job: str
    step: int
    created: float
    parts: dict[tuple[int, str], Slab] = dataclasses.field(default_factory=dict)
    committed_at: float | None = None
    #: The commit's wall-clock time (Unix seconds), for the manifest.
    committed_unix: float = 0.0
    #: The pid of the dead daemon this checkpoint was taken over from.
    adopted_from: int | None = None
    #: Every part of the step, on whatever daemon (set at the commit; the parts
    #: here where empty: a checkpoint taken over, whose manifest lists only those).
    all_parts: frozenset[tuple[int, str]] = frozenset()
    #: Per peer daemon, the parts of this daemon it confirmed holding as replicas.
    replicas: dict[str, set[tuple[int, str]]] = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(slab.nbytes for slab in self.parts.values())

    def describe(self) -> str:
        return f"checkpoint step {self.step} of job {self.job!r}"

    @property
    def every_part(self) -> frozenset[tuple[int, str]]:
        """All parts of the step: those held here when nothing else is known."""
        return self.all_parts or frozenset(self.parts)

    def replicated_on(self) -> list[str]:
        """The peers that confirmed a replica of every part held here."""
        return sorted(peer for peer, held in self.replicas.items() if held >= set(self.parts))


class CheckpointStore:
    """Every job's checkpoints on this daemon, allocated from `buffers`."""

    def __init__(self, buffers: Buffers, kept: int,
                 clock: Callable[[], float] = time.monotonic,
                 manifest: ManifestFile | None = None) -> None:
        self.buffers = buffers
        self.kept = kept
        self.clock = clock
        self.jobs: dict[str, dict[int, Checkpoint]] = {}
        #: Where the complete checkpoints are listed for a successor (None: nowhere).
        self.manifest = manifest

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

    def commit(self, job: str, step: int, parts: tuple[tuple[int, str], ...],
               elsewhere: frozenset[tuple[int, str]] = frozenset()) -> Checkpoint:
        """Mark (job, step) complete once every part in `parts` is in (but those
        `elsewhere`: held by peer daemons, as the committer checked); prune the job."""
        checkpoint = self.jobs.get(job, {}).get(step)
        if checkpoint is None:
            raise CheckpointError(f"no parts of checkpoint step {step} of job {job!r} were put "
                                  "(a rank's save failed, or the daemon restarted)",
                                  {"job": job, "step": step})
        missing = sorted(set(parts) - set(checkpoint.parts) - elsewhere)
        if missing:
            raise CheckpointError(
                f"{checkpoint.describe()} cannot be committed: parts {missing[:8]} "
                f"(rank, item) were never put", {"job": job, "step": step})
        extra = set(checkpoint.parts) - set(parts)
        for key in extra:  # left by an earlier try of this step: not part of it
            self.buffers.release(checkpoint.parts.pop(key).segment_id)
        if checkpoint.committed_at is None:
            checkpoint.committed_at = self.clock()
            checkpoint.committed_unix = time.time()
        checkpoint.all_parts = frozenset(parts)
        self._prune(job)
        self._publish()
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
        described = {
            "step": checkpoint.step, "bytes": checkpoint.nbytes,
            "age_s": now - (checkpoint.committed_at or checkpoint.created),
            "complete": checkpoint.committed_at is not None,
            "ranks": sorted({rank for rank, _ in checkpoint.parts}),
        }
        if checkpoint.adopted_from is not None:
            described["adopted_from"] = checkpoint.adopted_from
        if checkpoint.replicas:
            described["replicas"] = checkpoint.replicated_on()
        return described

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

    def close(self, keep: bool) -> None:
        """At a clean exit: release every checkpoint, or with `keep` leave the complete
        ones, and the manifest that lists them, to the next daemon on this socket."""
        if not keep or self.manifest is None:
            self.release_all()
            if self.manifest is not None:
                self.manifest.remove()
            return
        for steps in list(self.jobs.values()):
            for checkpoint in [c for c in steps.values() if c.committed_at is None]:
                self._drop(checkpoint)
        self._publish()
        complete = [c for steps in self.jobs.values() for c in steps.values()]
        for checkpoint in complete:
            for slab in checkpoint.parts.values():
                self.buffers.detach(slab.segment_id)
        self.jobs.clear()
        if complete:
            log.info("leaving %d complete checkpoints (%d bytes) to the next daemon on "
                     "this socket (%s)", len(complete), sum(c.nbytes for c in complete),
                     self.manifest.path)

    # -- the manifest and the takeover --------------------------------------------

    def _publish(self) -> None:
        """Rewrite the manifest: every complete checkpoint, as `ckpt_open` serves it."""
        if self.manifest is not None:
            self.manifest.write(tuple(
                _saved(c) for steps in self.jobs.values() for c in steps.values()
                if c.committed_at is not None))

    def take_over(self) -> None:
        """At start-up: adopt the complete checkpoints that a dead daemon on this
        socket listed; drop (and unlink) those that are damaged or do not fit."""
        manifest = self.manifest.load() if self.manifest is not None else None
        if manifest is None or self.manifest is None:
            return
        if manifest.pid == os.getpid() or pid_alive(manifest.pid):
            log.warning("not taking over the checkpoints listed in %s: their daemon (pid %d) "
                        "still runs", self.manifest.path, manifest.pid)
            return
        plan = plan_adoption(manifest, segment_size(self.manifest.shm_dir),
                             self.buffers.max_bytes - self.buffers.in_use)
        for saved, why in plan.dropped:
            log.error("dropping %s left by gradsyncd pid %d (segments %s): %s",
                      saved.describe(), manifest.pid, [p.name for p in saved.parts], why)
            remove_segments((p.name for p in saved.parts), self.manifest.shm_dir)
        adopted = [c for c in plan.adopt if self._adopt(c, manifest.pid)]
        for job in list(self.jobs):
            self._prune(job)
        self._publish()
        if adopted:
            log.info("took over %d checkpoints (%d bytes) left by gradsyncd pid %d: %s",
                     len(adopted), sum(c.nbytes for c in adopted), manifest.pid,
                     ", ".join(c.describe() for c in adopted))

    def _adopt(self, saved: SavedCheckpoint, pid: int) -> bool:
        """Take over one complete checkpoint's segments; on any failure, none of them."""
        checkpoint = Checkpoint(saved.job, saved.step, self.clock(),
                                committed_unix=saved.committed_unix, adopted_from=pid,
                                all_parts=frozenset((p.rank, p.item) for p in saved.parts)
                                | frozenset(saved.elsewhere))
        # Its age goes on from the commit, whatever this daemon's clock says.
        checkpoint.committed_at = checkpoint.created - max(0.0, time.time() - saved.committed_unix)
        self.jobs.setdefault(saved.job, {})[saved.step] = checkpoint
        for part in saved.parts:
            owner = f"{saved.describe()}, rank {part.rank}, item {part.item!r}"
            try:
                checkpoint.parts[(part.rank, part.item)] = self.buffers.adopt(
                    part.name, part.nbytes, owner)
            except (OSError, ValueError, GradsyncError) as exc:
                log.error("dropping %s left by gradsyncd pid %d: taking over segment %s "
                          "failed: %s", saved.describe(), pid, part.name, exc)
                self._drop(checkpoint)
                remove_segments(p.name for p in saved.parts)
                return False
        return True


def _saved(checkpoint: Checkpoint) -> SavedCheckpoint:
    """A complete checkpoint as the manifest lists it."""
    parts = tuple(SavedPart(rank, item, slab.backend.export(slab)["name"], slab.nbytes)
                  for (rank, item), slab in sorted(checkpoint.parts.items()))
    elsewhere = tuple(sorted(checkpoint.every_part - set(checkpoint.parts)))
    return SavedCheckpoint(checkpoint.job, checkpoint.step, checkpoint.committed_unix, parts,
                           elsewhere)
