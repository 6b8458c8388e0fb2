"""Checkpoints in daemon memory: each job's newest complete ones (issue 50, part 1).

A checkpoint is (job, step); each rank puts its parts (`item`s) into segments
the daemon creates and owns, so they outlive the trainer processes.  A
checkpoint can be opened only once it is committed (torch DCP's coordinator
commits in `finish()`, after every rank's write results are in): a save that
dies midway leaves the previous complete checkpoint as the newest.  Per job
the last `kept` complete checkpoints stay; a commit drops older ones and the
unfinished saves they supersede.  The bytes count against `max_shm_bytes` like
every other segment: a part that does not fit is an error for that save only.

Spares: writing a save into fresh pages costs the kernel allocating and zeroing
them, several times the copy itself, and freeing the pruned checkpoint's pages
costs as much again.  So neither happens while a save waits: a commit's pruning
and the making of spares run once it has been answered (`settle`).  A spare is a
segment set aside for a (job, rank, item)'s next save, sized as its part in the
newest commit; up to two wait per part, so that the reply to each `put` can name
the segment the *next* put will get: the client maps that one (MAP_POPULATE,
which also faults its pages in) in the background once its copy is done, and its
next save of the same size is written into pages that already exist and are
mapped.  A spare is made only where the budget has room for it beside
everything else, and spares are released first when anything does not fit:
they never make a save fail.  They are no checkpoints: not listed, not in the
manifest, released when the session of their rank ends and at every exit.

In the daemon neither costs its event loop either (`background`, a thread of its
own): a spare's pages are reserved there (the kernel allocating and zeroing
them, about 0.25 s per GiB), and the pruned segments are unmapped there (where
the kernel frees them, about 0.1 s per GiB).  A put that gets a spare whose
pages are still being reserved waits for that, within `RESERVE_WAIT_S`: the
daemon awaits it (`reservation_for`) before the put, so its loop never does.

Complete checkpoints also outlive the daemon (part 4): every commit rewrites
the manifest (checkpoint_manifest.py) that a daemon restarted on the same
socket reads at start-up (`take_over`) to adopt their segments.  At a clean
exit they are released, unless the daemon runs with `checkpoints_survive_exit`.

The job name is the scope: only sessions of the job may put, commit, list or
open its checkpoints (io/service.py checks who asks).  The daemon never reads
the data; its clients write and read it through their own mappings.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import mmap
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

#: Spares set aside per part: the one the next put gets, and the one its reply names.
_SPARES = 2
#: The longest a put (or a release wanting the room) waits for a spare's pages to be
#: reserved; past it the spare is dropped and the put gets fresh pages.
RESERVE_WAIT_S = 30.0


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
                 manifest: ManifestFile | None = None,
                 background: concurrent.futures.Executor | None = None) -> None:
        self.buffers = buffers
        #: Where spares' pages are reserved and pruned segments unmapped (None: inline).
        self.background = background
        #: Spares whose pages are being reserved there, by segment id.
        self._reserving: dict[int, concurrent.futures.Future[None]] = {}
        self.kept = kept
        self.clock = clock
        self.jobs: dict[str, dict[int, Checkpoint]] = {}
        #: Where the complete checkpoints are listed for a successor (None: nowhere).
        self.manifest = manifest
        #: Per (job, rank, item): segments set aside for that part's next saves.
        self.spares: dict[tuple[str, int, str], list[Slab]] = {}
        #: Work a commit leaves to `settle`: segments to release, spares to make.
        self._unused: list[Slab] = []
        self._to_spare: dict[tuple[str, int, str], int] = {}
        self._setting_aside = False
        # Any allocation that does not fit (a checkpoint's, a replica's, a gradient
        # slot's) first takes the spares' room.
        buffers.host.pool.on_exhausted(self._give_way)

    def put(self, job: str, step: int, rank: int, item: str, nbytes: int,
            wait_s: float | None = None) -> Slab:
        """A segment for `item` of `rank` in (job, step): the part's spare where it
        has the size (and its pages are reserved, waiting up to `wait_s`, by default
        `RESERVE_WAIT_S`, for that),
        else a fresh one; a part put again (a save retried after a crash) replaces
        the old one.  The spare the next put gets: `spare_for`."""
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
        spares = self.spares.pop((job, rank, item), [])
        wait_s = RESERVE_WAIT_S if wait_s is None else wait_s
        if spares and spares[0].nbytes == _pages(nbytes) and self._reserved(spares[0], wait_s):
            slab = spares.pop(0)
            slab.owner = owner
            checkpoint.parts[(rank, item)] = slab
            if spares:
                self.spares[(job, rank, item)] = spares
            return slab
        self._release_spares(spares)  # sized for another save: give their room to this one
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

    def spare_for(self, job: str, rank: int, item: str) -> Slab | None:
        """The segment the part's next save will get, if one is set aside."""
        spares = self.spares.get((job, rank, item))
        return spares[0] if spares else None

    def reservation_for(self, job: str, rank: int, item: str,
                        nbytes: int) -> concurrent.futures.Future[None] | None:
        """The reservation a put of this part would wait for: its spare's pages still
        being reserved (None: nothing to wait for)."""
        spares = self.spares.get((job, rank, item))
        if not spares or spares[0].nbytes != _pages(nbytes):
            return None
        future = self._reserving.get(spares[0].segment_id)
        return None if future is None or future.done() else future

    def _reserved(self, spare: Slab, wait_s: float) -> bool:
        """Whether the spare's pages are reserved, once its reservation (if under
        way) is done, within `wait_s`; a spare whose reservation failed or is not
        done by then is released."""
        future = self._reserving.pop(spare.segment_id, None)
        if future is None:
            return True
        try:
            future.result(timeout=wait_s)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError,
                OSError, GradsyncError) as exc:
            log.warning("not using %s: reserving its pages failed (%s)", spare.owner,
                        str(exc) or f"still under way after {wait_s:g} s")
            self.buffers.release(spare.segment_id)
            return False
        return True

    def _release_spares(self, spares: list[Slab], wait: bool = True) -> None:
        """Release these spares.  Where any was still being reserved and `wait` (their
        room is wanted now), wait for that, bounded, so that /dev/shm has it back."""
        pending = [f for f in (self._reserving.pop(s.segment_id, None) for s in spares) if f]
        for spare in spares:
            self.buffers.release(spare.segment_id)
        if pending and wait:
            concurrent.futures.wait(pending, timeout=RESERVE_WAIT_S)

    def settle(self) -> None:
        """What commits left for after their reply: release the pruned checkpoints'
        segments, then top up the spares of the parts just committed."""
        unused, self._unused = self._unused, []
        unmap_on = self.background.submit if self.background is not None else None
        for slab in unused:
            self.buffers.release(slab.segment_id, unmap_on)
        to_spare, self._to_spare = self._to_spare, {}
        # Every part's next spare first, then the one after: on the background thread
        # each rank's next put waits for no other rank's second spare.
        for wanted in range(1, _SPARES + 1):
            for key, nbytes in to_spare.items():
                spares = self.spares.setdefault(key, [])
                if len(spares) < wanted:
                    self._set_aside(key, nbytes, spares)
        for key in to_spare:
            if not self.spares.get(key):
                self.spares.pop(key, None)

    def _set_aside(self, key: tuple[str, int, str], nbytes: int, spares: list[Slab]) -> bool:
        """One more spare of `nbytes` for the part, where the budget has room for it
        without releasing anything (a spare is worth less than any other segment)."""
        if spares and spares[0].nbytes != nbytes:
            # No need to wait for their reservations: the thread does this spare's after.
            self._release_spares(spares, wait=False)
            spares.clear()
        if self.buffers.in_use + nbytes > self.buffers.max_bytes:
            return False
        job, rank, item = key
        owner = f"a spare for the next checkpoint of job {job!r}, rank {rank}, item {item!r}"
        self._setting_aside = True  # a spare takes no one's room, not even a spare's
        try:
            if self.background is None:
                spares.append(self.buffers.allocate(nbytes, owner, {}))
            else:
                spare, reserve = self.buffers.allocate_unreserved(nbytes, owner)
                self._reserving[spare.segment_id] = self.background.submit(reserve)
                spares.append(spare)
        except ShmExhaustedError as exc:  # /dev/shm itself is full: no spare, no error
            log.debug("no spare segment: %s", exc)
            return False
        finally:
            self._setting_aside = False
        return True

    def _give_way(self) -> bool:
        """Release what is only nice to have: pruned segments not yet released, the
        spares; whether there was any."""
        if self._setting_aside:
            return False
        unused, self._unused = self._unused, []
        for slab in unused:
            self.buffers.release(slab.segment_id)
        return self.release_spares() or bool(unused)

    def release_spares(self, job: str | None = None, rank: int | None = None) -> bool:
        """Release the spares (their room is wanted), or those of `rank` of `job` (its
        session ended: no next save is coming soon); whether there were any."""
        keys = [key for key in self.spares
                if job is None or (key[0] == job and (rank is None or key[1] == rank))]
        for key in keys:  # a session's end need not wait for the reservations
            self._release_spares(self.spares.pop(key), wait=job is None)
        if job is None:  # nothing more to make for now either
            self._to_spare.clear()
        return bool(keys)

    def _allocate(self, job: str, step: int, nbytes: int, owner: str) -> Slab:
        """Allocate (the spares give way first: `_give_way`); when still out of
        room, drop the job's unfinished saves older than `step` (saves a crash
        abandoned: they can never complete) and try again."""
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
               elsewhere: frozenset[tuple[int, str]] = frozenset(),
               settle: bool = True) -> Checkpoint:
        """Mark (job, step) complete once every part in `parts` is in (but those
        `elsewhere`: held by peer daemons, as the committer checked); prune the job.
        With `settle` False, freeing the pruned segments and making spares wait for
        `settle()` (the caller answers first)."""
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
        self._prune(job, later=True)
        self._publish()
        for (rank, item), slab in checkpoint.parts.items():
            self._to_spare[(job, rank, item)] = slab.nbytes
        if settle:
            self.settle()
        return checkpoint

    def _prune(self, job: str, later: bool = False) -> None:
        steps = self.jobs.get(job, {})
        complete = sorted((s for s, c in steps.items() if c.committed_at is not None),
                          reverse=True)
        newest = complete[0] if complete else None
        doomed = [steps[s] for s in complete[self.kept:]]
        doomed += [c for s, c in steps.items()
                   if c.committed_at is None and newest is not None and s < newest]
        for checkpoint in doomed:
            self._drop(checkpoint, later)

    def _drop(self, checkpoint: Checkpoint, later: bool = False) -> None:
        """Forget a checkpoint; its segments are released now, or with `later` at the
        next `settle`."""
        for slab in checkpoint.parts.values():
            if later:
                self._unused.append(slab)
            else:
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
        self._give_way()
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
        self._give_way()
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


def _pages(nbytes: int) -> int:
    """`nbytes` rounded up to whole pages, as the segments are sized."""
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def _saved(checkpoint: Checkpoint) -> SavedCheckpoint:
    """A complete checkpoint as the manifest lists it."""
    parts = tuple(SavedPart(rank, item, slab.backend.export(slab)["name"], slab.nbytes)
                  for (rank, item), slab in sorted(checkpoint.parts.items()))
    elsewhere = tuple(sorted(checkpoint.every_part - set(checkpoint.parts)))
    return SavedCheckpoint(checkpoint.job, checkpoint.step, checkpoint.committed_unix, parts,
                           elsewhere)
