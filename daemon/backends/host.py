"""The host backend: POSIX shared-memory segments, numpy reductions on the CPU."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from gradsync.daemon.backends.base import Slab
from gradsync.daemon.backends.reduce import reduce_range
from gradsync.daemon.backends.shm_pool import ShmPool
from gradsync.protocol.dtypes import ReduceOp


class HostBackend:
    """Slabs are shm segments (see shm_pool.py); views are numpy arrays."""

    kind = "host"
    parallel_ranges = True

    def __init__(self, pool: ShmPool) -> None:
        self.pool = pool

    @property
    def in_use(self) -> int:
        return self.pool.in_use

    def allocate(
        self, segment_id: int, nbytes: int, owner: str, request: Mapping[str, Any]
    ) -> Slab:
        segment = self.pool.allocate(nbytes, owner, segment_id)
        return Slab(segment_id, segment.nbytes, owner, self, segment)

    def allocate_unreserved(
        self, segment_id: int, nbytes: int, owner: str
    ) -> tuple[Slab, Callable[[], None]]:
        """A slab whose pages the returned `reserve` reserves (see
        `ShmPool.allocate_unreserved`)."""
        segment, reserve = self.pool.allocate_unreserved(nbytes, owner, segment_id)
        return Slab(segment_id, segment.nbytes, owner, self, segment), reserve

    def attach(self, segment_id: int, path: str, nbytes: int, owner: str) -> Slab:
        """A slab over memory the client shares (see `ShmPool.attach`)."""
        segment = self.pool.attach(path, nbytes, owner, segment_id)
        return Slab(segment_id, segment.nbytes, owner, self, segment)

    def adopt(self, segment_id: int, name: str, nbytes: int, owner: str) -> Slab:
        """A slab over a segment a dead daemon left (see `ShmPool.adopt`)."""
        segment = self.pool.adopt(name, nbytes, owner, segment_id)
        return Slab(segment_id, segment.nbytes, owner, self, segment)

    def export(self, slab: Slab) -> dict[str, Any]:
        return {"name": slab.handle.name}

    def release(self, slab: Slab) -> None:
        # Unlinking is safe at once: views in use keep the daemon's mapping alive.
        self.pool.release(slab.segment_id)

    def view(self, slab: Slab, offset: int, count: int, dtype: np.dtype) -> Any:
        return slab.handle.view(offset, count, dtype)

    def reduce(self, slots: Sequence[Any], op: ReduceOp, dtype: str, start: int,
               stop: int) -> None:
        reduce_range(slots, op, start, stop)

    def running(self, slabs: Sequence[Slab]) -> AbstractContextManager[None]:
        """Nothing to order: a client submits after its CPU writes, and the reply
        tells it the data is ready."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Nothing pending: segments are unlinked as they are released."""

    def to_host(
        self, views: Sequence[Any], dtype: np.dtype
    ) -> tuple[list[Any], Callable[[], Callable[[], None]]]:
        return list(views), _copied


def _copied() -> Callable[[], None]:
    return _nothing


def _nothing() -> None:
    pass
