"""Checkpoints kept in the daemon's memory, for any framework (torch DCP: see
`gradsync.client.torch.checkpoint`).

A checkpoint is (job, step): each rank puts its parts into segments the
daemon creates and owns (they outlive this process), writes them through its
own mapping, and one rank commits the step once every rank's parts are in.
Only committed checkpoints can be opened; the daemon keeps each job's newest
few (`--checkpoints-kept`).  Only sessions of the job itself may use them:
a `Client` of the checkpoints' job, or one from `checkpoint_client(job, rank)`.

A part is written through a mapping whose page tables are filled in one go, not
page by page on first touch (`map_populated`).  The daemon's reply to a put
names the segment it set aside for the same part's next save
(daemon/checkpoints.py, "spares"); once this save's copy is done
(`premap_next`, also after a commit), that segment is mapped, and so its pages
faulted in, on a background thread while training goes on, and the next put of
the same size gets it mapped.  The written part is unmapped on that thread too
(`close_later`).  Both run a few MiB at a time without the GIL
(client/_checkpoint_memory.c): Python's own MAP_POPULATE keeps the GIL for the
whole population, and one munmap of a populated mapping holds the process's
memory map, each about 40 ms per 100 MiB in which the trainer's other threads
(DCP's collectives after a save, the next step's Python) would wait.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import mmap
import os
import threading
from typing import Any

from gradsync.client.client import Client
from gradsync.protocol.requests import checkpoint_session_job, parse_checkpoint_session_job
from gradsync.protocol.shm import segment_path

try:  # the compiled copy and page-table steps; without a C compiler at install, Python's
    from gradsync.client import _checkpoint_memory as _checkpoint_memory  # torch's too
except ImportError:  # pragma: no cover - the install built it (tests/test_checkpoint_memory.py)
    _checkpoint_memory = None  # type: ignore[assignment]

_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux; elsewhere pages fault in on use
#: Page tables are filled and emptied this many bytes at a time (each step holds the
#: process's memory map for well under a millisecond).
PAGE_TABLE_STEP = 4 * 1024**2
_premapper: concurrent.futures.ThreadPoolExecutor | None = None
_premapper_lock = threading.Lock()


def map_populated(name: str, nbytes: int) -> mmap.mmap:
    """Map a daemon segment read-write with its pages faulted in and mapped now."""
    fd = os.open(segment_path(name), os.O_RDWR | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"segment {name} holds {size} bytes, expected {nbytes}")
        if _checkpoint_memory is not None:
            mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if _checkpoint_memory.populate(mapping, PAGE_TABLE_STEP):
                return mapping
            mapping.close()  # a kernel before 5.14: MAP_POPULATE, with the GIL held
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED | _MAP_POPULATE,
                         mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _background() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that maps and unmaps checkpoint parts (mmap and munmap drop the
    GIL; one thread, so that they never contend for the process's memory map)."""
    global _premapper
    with _premapper_lock:
        if _premapper is None:
            _premapper = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="gradsync-checkpoint-mapper")
        return _premapper


def _premap(name: str, nbytes: int) -> concurrent.futures.Future[mmap.mmap]:
    """`map_populated` in the background."""
    return _background().submit(map_populated, name, nbytes)


def _close(mapping: mmap.mmap) -> None:
    """Unmap, its page tables emptied first a step at a time (see the module docstring)."""
    with contextlib.suppress(BufferError):  # a view survived an error: GC frees it
        if _checkpoint_memory is not None and not mapping.closed:
            _checkpoint_memory.drop_pages(mapping, PAGE_TABLE_STEP)
        mapping.close()


@dataclasses.dataclass
class _Spare:
    """The segment the daemon set aside for a part's next save, and its mapping here
    (None until `premap_next` starts it)."""

    name: str
    nbytes: int
    mapping: concurrent.futures.Future[mmap.mmap] | None = None

    def take(self) -> mmap.mmap | None:
        """The mapping (waiting for it if need be); None if it was never started or
        failed (the daemon released the spare meanwhile: its room was wanted)."""
        if self.mapping is None:
            return None
        try:
            return self.mapping.result()
        except (OSError, ValueError):
            return None

    def drop(self) -> None:
        if self.mapping is not None:
            self.mapping.add_done_callback(_close_mapping)


def _close_mapping(future: concurrent.futures.Future[mmap.mmap]) -> None:
    if future.exception() is None:
        _close(future.result())


def checkpoint_client(job: str, rank: int, daemon: str | None = None) -> Client:
    """A client that stores rank `rank`'s checkpoints of `job`: a session of its own
    (job `checkpoint:JOB#RANK`, world size 1), so that no rank lost elsewhere ends it."""
    return Client(daemon=daemon, job=checkpoint_session_job(job, rank), rank=0, world_size=1,
                  local_rank=0, local_world_size=1)


@dataclasses.dataclass
class OpenedCheckpoint:
    """A complete checkpoint, mapped: its parts by (rank, item)."""

    step: int
    parts: dict[tuple[int, str], mmap.mmap]


class DaemonCheckpoints:
    """Put, commit, list and open the checkpoints of `client`'s job on its daemon."""

    def __init__(self, client: Client, job: str | None = None) -> None:
        self.client = client
        scope = parse_checkpoint_session_job(client.job)
        #: The checkpoints' job (by default the client's), and the rank whose parts
        #: this client puts.  The daemon refuses a job that is not the client's.
        self.job, self.rank = scope if scope is not None else (client.job, client.rank)
        self.job = job or self.job
        #: Per item: the daemon's spare for its next put, mapped in the background.
        self._spares: dict[str, _Spare] = {}
        #: Written parts to unmap in the background (`close_later`).
        self._written: list[mmap.mmap] = []

    def put(self, step: int, item: str, nbytes: int) -> mmap.mmap:
        """A daemon-owned segment of at least `nbytes` for this rank's `item` of `step`,
        mapped here to be written.  Over the daemon's budget: `ShmExhaustedError`."""
        spare = self._spares.pop(item, None)
        try:
            reply = self.client.call("ckpt_put", job=self.job, step=step, item=item,
                                     nbytes=max(1, nbytes))
        except BaseException:
            if spare is not None:
                spare.drop()
            raise
        name, size = reply["name"], reply["nbytes"]
        mapping = None
        if spare is not None and (spare.name, spare.nbytes) == (name, size):
            mapping = spare.take()
        elif spare is not None:
            spare.drop()
        if mapping is None:
            mapping = map_populated(name, size)
        if reply.get("spare"):
            self._spares[item] = _Spare(*reply["spare"])
        return mapping

    def close_later(self, mapping: mmap.mmap) -> None:
        """Unmap a written part in the background, at `premap_next`: tearing down a big
        mapping's page tables takes as long as filling them in."""
        self._written.append(mapping)

    def premap_next(self) -> None:
        """In the background: unmap the parts written (`close_later`), then map the
        segments the next puts will get.  Call it once the save no longer waits (after
        the commit): while the kernel fills or clears page tables, this process's
        other calls that touch its memory map (mmap, faults on new memory) wait."""
        written, self._written = self._written, []
        for mapping in written:
            _background().submit(_close, mapping)
        for spare in self._spares.values():
            if spare.mapping is None:
                spare.mapping = _premap(spare.name, spare.nbytes)

    def commit(self, step: int, parts: list[tuple[int, str]]) -> dict[str, Any]:
        """Mark `step` complete: every (rank, item) in `parts` was put and written."""
        reply = self.client.call("ckpt_commit", job=self.job, step=step,
                                 parts=[[rank, item] for rank, item in parts])
        self.premap_next()
        return reply

    def list(self) -> list[dict[str, Any]]:
        """The complete checkpoints (step, bytes, age_s, ranks), newest first."""
        return list(self.client.call("ckpt_list", job=self.job)["checkpoints"])

    def open(self, step: int | None = None) -> OpenedCheckpoint:
        """Map complete checkpoint `step` (None: the newest) for reading.  The mappings
        stay valid even if the daemon drops the checkpoint meanwhile."""
        reply = self.client.call("ckpt_open", job=self.job, step=step)
        parts = {(rank, item): map_populated(name, nbytes)
                 for rank, item, name, nbytes in reply["parts"]}
        return OpenedCheckpoint(int(reply["step"]), parts)
