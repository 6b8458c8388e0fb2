"""Client-side mappings of daemon-owned segments.

`SegmentRegistry` remembers where each segment is mapped so that
`all_reduce` can tell, from an array's address alone, whether it already
lives in shared memory (no copy) or must be staged through a scratch segment.
Entries hold only weak references and never outlive what they describe: the
memory (an entry whose mapping or owner was collected is never located again;
tracked ones are then queued for freeing in the daemon) and the daemon session
that holds the segment (`retire`, when its client is closed or collected).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
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


@dataclasses.dataclass(eq=False)
class MappedSegment:
    """One segment's address range in this process, as long as it is valid."""

    segment_id: int
    nbytes: int
    address: int
    #: What keeps the memory alive: our mmap, or the object that owns shared memory.
    mapping: weakref.ReferenceType[object]
    #: The key (`SegmentRegistry.new_client`) of the client whose daemon session holds
    #: the segment: the daemon frees it when that session ends.  None: no such client.
    client: int | None = None
    #: Queue the segment for freeing in the daemon once `mapping` is collected.
    free_when_collected: bool = False
    #: Forgotten, dropped, retired or collected: never located again.
    released: bool = False

    def live(self) -> bool:
        """Whether the daemon's segment is still here, at `address`."""
        return not self.released and self.mapping() is not None


class SegmentRegistry:
    """Segments mapped by the clients of this process that share it, found by address.

    The daemon lets any session of a process use the segments of another
    session of the same process, as long as the owning session is open (its
    `_may_use`); so `locate` returns a segment of any client of this registry,
    but only while that client is open and the memory is mapped.  Where
    entries overlap (an address reused after a mapping went away), the newest
    live one wins.

    Entries are an immutable tuple, replaced on change: `locate` reads it
    without a lock, and a finalizer that runs (garbage collection) in the
    middle of a change cannot break an iteration.
    """

    def __init__(self) -> None:
        # Reentrant: a finalizer may run from a garbage collection under the lock.
        self._lock = threading.RLock()
        #: Oldest first.
        self._entries: tuple[MappedSegment, ...] = ()
        self._clients: set[int] = set()
        self._client_keys = itertools.count(1)
        self.collected: collections.deque[int] = collections.deque()

    def new_client(self) -> int:
        """A key for a client's segments, valid until `retire(key)`."""
        with self._lock:
            key = next(self._client_keys)
            self._clients.add(key)
            return key

    def retire(self, client: int) -> None:
        """Forget every segment of a client whose session ended (closed, or collected
        unclosed): the daemon frees them with the session, so nothing is queued."""
        with self._lock:
            self._clients.discard(client)
            for entry in self._entries:
                if entry.client == client:
                    entry.released = True
            self._prune()

    def map(
        self, segment_id: int, name: str, nbytes: int, track: bool, client: int | None = None
    ) -> mmap.mmap:
        """Map a segment of `client`'s session; with `track`, queue it for freeing
        once unreachable (without, its owner frees it: `forget`, or the session's end)."""
        mapping = map_segment(name, nbytes)
        self._register(MappedSegment(segment_id, nbytes, _base_address(mapping),
                                     weakref.ref(mapping), client, track), mapping)
        return mapping

    def adopt(
        self, segment_id: int, address: int, nbytes: int, owner: object,
        client: int | None = None,
    ) -> None:
        """Track memory this process shares with the daemon (`Client.attach`).

        `owner` (a torch storage, say) keeps it alive; once it is collected the
        segment is queued for freeing, so the daemon drops its mapping.
        """
        self._register(MappedSegment(segment_id, nbytes, address, weakref.ref(owner), client,
                                     True), owner)

    def _register(self, entry: MappedSegment, referent: object) -> None:
        with self._lock:
            if entry.client is not None and entry.client not in self._clients:
                entry.released = True  # its session is over: the daemon has freed it
                return
            for other in self._entries:  # ids are unique per daemon: an older one is stale
                if other.segment_id == entry.segment_id:
                    other.released = True
            self._entries = (*self._entries, entry)
            self._prune()
        weakref.finalize(referent, self._collect, entry)

    def _collect(self, entry: MappedSegment) -> None:
        """`entry`'s memory was collected: never locate it; free it if it is ours to free."""
        with self._lock:
            if not entry.released:
                entry.released = True
                if entry.free_when_collected:
                    self.collected.append(entry.segment_id)
            self._prune()

    def forget(self, segment_id: int) -> None:
        """Stop tracking a segment and queue it for freeing in the daemon."""
        self._release(segment_id, True)

    def drop(self, segment_id: int) -> None:
        """Stop tracking a segment the daemon frees by itself (its session closed)."""
        self._release(segment_id, False)

    def _release(self, segment_id: int, free_in_daemon: bool) -> None:
        with self._lock:
            for entry in self._entries:
                if entry.segment_id == segment_id and not entry.released:
                    entry.released = True
                    if free_in_daemon:
                        self.collected.append(segment_id)
            self._prune()

    def _prune(self) -> None:
        """Drop released entries and those whose memory is gone (the caller holds the lock)."""
        self._entries = tuple(entry for entry in self._entries if entry.live())

    def locate(self, array: np.ndarray) -> tuple[int, int] | None:
        """(segment id, byte offset) of an array inside a live mapped segment, else None."""
        start = int(array.__array_interface__["data"][0])
        end = start + array.nbytes
        for entry in reversed(self._entries):  # newest first: a stale one is older
            if entry.address <= start and end <= entry.address + entry.nbytes:
                if entry.live():
                    return entry.segment_id, start - entry.address
                with self._lock:  # its finalizer has not run yet: never located again
                    self._prune()
        return None

    def entries(self) -> list[MappedSegment]:
        """The live entries, oldest first (for statistics and tests)."""
        with self._lock:
            self._prune()
            return list(self._entries)

    def clear(self) -> None:
        """Forget every segment without freeing any (the daemon went away with them)."""
        with self._lock:
            for entry in self._entries:
                entry.released = True
            self._entries = ()


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
