"""The daemon's side of the shared-memory fast path (protocol/fast_path.py).

Each single-node job gets a fast page when it forms; its ranks then run small
synchronous allreduces among themselves.  The daemon only keeps the page
honest: it notes which key each rank sent over the socket (so that waiting
ranks follow it there), breaks the page when the job breaks or the daemon
stops (so that waiting ranks come to the socket and get the job's error),
and reads the ranks' counters for the statistics.  It never waits on the
page's lock: when a rank holds it, the daemon retries a moment later.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import Any

from gradsync.daemon.backends import Buffers, Slab
from gradsync.protocol import futex
from gradsync.protocol.fast_path import (
    COMPLETED,
    FALLBACKS,
    LAYOUT_VERSION,
    SOCKET,
    WITHDRAWN,
    FastPage,
    page_bytes,
)
from gradsync.protocol.shm import segment_path

log = logging.getLogger("gradsync.daemon")

#: How soon the daemon tries again for a page whose lock a rank holds.
_LOCK_RETRY_S = 0.0002
#: How long `close_all` (the daemon stopping) tries for each page's lock.
_STOP_LOCK_S = 0.5
#: Stall reports remembered (so each key is reported once).
_STALLS_KEPT = 4096


@dataclasses.dataclass
class _Entry:
    job_name: str
    slab: Slab
    page: FastPage


class FastPages:
    """The fast pages of one daemon's single-node jobs, by job name."""

    def __init__(self, buffers: Buffers, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        self.buffers = buffers
        self.limit = limit if futex.supported() else 0
        self.loop = loop
        self._pages: dict[str, _Entry] = {}
        #: Counters of pages already released (jobs that ended).
        self._retired_collectives = 0
        self._retired_fallbacks = 0
        self._stalls_reported: set[tuple[str, int]] = set()

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def create(self, job_name: str, ranks: int, owner: str) -> dict[str, Any] | None:
        """A fresh page for a job that forms; what its clients need to map it."""
        if not self.enabled:
            return None
        nbytes = page_bytes(ranks, self.limit)
        slab = self.buffers.allocate(nbytes, f"the fast page of {owner}", {})
        segment = slab.handle  # a host segment: its name and mapping
        fd = os.open(segment_path(segment.name), os.O_RDWR | os.O_CLOEXEC)
        page = FastPage(segment.mapping, fd, ranks, self.limit)
        page.format()
        self._pages[job_name] = _Entry(job_name, slab, page)
        return self.describe(job_name)

    def describe(self, job_name: str) -> dict[str, Any] | None:
        entry = self._pages.get(job_name)
        if entry is None:
            return None
        return {"name": entry.slab.handle.name,
                "nbytes": entry.slab.nbytes, "limit": entry.page.limit,
                "layout": LAYOUT_VERSION}

    def note_socket(self, job_name: str, rank: int, key: Any) -> None:
        """A rank sent `key` over the socket: waiters on the page follow it there."""
        entry = self._pages.get(job_name)
        if entry is None or not isinstance(key, int) or not 0 <= rank < entry.page.ranks:
            return
        page = entry.page
        if key > page.word(rank, SOCKET):
            page.set_word(rank, SOCKET, key)
        # The bell only for sleepers, and only if the lock is free: a rank holding it
        # rings the bell itself.  (A sleeper that this misses wakes within SLEEP_S.)
        if page.sleepers and page.try_lock():
            try:
                page.bump_bell()
            finally:
                page.unlock()
            page.wake()

    def waiting(self, job_name: str) -> list[tuple[int, float, list[int]]]:
        """Keys some ranks of the job wait for on its page: (key, seconds since the
        first published it, ranks that have not)."""
        entry = self._pages.get(job_name)
        if entry is None:
            return []
        now = time.monotonic_ns()
        return [(key, (now - first) / 1e9, missing)
                for key, first, missing in entry.page.waiting()]

    def report_stalls(self, job_name: str, limit_s: float, describe: str, absent: int) -> None:
        """Log, once per key, one that waited on the page longer than `limit_s`."""
        for key, age_s, missing in self.waiting(job_name):
            if age_s <= limit_s or (job_name, key) in self._stalls_reported:
                continue
            if len(self._stalls_reported) > _STALLS_KEPT:
                self._stalls_reported.clear()
            self._stalls_reported.add((job_name, key))
            log.warning("key %r of %s has waited %.0fs for ranks %s%s (on the fast path)",
                        key, describe, age_s, missing,
                        f" ({absent} local ranks not connected)" if absent else "")

    def fast_ranks(self, job_name: str, key: Any) -> set[int]:
        """Ranks that published (or withdrew) `key` on the page: they are on their way."""
        entry = self._pages.get(job_name)
        if entry is None or not isinstance(key, int):
            return set()
        page = entry.page
        return {
            rank for rank in range(page.ranks)
            if page.published_index(rank, key) is not None
            or page.word(rank, WITHDRAWN) == key
        }

    def break_job(self, job_name: str) -> None:
        """Refuse further publications: every waiting rank goes to the socket."""
        entry = self._pages.get(job_name)
        if entry is not None:
            self._break(entry)

    def _break(self, entry: _Entry) -> None:
        if entry.page.broken or self._pages.get(entry.job_name) is not entry:
            return  # broken already, or released (a job of the same name may be newer)
        if not entry.page.try_lock():
            self.loop.call_later(_LOCK_RETRY_S, self._break, entry)
            return
        self._set_broken(entry.page)

    @staticmethod
    def _set_broken(page: FastPage, stopping: bool = False) -> None:
        try:
            page.set_broken(stopping)
            page.bump_bell()
        finally:
            page.unlock()
        page.wake()

    def job_counts(self, job_name: str) -> tuple[int, int] | None:
        """(collectives completed, collectives that left for the socket) on a job's page."""
        entry = self._pages.get(job_name)
        return None if entry is None else self._counts(entry.page)

    def release(self, job_name: str) -> tuple[int, int]:
        """The job ended: unmap and unlink its page; what was counted on it."""
        entry = self._pages.pop(job_name, None)
        if entry is None:
            return 0, 0
        collectives, fallbacks = self._counts(entry.page)
        self._retired_collectives += collectives
        self._retired_fallbacks += fallbacks
        os.close(entry.page.fd)
        entry.page.close()
        self.buffers.release(entry.slab.segment_id)
        return collectives, fallbacks

    def close_all(self) -> None:
        """The daemon stops: break every page (waiting for a rank's lock briefly)."""
        for job_name, entry in list(self._pages.items()):
            deadline = time.monotonic() + _STOP_LOCK_S
            while not entry.page.try_lock():
                if time.monotonic() > deadline:
                    log.warning("fast page of job %r stayed locked; stopping anyway", job_name)
                    break
                time.sleep(_LOCK_RETRY_S)
            else:
                self._set_broken(entry.page, stopping=True)
            self.release(job_name)

    @staticmethod
    def _counts(page: FastPage) -> tuple[int, int]:
        """(collectives completed on the page, collectives that left it for the socket).

        Every rank counts each collective it ran; the most any rank counted
        is the job's (a rank that left early counted fewer).
        """
        collectives = max((page.word(r, COMPLETED) for r in range(page.ranks)), default=0)
        fallbacks = max((page.word(r, FALLBACKS) for r in range(page.ranks)), default=0)
        return collectives, fallbacks

    def counters(self) -> dict[str, int]:
        collectives, fallbacks = self._retired_collectives, self._retired_fallbacks
        for entry in self._pages.values():
            done, left = self._counts(entry.page)
            collectives += done
            fallbacks += left
        return {"fast_path_collectives": collectives, "fast_path_fallbacks": fallbacks,
                "fast_path_jobs": len(self._pages)}
