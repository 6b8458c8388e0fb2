"""The fast path's shared page: its layout and the rules both ends follow.

A single-node job gets one daemon-owned segment (the "fast page") with a slot
per rank.  A small synchronous allreduce skips the socket: each rank writes
its data and fingerprint into its slot, publishes its key, and once every rank
has published the same key with the same fingerprint, every rank reduces all
slots itself, in rank order, with the daemon's arithmetic (protocol/reduction.py),
so the results are bit-identical to the socket path's.  The daemon is not on
this path at all; it only reads the page (statistics) and writes to it when it
knows something the ranks must act on (a rank went to the socket with a key,
the job broke, the daemon stops).

Consistency: a key ends on the fast path only if *every* rank published it.
A rank that gives up on a key after publishing it (its deadline passed, a peer
went to the socket, the daemon is gone) *withdraws* it, and a withdrawal and
a publication are each made under the page's exclusive lock, with the
check "have all published?" inside: so either every rank sees all published
(and completes), or some rank withdrew before the last publication, which is
then refused, and every rank takes the socket path, where the daemon matches,
times out or refuses the key exactly as it always does.  A broken job (set by
the daemon, under the same lock) refuses publications the same way.

Words are int64 at 8-byte-aligned offsets (single stores); a slot's data is
written before the key that publishes it, and x86-64 shows stores to other
cores in order, so a reader that sees the key sees the data.  The bell is a
32-bit futex word bumped (under the lock) on every change a waiter cares about.

The lock is a robust process-shared mutex in the page's header, taken and
released in user space (a pair of `flock` calls cost about 0.6 us a call, a
fifth of a one-rank 4 KiB allreduce then): robust, so a holder that dies hands
it to the next taker, as the kernel releases an `flock`.  It needs the compiled
module (protocol/_fastpage.c); a daemon installed without it formats its pages
with `flock` as the lock (the header says which), and a client without it
declines a mutex page and keeps to the socket.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import mmap
import os
from collections.abc import Iterator

import numpy as np

from gradsync.protocol.dtypes import DTYPES, ReduceOp
from gradsync.protocol.futex import Futex
from gradsync.protocol.peer import ALGORITHM_CHOICES

try:  # the publish-and-spin and the page's mutex in C: optional at install, see setup.py
    from gradsync.protocol import _fastpage
except ImportError:  # built without a C compiler: Python steps, the page's flock as lock
    _fastpage = None  # type: ignore[assignment]

LAYOUT_VERSION = 2
MAGIC = 0x31687461_70667367  # b"gsfpath1", little-endian

_LINE = 64
_HEADER_BYTES = 4 * _LINE
# header words (int64 index) and the bell's byte offset
_H_MAGIC, _H_VERSION, _H_RANKS, _H_LIMIT, _H_LOCK = 0, 1, 2, 3, 4
_BELL_OFFSET = 1 * _LINE
#: Where the page's mutex lies (a line of its own), and what _H_LOCK says the lock is.
_MUTEX_OFFSET = 3 * _LINE
MUTEX, FLOCK = 1, 2
_H_SLEEPERS, _H_BROKEN, _H_STOPPING = 2 * _LINE // 8, 2 * _LINE // 8 + 1, 2 * _LINE // 8 + 2

# slot words, relative to the slot's first word: the rank's line, then the daemon's
PUBLISHED, WITHDRAWN, DONE, COMPLETED, FALLBACKS, PUBLISHED_NS = 0, 1, 2, 3, 4, 5
SOCKET = _LINE // 8
_SLOT_HEADER_BYTES = 3 * _LINE
# a buffer's header words: the key it holds, then the fingerprint (codes, count)
_B_KEY, B_CODES, B_COUNT = 0, 1, 2
_BUFFER_HEADER_BYTES = _LINE
BUFFERS_PER_SLOT = 2

_DTYPE_CODES = {name: index for index, name in enumerate(DTYPES)}
_OP_CODES = {op: index for index, op in enumerate(ReduceOp)}
_ALGORITHM_CODES: dict[str | None, int] = {
    None: 0, **{name: index + 1 for index, name in enumerate(ALGORITHM_CHOICES)}
}
_ALLREDUCE = 1
NOTHING = -1

#: How a publication ended, other than with every rank's buffer index (the values
#: protocol/_fastpage.c returns): not published (the page is broken or the key was
#: withdrawn); published, but not every rank had published by the spin's end; every
#: rank published, but some fingerprint differs.
REFUSED, WAITING, MISMATCH = -1, -2, -3
#: ... and how it ends when it reduced the result itself.
REDUCED = 1
#: ... and, from the C module given the key a buffer last held, when a peer has not
#: finished reading it yet (nothing published: wait for the peer, then publish).
BUSY = -4
#: The (dtype, op) pairs protocol/_fastpage.c reduces itself, and its codes for them
#: (0: the caller reduces in numpy, given every rank's buffer index).
FAST_REDUCTIONS: dict[tuple[str, ReduceOp], int] = {
    (dtype, op): 1 + 3 * width + index
    for width, dtype in enumerate(("float32", "float64"))
    for index, op in enumerate((ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD))
}

#: A fingerprint as stored: (kind, dtype, op and algorithm codes in one word, count).
Print = tuple[int, int]
#: (dtype, count) pairs whose buffer views a page keeps.
_VIEWS_KEPT = 64
#: Tries at the page's lock, yielding between them, before waiting for it asleep.
LOCK_TRIES = 64


def fingerprint(dtype: str, count: int, op: ReduceOp, algorithm: str | None) -> Print:
    """An allreduce's fingerprint as the page stores it (the daemon's Fingerprint fields)."""
    return _codes(dtype, op, algorithm), count


@functools.lru_cache(maxsize=256)
def _codes(dtype: str, op: ReduceOp, algorithm: str | None) -> int:
    return (_ALLREDUCE << 24 | _DTYPE_CODES[dtype] << 16 | _OP_CODES[op] << 8
            | _ALGORITHM_CODES.get(algorithm, len(_ALGORITHM_CODES)))


def _round_up(nbytes: int) -> int:
    return -(-nbytes // _LINE) * _LINE


def buffer_bytes(limit: int) -> int:
    return _BUFFER_HEADER_BYTES + _round_up(limit)


def slot_bytes(limit: int) -> int:
    return _SLOT_HEADER_BYTES + BUFFERS_PER_SLOT * buffer_bytes(limit)


def page_bytes(ranks: int, limit: int) -> int:
    """Bytes of a fast page for `ranks` ranks and data of at most `limit` bytes."""
    return _HEADER_BYTES + ranks * slot_bytes(limit)


class FastPage:
    """A mapped fast page and the descriptor its lock is taken on.

    Words are read and written through one int64 memoryview (a single aligned
    store each, and cheaper per access than numpy scalars); the index of every
    word a collective touches is computed once, here.
    """

    def __init__(self, mapping: mmap.mmap, fd: int, ranks: int, limit: int) -> None:
        if len(mapping) < page_bytes(ranks, limit):
            raise ValueError(f"fast page of {len(mapping)} bytes is too small for "
                             f"{ranks} ranks of {limit} bytes")
        self.mapping = mapping
        self.fd = fd
        self.ranks = ranks
        self.limit = limit
        self.q = memoryview(mapping)[: page_bytes(ranks, limit)].cast("q")
        slot_words, buffer_words = slot_bytes(limit) // 8, buffer_bytes(limit) // 8
        self._slots = [_HEADER_BYTES // 8 + rank * slot_words for rank in range(ranks)]
        #: Index of the first word of each rank's buffers: [rank][buffer].
        self.buffer_at = [
            [slot + _SLOT_HEADER_BYTES // 8 + index * buffer_words
             for index in range(BUFFERS_PER_SLOT)]
            for slot in self._slots
        ]
        self.published_at = [slot + PUBLISHED for slot in self._slots]
        self.withdrawn_at = [slot + WITHDRAWN for slot in self._slots]
        self.done_at = [slot + DONE for slot in self._slots]
        #: The compiled page (publish-and-spin, lock) once the lock is known: format, check.
        self.compiled: _fastpage.Page | None = None
        #: MUTEX or FLOCK, once format or check has read or written it.
        self.lock_kind = 0
        #: Header words the hot path reads directly.
        self.broken_at, self.sleepers_at = _H_BROKEN, _H_SLEEPERS
        self._bell_word = memoryview(mapping)[_BELL_OFFSET: _BELL_OFFSET + 4].cast("I")
        self.bell = Futex(mapping, _BELL_OFFSET)
        #: Typed views of every buffer's data, per (dtype, count): [rank][buffer].
        self._views: dict[tuple[np.dtype, int], list[list[np.ndarray]]] = {}

    # -- the header ---------------------------------------------------------------

    def c_layout(self, lock_kind: int) -> bytes:
        """Where the compiled module (protocol/_fastpage.c) finds every word it touches:
        int64 indices and offsets, in the order that module reads them."""
        return np.array(
            [_H_BROKEN, _H_SLEEPERS, _BELL_OFFSET, B_CODES, B_COUNT, _BUFFER_HEADER_BYTES,
             self.limit, _MUTEX_OFFSET if lock_kind == MUTEX else -1]
            + [word for rank in range(self.ranks)
               for word in (self.published_at[rank], self._slots[rank] + PUBLISHED_NS,
                            *self.buffer_at[rank], self.withdrawn_at[rank],
                            self.done_at[rank], self._slots[rank] + COMPLETED)],
            dtype=np.int64,
        ).tobytes()

    def _attach(self, lock_kind: int) -> None:
        """Take the lock the header names, through the compiled page where it was built."""
        if lock_kind not in (MUTEX, FLOCK):
            raise ValueError(f"fast page lock kind {lock_kind} is not one this client knows")
        if lock_kind == MUTEX and _fastpage is None:
            raise ValueError("the fast page's lock is a shared-memory mutex, which needs "
                             "gradsync.protocol._fastpage; this install did not build it "
                             "(reinstall with a C compiler)")
        self.lock_kind = lock_kind
        if self.compiled is not None:
            self.compiled.close()
        if _fastpage is not None:
            self.compiled = _fastpage.Page(self.q, self.c_layout(lock_kind), self.fd)

    def format(self, lock_kind: int | None = None) -> None:
        """Write a fresh page (the daemon, before any rank maps it); its lock is the
        mutex where the compiled module was built, else the flock (or `lock_kind`)."""
        lock_kind = lock_kind or (FLOCK if _fastpage is None else MUTEX)
        self._attach(lock_kind)
        q = self.q
        np.frombuffer(self.mapping, dtype=np.int64, count=len(q))[:] = 0
        for rank in range(self.ranks):
            for word in (PUBLISHED, WITHDRAWN, DONE, SOCKET):
                self.set_word(rank, word, NOTHING)
            for index in range(BUFFERS_PER_SLOT):
                q[self.buffer_at[rank][index] + _B_KEY] = NOTHING
        q[_H_VERSION] = LAYOUT_VERSION
        q[_H_RANKS] = self.ranks
        q[_H_LIMIT] = self.limit
        q[_H_LOCK] = lock_kind
        if self.compiled is not None and lock_kind == MUTEX:
            self.compiled.init_lock()
        q[_H_MAGIC] = MAGIC

    def check(self) -> None:
        """Refuse a page of another layout or shape (a client, on mapping it)."""
        q = self.q
        found = (q[_H_MAGIC], q[_H_VERSION], q[_H_RANKS], q[_H_LIMIT])
        expected = (MAGIC, LAYOUT_VERSION, self.ranks, self.limit)
        if found != expected:
            raise ValueError(f"fast page header {found} is not the expected {expected}")
        self._attach(q[_H_LOCK])

    @property
    def broken(self) -> bool:
        return bool(self.q[_H_BROKEN])

    def set_broken(self, stopping: bool = False) -> None:
        """Refuse every further publication (under the lock, then bump the bell);
        `stopping`: because the daemon stops (its socket will not answer)."""
        if stopping:
            self.q[_H_STOPPING] = 1
        self.q[_H_BROKEN] = 1

    @property
    def stopping(self) -> bool:
        return bool(self.q[_H_STOPPING])

    @property
    def sleepers(self) -> int:
        return self.q[_H_SLEEPERS]

    def add_sleeper(self, delta: int) -> None:
        """Count a waiter in or out of the bell's sleepers (under the lock)."""
        self.q[_H_SLEEPERS] += delta

    # -- locking and the bell ---------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the page's lock: tried again after yielding the core while another
        holds it (for a few stores), asleep only after LOCK_TRIES tries, as
        protocol/_fastpage.c takes it (being woken costs more than the wait)."""
        compiled = self.compiled
        if compiled is not None:
            compiled.lock()
        else:
            for _ in range(LOCK_TRIES):
                if self.try_lock():
                    break
                os.sched_yield()
            else:
                fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            self.unlock()

    def try_lock(self) -> bool:
        """Take the lock without waiting (the daemon never blocks its event loop)."""
        if self.compiled is not None:
            return self.compiled.try_lock()
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def unlock(self) -> None:
        if self.compiled is not None:
            self.compiled.unlock()
        else:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def bump_bell(self) -> None:
        """Under the lock: tell waiters something changed (then `wake` them after)."""
        self._bell_word[0] = (self._bell_word[0] + 1) & 0xFFFFFFFF

    def wake(self) -> None:
        if self.q[_H_SLEEPERS]:
            self.bell.wake_all()

    # -- slots ------------------------------------------------------------------------

    def index(self, rank: int, which: int) -> int:
        """Where a slot word lives in `q` (the hot path keeps these)."""
        return self._slots[rank] + which

    def word(self, rank: int, which: int) -> int:
        return self.q[self._slots[rank] + which]

    def set_word(self, rank: int, which: int, value: int) -> None:
        self.q[self._slots[rank] + which] = value

    def buffer_key(self, rank: int, index: int) -> int:
        return self.q[self.buffer_at[rank][index] + _B_KEY]

    def set_buffer_key(self, rank: int, index: int, key: int) -> None:
        self.q[self.buffer_at[rank][index] + _B_KEY] = key

    def views(self, dtype: np.dtype, count: int) -> list[list[np.ndarray]]:
        """Every rank's buffers as `count` elements of `dtype` (count * itemsize <= limit)."""
        views = self._views.get((dtype, count))
        if views is None:
            if len(self._views) > _VIEWS_KEPT:
                self._views.clear()
            views = [
                [np.frombuffer(self.mapping, dtype=dtype, count=count,
                               offset=at * 8 + _BUFFER_HEADER_BYTES) for at in buffers]
                for buffers in self.buffer_at
            ]
            self._views[(dtype, count)] = views
        return views

    def published_index(self, rank: int, key: int) -> int | None:
        """Which of `rank`'s buffers holds its publication of `key`, if it published it."""
        q = self.q
        if q[self.published_at[rank]] < key:
            return None
        for index, at in enumerate(self.buffer_at[rank]):
            if q[at] == key:  # the buffer's key word
                return index
        return None

    def all_published(self, key: int) -> list[int] | None:
        """Every rank's buffer index for `key` if all have published it, else None."""
        q = self.q
        indices = []
        for published, (first, second) in zip(self.published_at, self.buffer_at, strict=True):
            if q[published] < key:
                return None
            if q[first] == key:
                indices.append(0)
            elif q[second] == key:
                indices.append(1)
            else:
                return None
        return indices

    def waiting(self) -> list[tuple[int, int, list[int]]]:
        """Keys published and not yet ended: (key, CLOCK_MONOTONIC ns of the first
        publication, ranks that have not published it), for statistics and stall logs."""
        keys = {self.word(rank, PUBLISHED) for rank in range(self.ranks)
                if self.word(rank, PUBLISHED) > self.word(rank, DONE)}
        found = []
        for key in sorted(keys):
            published = [rank for rank in range(self.ranks)
                         if self.published_index(rank, key) is not None]
            if not published or len(published) == self.ranks:
                continue
            first = min(self.word(rank, PUBLISHED_NS) for rank in published)
            found.append((key, first, sorted(set(range(self.ranks)) - set(published))))
        return found

    def withdrawn(self, key: int) -> bool:
        """Whether some rank withdrew `key` (then nobody may publish it)."""
        q = self.q
        for at in self.withdrawn_at:  # noqa: SIM110 (a loop: cheaper than any() here)
            if q[at] == key:
                return True
        return False

    def close(self) -> None:
        """Drop the views into the mapping (the owner closes mapping and descriptor)."""
        if self.compiled is not None:
            self.compiled.close()
        self.bell.close()
        self._views.clear()
        self.q.release()
        self._bell_word.release()
