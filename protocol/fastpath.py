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
a publication are each made under an exclusive `flock` of the page, with the
check "have all published?" inside: so either every rank sees all published
(and completes), or some rank withdrew before the last publication, which is
then refused, and every rank takes the socket path, where the daemon matches,
times out or refuses the key exactly as it always does.  A broken job (set by
the daemon, under the same lock) refuses publications the same way.

Words are int64 at 8-byte-aligned offsets (single stores); a slot's data is
written before the key that publishes it, and x86-64 shows stores to other
cores in order, so a reader that sees the key sees the data.  The bell is a
32-bit futex word bumped (under the lock) on every change a waiter cares about.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
from collections.abc import Iterator

import numpy as np

from gradsync.protocol.dtypes import DTYPES, ReduceOp
from gradsync.protocol.futex import Futex
from gradsync.protocol.peer import ALGORITHM_CHOICES

LAYOUT_VERSION = 1
MAGIC = 0x31687461_70667367  # b"gsfpath1", little-endian
#: Default largest allreduce (in bytes) that takes the fast path.
DEFAULT_LIMIT_BYTES = 64 * 1024

_LINE = 64
_HEADER_BYTES = 4 * _LINE
# header words (int64 index) and the bell's byte offset
_H_MAGIC, _H_VERSION, _H_RANKS, _H_LIMIT = 0, 1, 2, 3
_BELL_OFFSET = 1 * _LINE
_H_SLEEPERS, _H_BROKEN, _H_STOPPING = 2 * _LINE // 8, 2 * _LINE // 8 + 1, 2 * _LINE // 8 + 2

# slot words, relative to the slot's first word: the rank's line, then the daemon's
PUBLISHED, WITHDRAWN, DONE, COMPLETED, FALLBACKS = 0, 1, 2, 3, 4
SOCKET = _LINE // 8
_SLOT_HEADER_BYTES = 3 * _LINE
# a buffer's header words: the key it holds, then the fingerprint
_B_KEY, _B_KIND, _B_DTYPE, _B_COUNT, _B_OP, _B_ALGORITHM = 0, 1, 2, 3, 4, 5
_BUFFER_HEADER_BYTES = _LINE
BUFFERS_PER_SLOT = 2

_DTYPE_CODES = {name: index for index, name in enumerate(DTYPES)}
_OP_CODES = {op: index for index, op in enumerate(ReduceOp)}
_ALGORITHM_CODES: dict[str | None, int] = {
    None: 0, **{name: index + 1 for index, name in enumerate(ALGORITHM_CHOICES)}
}
_ALLREDUCE = 1
NOTHING = -1

#: A fingerprint as stored: (kind, dtype, count, op, algorithm) codes.
Print = tuple[int, int, int, int, int]


def fingerprint(dtype: str, count: int, op: ReduceOp, algorithm: str | None) -> Print:
    """An allreduce's fingerprint as the page stores it (the daemon's Fingerprint fields)."""
    return (_ALLREDUCE, _DTYPE_CODES[dtype], count, _OP_CODES[op],
            _ALGORITHM_CODES.get(algorithm, len(_ALGORITHM_CODES)))


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
    """A mapped fast page and the descriptor its lock is taken on."""

    def __init__(self, mapping: mmap.mmap, fd: int, ranks: int, limit: int) -> None:
        if len(mapping) < page_bytes(ranks, limit):
            raise ValueError(f"fast page of {len(mapping)} bytes is too small for "
                             f"{ranks} ranks of {limit} bytes")
        self.mapping = mapping
        self.fd = fd
        self.ranks = ranks
        self.limit = limit
        self.words = np.frombuffer(mapping, dtype=np.int64,
                                   count=page_bytes(ranks, limit) // 8)
        self._slot_words = slot_bytes(limit) // 8
        self._buffer_words = buffer_bytes(limit) // 8
        self._bell_word = np.frombuffer(mapping, dtype=np.uint32, count=1, offset=_BELL_OFFSET)
        self.bell = Futex(mapping, _BELL_OFFSET)

    # -- the header ---------------------------------------------------------------

    def format(self) -> None:
        """Write a fresh page (the daemon, before any rank maps it)."""
        self.words[:] = 0
        for rank in range(self.ranks):
            base = self._slot(rank)
            for word in (PUBLISHED, WITHDRAWN, DONE, SOCKET):
                self.words[base + word] = NOTHING
            for index in range(BUFFERS_PER_SLOT):
                self.words[self._buffer(rank, index) + _B_KEY] = NOTHING
        self.words[_H_VERSION] = LAYOUT_VERSION
        self.words[_H_RANKS] = self.ranks
        self.words[_H_LIMIT] = self.limit
        self.words[_H_MAGIC] = MAGIC

    def check(self) -> None:
        """Refuse a page of another layout or shape (a client, on mapping it)."""
        found = (int(self.words[_H_MAGIC]), int(self.words[_H_VERSION]),
                 int(self.words[_H_RANKS]), int(self.words[_H_LIMIT]))
        expected = (MAGIC, LAYOUT_VERSION, self.ranks, self.limit)
        if found != expected:
            raise ValueError(f"fast page header {found} is not the expected {expected}")

    @property
    def broken(self) -> bool:
        return bool(self.words[_H_BROKEN])

    def set_broken(self, stopping: bool = False) -> None:
        """Refuse every further publication (under the lock, then bump the bell);
        `stopping`: because the daemon stops (its socket will not answer)."""
        if stopping:
            self.words[_H_STOPPING] = 1
        self.words[_H_BROKEN] = 1

    @property
    def stopping(self) -> bool:
        return bool(self.words[_H_STOPPING])

    @property
    def sleepers(self) -> int:
        return int(self.words[_H_SLEEPERS])

    def add_sleeper(self, delta: int) -> None:
        """Count a waiter in or out of the bell's sleepers (under the lock)."""
        self.words[_H_SLEEPERS] += delta

    # -- locking and the bell ---------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def try_lock(self) -> bool:
        """Take the lock without waiting (the daemon never blocks its event loop)."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def bump_bell(self) -> None:
        """Under the lock: tell waiters something changed (then `wake` them after)."""
        self._bell_word[0] = (int(self._bell_word[0]) + 1) & 0xFFFFFFFF

    def wake(self) -> None:
        if self.sleepers:
            self.bell.wake_all()

    # -- slots ------------------------------------------------------------------------

    def _slot(self, rank: int) -> int:
        return _HEADER_BYTES // 8 + rank * self._slot_words

    def _buffer(self, rank: int, index: int) -> int:
        return self._slot(rank) + _SLOT_HEADER_BYTES // 8 + index * self._buffer_words

    def word(self, rank: int, which: int) -> int:
        return int(self.words[self._slot(rank) + which])

    def set_word(self, rank: int, which: int, value: int) -> None:
        self.words[self._slot(rank) + which] = value

    def buffer_key(self, rank: int, index: int) -> int:
        return int(self.words[self._buffer(rank, index) + _B_KEY])

    def set_buffer_key(self, rank: int, index: int, key: int) -> None:
        self.words[self._buffer(rank, index) + _B_KEY] = key

    def buffer_print(self, rank: int, index: int) -> Print:
        base = self._buffer(rank, index)
        kind, dtype, count, op, algorithm = (int(w) for w in self.words[base + 1: base + 6])
        return kind, dtype, count, op, algorithm

    def set_buffer_print(self, rank: int, index: int, value: Print) -> None:
        base = self._buffer(rank, index)
        self.words[base + 1: base + 6] = value

    def data(self, rank: int, index: int, dtype: np.dtype, count: int) -> np.ndarray:
        """`count` elements of `dtype` in a rank's buffer (count * itemsize <= limit)."""
        offset = (self._buffer(rank, index) * 8) + _BUFFER_HEADER_BYTES
        return np.frombuffer(self.mapping, dtype=dtype, count=count, offset=offset)

    def published_index(self, rank: int, key: int) -> int | None:
        """Which of `rank`'s buffers holds its publication of `key`, if it published it."""
        if self.word(rank, PUBLISHED) < key:
            return None
        for index in range(BUFFERS_PER_SLOT):
            if self.buffer_key(rank, index) == key:
                return index
        return None

    def all_published(self, key: int) -> list[int] | None:
        """Every rank's buffer index for `key` if all have published it, else None."""
        indices = []
        for rank in range(self.ranks):
            index = self.published_index(rank, key)
            if index is None:
                return None
            indices.append(index)
        return indices

    def withdrawn(self, key: int) -> bool:
        """Whether some rank withdrew `key` (then nobody may publish it)."""
        return any(self.word(rank, WITHDRAWN) == key for rank in range(self.ranks))

    def close(self) -> None:
        """Drop the views into the mapping (the owner closes mapping and descriptor)."""
        self.bell.close()
        del self.words, self._bell_word
