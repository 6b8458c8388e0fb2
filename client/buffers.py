"""Client-side mappings of daemon-owned segments.

`SegmentRegistry` remembers where each segment is mapped so that
`all_reduce` can tell, from an array's address alone, whether it already
lives in shared memory (no copy) or must be staged through a scratch segment.
Entries hold only weak references: when the last array over a segment is
collected, the segment is queued for freeing in the daemon.
"""

from __future__ import annotations

import collections
import dataclasses
import mmap
import threading
import weakref
from collections.abc import Callable

import numpy as np

from gradsync.protocol.shm import map_segment

_MIN_SCRATCH = 64 * 1024
#: A free scratch slot serves requests down to 1/_REUSE_SPAN of its capacity.
_REUSE_SPAN = 4


def _base_address(mapping: mmap.mmap) -> int:
    view = np.frombuffer(mapping, dtype=np.uint8, count=1)
    address = int(view.ctypes.data)
    del view
    return address


@dataclasses.dataclass
class Placed:
    """Where one buffer of a collective lives for the daemon, and what to do after."""

    segment: int | None
    offset: int
    on_success: Callable[[], None] | None = None
    on_finish: Callable[[], None] | None = None


@dataclasses.dataclass
class MappedSegment:
    segment_id: int
    nbytes: int
    address: int
    #: What keeps the memory alive: our mmap, or the object that owns shared memory.
    mapping: weakref.ReferenceType[object]


class SegmentRegistry:
    """Segments mapped by this client, found by address."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._segments: dict[int, MappedSegment] = {}
        self.collected: collections.deque[int] = collections.deque()

    def map(self, segment_id: int, name: str, nbytes: int, track: bool) -> mmap.mmap:
        """Map a segment; with `track`, queue it for freeing once unreachable."""
        mapping = map_segment(name, nbytes)
        entry = MappedSegment(segment_id, nbytes, _base_address(mapping), weakref.ref(mapping))
        with self._lock:
            self._segments[segment_id] = entry
        if track:
            weakref.finalize(mapping, self._forget, segment_id, True)
        return mapping

    def adopt(self, segment_id: int, address: int, nbytes: int, owner: object) -> None:
        """Track memory this process shares with the daemon (`Client.attach`).

        `owner` (a torch storage, say) keeps it alive; once it is collected the
        segment is queued for freeing, so the daemon drops its mapping.
        """
        entry = MappedSegment(segment_id, nbytes, address, weakref.ref(owner))
        with self._lock:
            self._segments[segment_id] = entry
        weakref.finalize(owner, self._forget, segment_id, True)

    def forget(self, segment_id: int) -> None:
        """Stop tracking a segment and queue it for freeing in the daemon."""
        self._forget(segment_id, True)

    def drop(self, segment_id: int) -> None:
        """Stop tracking a segment the daemon frees by itself (its session closed)."""
        self._forget(segment_id, False)

    def _forget(self, segment_id: int, free_in_daemon: bool) -> None:
        with self._lock:
            self._segments.pop(segment_id, None)
        if free_in_daemon:
            self.collected.append(segment_id)

    def locate(self, array: np.ndarray) -> tuple[int, int] | None:
        """(segment id, byte offset) of an array inside a mapped segment, else None."""
        start = int(array.__array_interface__["data"][0])
        end = start + array.nbytes
        with self._lock:
            for entry in self._segments.values():
                if entry.address <= start and end <= entry.address + entry.nbytes:
                    return entry.segment_id, start - entry.address
        return None

    def clear(self) -> None:
        with self._lock:
            self._segments.clear()


@dataclasses.dataclass
class ScratchSlot:
    segment_id: int
    capacity: int
    mapping: mmap.mmap

    def view(self, dtype: np.dtype, count: int) -> np.ndarray:
        return np.frombuffer(self.mapping, dtype=dtype, count=count)


class ScratchPool:
    """Reusable segments for staging ordinary arrays, by power-of-two capacity.

    Idle slots beyond `retain_bytes` are handed back to the daemon, so one
    all-reduce of a huge ordinary array does not pin its scratch for the
    client's lifetime.  The slot just given back is never the one released:
    the next call of the same size needs it again, and freeing it would cost a
    fresh segment (allocate, reserve, map, fault in) on every op.
    """

    def __init__(self, registry: SegmentRegistry, retain_bytes: int = 256 * 1024**2) -> None:
        self._lock = threading.Lock()
        #: Idle slots, least recently given back first.
        self._free: list[ScratchSlot] = []
        self._registry = registry
        self.retain_bytes = retain_bytes

    @staticmethod
    def capacity_for(nbytes: int) -> int:
        return max(_MIN_SCRATCH, 1 << max(0, nbytes - 1).bit_length())

    def take(self, nbytes: int) -> ScratchSlot | None:
        """The smallest free slot that fits, or None (the caller allocates one).

        A slot many times too big is left alone: reusing it would keep it the
        most recently used one, so a huge one-off slot would never be released.
        """
        needed = self.capacity_for(nbytes)
        with self._lock:
            fitting = [slot for slot in self._free
                       if needed <= slot.capacity <= _REUSE_SPAN * needed]
            if not fitting:
                return None
            best = min(fitting, key=lambda slot: slot.capacity)
            self._free.remove(best)
            return best

    def give_back(self, slot: ScratchSlot) -> None:
        with self._lock:
            self._free.append(slot)
            idle = sum(s.capacity for s in self._free)
            # Release the least recently used idle slots first, never `slot` itself.
            for victim in list(self._free[:-1]):
                if idle <= self.retain_bytes:
                    break
                self._free.remove(victim)
                idle -= victim.capacity
                self._registry.forget(victim.segment_id)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
