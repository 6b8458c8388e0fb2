"""A rank's side of the shared-memory fast path (the rules: protocol/fast_path.py).

A small synchronous allreduce of a single-node job runs here, without the
socket: write the data into this rank's slot, publish the key, wait (a short
spin, then asleep on the page's futex) until every rank has published it,
and reduce all slots in rank order into the caller's array.  The publication
and the spin (and the reduction, for float sums, averages and products) run
in C, protocol/_fastpage.c, where the install built it; the same steps in
Python otherwise (or with GRADSYNC_FAST_PATH=python).  Whenever the key
cannot end here (a peer sent it over the socket, a fingerprint differs, the
job broke, the deadline passed, the daemon went away) the rank withdraws it
and the caller sends it over the socket, where the daemon gives the answer it
always gives: so errors are the socket path's, word for word.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from gradsync.client.connection import Connection
from gradsync.protocol.dtypes import ReduceOp
from gradsync.protocol.fast_path import (
    B_CODES,
    B_COUNT,
    BUFFERS_PER_SLOT,
    BUSY,
    COMPLETED,
    DONE,
    FALLBACKS,
    FAST_REDUCTIONS,
    LAYOUT_VERSION,
    MISMATCH,
    NOTHING,
    PUBLISHED,
    PUBLISHED_NS,
    REDUCED,
    REFUSED,
    SOCKET,
    WAITING,
    WITHDRAWN,
    FastPage,
    Print,
    fingerprint,
    page_bytes,
)
from gradsync.protocol.reduction import reduce_in_rank_order
from gradsync.protocol.shm import segment_path

#: How long a waiting rank spins (giving up its core at every look) before it
#: sleeps on the futex.  Yielding, because two spinners may share one core (more
#: ranks than cores, or the scheduler's placement): a plain spin then holds the
#: core its peer needs until the time slice ends.  Measured: benchmarks/RESULTS.md,
#: "Doorbells" (a yielding spin: 3 us round trip on two cores, 10 us on one).
SPIN_S = 200e-6
#: The spin of a rank whose publication woke a sleeping peer: long enough to
#: cover that peer's wake-up (on a VM, waking an idle vCPU can take hundreds of
#: microseconds), or the two would take turns sleeping, one wake-up per op.
WAKER_SPIN_S = 2e-3
_SPIN_NS, _WAKER_SPIN_NS = round(SPIN_S * 1e9), round(WAKER_SPIN_S * 1e9)
#: The longest single sleep: between sleeps a waiter checks its deadline and the daemon.
SLEEP_S = 0.01
#: Looks for the common ending between two looks at the clock and the rest.
_SPIN_CHECKS = 16
#: Polling steps while waiting for peers to finish reading a buffer about to be reused.
_REUSE_POLL_S = (20e-6, 1e-3)


@dataclasses.dataclass(frozen=True, slots=True)
class PageCall:
    """An allreduce's checked description, as the page takes it: what the socket path
    needs if the page gives it up (dtype, op, count), the fingerprint's codes, and
    which reduction the compiled module makes (0: numpy, by the caller)."""

    dtype: str
    op: ReduceOp
    count: int
    codes: int
    reduction: int

    @classmethod
    def of(cls, dtype: str, op: ReduceOp, count: int, algorithm: str | None) -> PageCall:
        codes, _ = fingerprint(dtype, count, op, algorithm)
        return cls(dtype, op, count, codes, FAST_REDUCTIONS.get((dtype, op), 0))

    @property
    def fingerprint(self) -> Print:
        return self.codes, self.count


class FastPath:
    """One client's use of its job's fast page."""

    def __init__(
        self, connection: Connection, rank: int, ranks: int, offer: Mapping[str, Any]
    ) -> None:
        if offer.get("layout") != LAYOUT_VERSION:
            raise ValueError(f"fast page layout {offer.get('layout')!r}, this client "
                             f"knows {LAYOUT_VERSION}")
        name, nbytes, limit = str(offer["name"]), int(offer["nbytes"]), int(offer["limit"])
        if nbytes < page_bytes(ranks, limit):
            raise ValueError(f"fast page of {nbytes} bytes is too small")
        fd = os.open(segment_path(name), os.O_RDWR | os.O_CLOEXEC)
        try:
            mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.page = FastPage(mapping, fd, ranks, limit)
            self.page.check()
        except BaseException:
            os.close(fd)
            raise
        self._mapping = mapping
        self._connection = connection
        self.rank = rank
        self.limit = limit
        #: Held for a whole fast collective: one rank publishes its keys in order.
        self.lock = threading.Lock()
        self._next = 0
        #: Per buffer: the key last published from it, and whether peers read it then.
        self._buffers: list[tuple[int, bool]] = [(NOTHING, False)] * BUFFERS_PER_SLOT
        page = self.page
        self._published_at = page.index(rank, PUBLISHED)
        self._done_at = page.index(rank, DONE)
        self._published_ns_at = page.index(rank, PUBLISHED_NS)
        self._completed_at = page.index(rank, COMPLETED)
        self._key_at = page.buffer_at[rank]  # a buffer's first word is its key
        self._peer_done_at = [at for r, at in enumerate(page.done_at) if r != rank]
        #: The compiled publish-and-spin, unless not built or GRADSYNC_FAST_PATH=python.
        self._compiled = (None if os.environ.get("GRADSYNC_FAST_PATH") == "python"
                          else page.compiled)

    def close(self) -> None:
        page = self.page
        page.close()
        os.close(page.fd)
        self._mapping.close()

    # -- one collective -------------------------------------------------------------

    def all_reduce(
        self, array: np.ndarray, call: PageCall, key: int, timeout_s: float
    ) -> float | None:
        """Reduce `array` in place on the page: None when done, else the seconds
        waited before the key must go over the socket (call with `lock` held)."""
        started = time.monotonic()
        page = self.page
        index = self._next
        last_key, read = self._buffers[index]
        compiled = self._compiled
        if compiled is not None:
            while True:
                outcome = compiled.publish(
                    self.rank, index, key, call.codes, call.count, array, call.reduction,
                    _SPIN_NS, _WAKER_SPIN_NS, last_key if read else NOTHING,
                )
                if outcome == REDUCED:  # the common ending: every rank came within the spin
                    self._next = index ^ 1
                    self._buffers[index] = (key, True)
                    return None
                if outcome != BUSY:
                    break
                # A peer still reads this buffer (its last key): wait for it, then again.
                if not self._reusable(index, started + timeout_s):
                    return self._left(started, key)
                read = False
        elif page.q[page.broken_at] or (read and not (
            self._peers_done(last_key) or self._reusable(index, started + timeout_s)
        )):
            return self._left(started, key)
        else:
            outcome = self._publish(array.reshape(-1), call.fingerprint, key, index)
        if outcome == REFUSED:
            return self._left(started, key)
        self._next = index ^ 1
        self._buffers[index] = (key, False)
        if outcome == WAITING:
            indices = self._wait(key, started + timeout_s)
            if indices is None:
                return self._left(started, key)
            outcome = indices if self._prints_match(indices, call.fingerprint) else MISMATCH
        self._buffers[index] = (key, True)  # peers read it (or its fingerprint)
        if isinstance(outcome, int):  # MISMATCH: every rank sees it, all go to the socket
            return self._left(started, key)
        flat = array.reshape(-1)
        views = page.views(flat.dtype, flat.size)
        reduce_in_rank_order(flat, [views[rank][i] for rank, i in enumerate(outcome)], call.op)
        page.q[self._done_at] = key
        page.q[self._completed_at] += 1
        return None

    def _publish(
        self, flat: np.ndarray, fingerprint: Print, key: int, index: int
    ) -> list[int] | int:
        """Publish `key` from buffer `index` and spin for the others: protocol/_fastpage.c's
        steps in Python, for where that module was not built.  Every rank's buffer index,
        or REFUSED, WAITING or MISMATCH."""
        page, q = self.page, self.page.q
        np.copyto(page.views(flat.dtype, flat.size)[self.rank][index], flat)
        at = self._key_at[index]  # the buffer's words: key, fingerprint codes, count
        q[at + B_CODES], q[at + B_COUNT] = fingerprint
        # (A daemon that died is noticed by a rank that has to wait: _wait.)
        with page.locked():
            refused = q[page.broken_at] or page.withdrawn(key)
            if not refused:
                q[at] = key
                q[self._published_ns_at] = time.monotonic_ns()
                q[self._published_at] = key
                page.bump_bell()
        if refused:
            return REFUSED
        woke = q[page.sleepers_at] > 0
        if woke:
            page.bell.wake_all()
        indices = page.all_published(key) or self._spin(key, WAKER_SPIN_S if woke else SPIN_S)
        if indices is None:
            return WAITING
        return indices if self._prints_match(indices, fingerprint) else MISMATCH

    def _prints_match(self, indices: list[int], fingerprint: Print) -> bool:
        """Whether every rank's publication carries this rank's fingerprint."""
        q, codes, count = self.page.q, *fingerprint
        for rank, i in enumerate(indices):
            other = self.page.buffer_at[rank][i]
            if q[other + B_CODES] != codes or q[other + B_COUNT] != count:
                return False
        return True

    def _left(self, started: float, key: int) -> float:
        """The key leaves the page: note it, say how long it waited here."""
        page, me = self.page, self.rank
        page.set_word(me, DONE, max(key, page.word(me, DONE)))
        page.set_word(me, FALLBACKS, page.word(me, FALLBACKS) + 1)
        return time.monotonic() - started

    # -- waiting ----------------------------------------------------------------------

    def _spin(self, key: int, spin_s: float) -> list[int] | None:
        """Every rank's buffer index if all publish `key` within `spin_s` (yielding the
        core between looks); None when the time is up, the page broke or `key` was withdrawn."""
        page = self.page
        spin_until = time.monotonic() + spin_s
        while time.monotonic() < spin_until:  # only the common ending
            for _ in range(_SPIN_CHECKS):
                indices = page.all_published(key)
                if indices is not None:
                    return indices
                os.sched_yield()
            if page.broken or page.withdrawn(key):
                break
        return None

    def _wait(self, key: int, deadline: float) -> list[int] | None:
        """After the spin: every rank's buffer index once all published `key`, asleep on
        the bell between looks; None if it cannot end here."""
        page = self.page
        sleeping = False
        try:
            while True:
                bell = page.bell.value  # before the checks: a change after them rings it
                indices = page.all_published(key)
                if indices is not None:
                    return indices
                if page.withdrawn(key):
                    return None  # withdrawn while not all had published: never will
                if page.broken:
                    # Publications may have completed just before the break (the daemon
                    # sets it without looking); none can follow it, so look once more.
                    return page.all_published(key)
                now = time.monotonic()
                if now >= deadline or self._peer_left(key) or (
                    sleeping and self._connection.daemon_gone()
                ):
                    return self._withdraw(key)
                if not sleeping:
                    with page.locked():
                        page.add_sleeper(1)
                    sleeping = True
                    continue  # look once more before sleeping: a change may predate this
                page.bell.wait(bell, min(SLEEP_S, deadline - now))
        finally:
            if sleeping:
                with page.locked():
                    page.add_sleeper(-1)

    def _peer_left(self, key: int) -> bool:
        """A peer that moved on without publishing `key`: it took the socket."""
        page = self.page
        for rank in range(page.ranks):
            if rank == self.rank or page.published_index(rank, key) is not None:
                continue
            if page.word(rank, SOCKET) >= key or page.word(rank, PUBLISHED) > key:
                return True
        return False

    def _withdraw(self, key: int) -> list[int] | None:
        """Take `key` back, unless every rank has published it meanwhile."""
        page, me = self.page, self.rank
        with page.locked():
            indices = page.all_published(key)
            if indices is None:
                page.set_word(me, WITHDRAWN, key)
                # Unpublish too: a later reader must not take this buffer for `key`.
                for index in range(BUFFERS_PER_SLOT):
                    if page.buffer_key(me, index) == key:
                        page.set_buffer_key(me, index, NOTHING)
                        self._buffers[index] = (NOTHING, False)
                page.bump_bell()
        page.wake()
        return indices

    def _peers_done(self, key: int) -> bool:
        """Whether every peer has finished with `key` (so this rank's buffer is free)."""
        q = self.page.q
        for at in self._peer_done_at:  # noqa: SIM110 (a loop: cheaper than all() here)
            if q[at] < key:
                return False
        return True

    def _reusable(self, index: int, deadline: float) -> bool:
        """Whether this rank's buffer `index` is free to write (peers done reading it)."""
        key, read = self._buffers[index]
        if not read:
            return True
        page, delay = self.page, _REUSE_POLL_S[0]
        while True:
            if self._peers_done(key):
                self._buffers[index] = (NOTHING, False)
                return True
            if page.broken or time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, _REUSE_POLL_S[1])


def offered_fast_path(
    connection: Connection, rank: int, world_size: int, local_world_size: int, offer: Any
) -> FastPath | None:
    """Map the fast page a daemon's welcome offers (single-node jobs); None: sockets only.

    `GRADSYNC_FAST_PATH=0` turns it off for this process; `=python` keeps it but runs
    its steps in Python rather than in the compiled module (for comparison and tests).
    """
    if not isinstance(offer, dict) or os.environ.get("GRADSYNC_FAST_PATH", "1") == "0":
        return None
    if world_size != local_world_size:
        return None
    try:
        return FastPath(connection, rank, world_size, offer)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"gradsync: not using the shared-memory fast path: {exc}",
                      RuntimeWarning, stacklevel=4)
        return None
