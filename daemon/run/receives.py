"""Where the current step's receives of an inter-daemon schedule land.

`Expected` is one receive: the element range it fills and which parts of it
have been claimed, so a duplicate or a peer slicing differently is refused
before it corrupts the sum.  A `Placement` receives one slice straight into the
buffer as its bytes arrive over a data stream (executor.py, `place`): a copy
into its place, a reduction into a reused cache-sized chunk from a `ChunkPool`
that is combined into the buffer each time it fills.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from gradsync.daemon.backends.reduce import combine_into
from gradsync.daemon.core.interfaces import PlacedPayload
from gradsync.protocol.dtypes import ReduceOp

#: A placed reduction is received in chunks of this many bytes (cache-sized).
REDUCE_CHUNK_BYTES = 256 * 1024


class ChunkPool:
    """Reused `REDUCE_CHUNK_BYTES` buffers for placed reductions.

    A fresh chunk per placed slice cost a page fault for every 4 KiB of it
    (the allocator hands such sizes back to the kernel when they are freed): in
    a 16 MiB ring of four daemons, 42,000 faults per daemon in 5 s, now 9,000.
    A placement holds one while its payload arrives (at most one per stream).
    """

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep
        self._spare: list[np.ndarray] = []
        #: Chunks made, rather than reused.
        self.made = 0

    def take(self) -> np.ndarray:
        if self._spare:
            return self._spare.pop()
        self.made += 1
        return np.empty(REDUCE_CHUNK_BYTES, np.uint8)

    def give(self, chunk: np.ndarray) -> None:
        if len(self._spare) < self._keep:
            self._spare.append(chunk)


@dataclasses.dataclass
class Expected:
    """One receive of the current step: where it lands and what has arrived."""

    reduce: bool
    start: int
    stop: int
    got: int = 0
    #: Element ranges [begin, end) within the transfer already claimed, sorted.
    _begins: list[int] = dataclasses.field(default_factory=list)
    _ends: list[int] = dataclasses.field(default_factory=list)

    def claim(self, offset: int, count: int) -> bool:
        """Reserve elements [offset, offset + count) of this transfer; False if the
        range is empty, out of bounds, or overlaps one claimed before (a duplicate
        or a peer slicing differently: either would corrupt the sum)."""
        if count <= 0 or offset < 0 or self.start + offset + count > self.stop:
            return False
        index = bisect.bisect_right(self._begins, offset)
        if index > 0 and self._ends[index - 1] > offset:
            return False
        if index < len(self._begins) and self._begins[index] < offset + count:
            return False
        self._begins.insert(index, offset)
        self._ends.insert(index, offset + count)
        return True


class Placement(PlacedPayload):
    """Where one placed slice of the current step goes as it arrives (a `PlacedPayload`).

    Once `cancel`led (the run ended), the rest of the payload is read and
    dropped: the buffer may belong to someone else by then.  `window` and
    `advance` run once per read from the socket, so each subclass implements
    them whole rather than through a chain of helpers.
    """

    def __init__(self, expected: Expected, begin: int, target: np.ndarray) -> None:
        self.expected = expected
        self.begin = begin
        self.count = target.size
        self.nbytes = target.nbytes
        self.remaining = target.nbytes
        self._discard: memoryview | None = None

    def __len__(self) -> int:
        return self.nbytes

    def cancel(self) -> None:
        self._discard = memoryview(bytearray(min(self.remaining, REDUCE_CHUNK_BYTES) or 1))
        self._drop_target()

    def _discard_window(self) -> memoryview:
        assert self._discard is not None
        return self._discard[: min(self.remaining, self._discard.nbytes)]

    def window(self) -> memoryview:
        raise NotImplementedError

    def advance(self, count: int) -> None:
        raise NotImplementedError

    def _drop_target(self) -> None:
        raise NotImplementedError


class CopyPlacement(Placement):
    """A copy received straight into its place in the buffer."""

    def __init__(self, expected: Expected, begin: int, target: np.ndarray) -> None:
        super().__init__(expected, begin, target)
        self._bytes: memoryview | None = target.view(np.uint8).data

    def window(self) -> memoryview:
        if self._bytes is None:
            return self._discard_window()
        return self._bytes[self.nbytes - self.remaining :]

    def advance(self, count: int) -> None:
        self.remaining -= count

    def _drop_target(self) -> None:
        self._bytes = None


class ReducePlacement(Placement):
    """A reduction received chunk by chunk and combined into the buffer per chunk."""

    def __init__(
        self, expected: Expected, begin: int, target: np.ndarray, op: ReduceOp,
        chunks: ChunkPool,
    ) -> None:
        super().__init__(expected, begin, target)
        self._target: np.ndarray | None = target
        self._op = op
        self._pool = chunks
        self._whole: np.ndarray | None = chunks.take()
        itemsize = target.itemsize
        chunk = min(target.nbytes, REDUCE_CHUNK_BYTES - REDUCE_CHUNK_BYTES % itemsize)
        self._itemsize = itemsize
        #: The chunk as bytes (what the socket writes) and as elements (what is combined).
        self._chunk_bytes = self._whole[:chunk].data
        self._chunk = self._whole[:chunk].view(target.dtype)
        self._filled = 0  # bytes of the current chunk
        self._limit = chunk  # bytes the current chunk takes before it is combined
        self._done = 0  # elements combined into the target

    def _give_back(self) -> None:
        """The chunk is no longer written or read: the next placement may have it."""
        if self._whole is not None:
            self._pool.give(self._whole)
            self._whole = None

    def window(self) -> memoryview:
        if self._target is None:
            return self._discard_window()
        return self._chunk_bytes[self._filled : self._limit]

    def advance(self, count: int) -> None:
        self.remaining -= count
        target = self._target
        if target is None:
            return
        filled = self._filled + count
        if filled < self._limit:
            self._filled = filled
            return
        size = filled // self._itemsize
        first = self._done
        combine_into(target[first : first + size],
                     self._chunk if size == self._chunk.size else self._chunk[:size], self._op)
        self._done = first + size
        self._filled = 0
        self._limit = min(self._limit, self.remaining)
        if self.remaining == 0:
            self._give_back()

    def absorb(self, data: memoryview) -> int:
        """Combine whole elements of `data` into the target where they lie (an
        opened record), skipping the copy into the chunk; only between chunks."""
        target = self._target
        if target is None or self._filled:
            return 0
        count = min(data.nbytes, self.remaining) // self._itemsize
        if not count:
            return 0
        first = self._done
        combine_into(target[first : first + count],
                     np.frombuffer(data, dtype=target.dtype, count=count), self._op)
        taken = count * self._itemsize
        self._done = first + count
        self.remaining -= taken
        self._limit = min(self._chunk_bytes.nbytes, self.remaining)
        if self.remaining == 0:
            self._give_back()
        return taken

    def _drop_target(self) -> None:
        self._target = None
        self._give_back()


def remaining_of(expected: Expected) -> int:
    """Elements of an expected receive that have not arrived yet."""
    return expected.stop - expected.start - expected.got
