"""The buffer backend seam: what differs between host and device buffers.

Matching, scheduling, deadlines and failure handling are the same for every
buffer.  A backend only allocates and exports slabs, maps typed views onto
them, reduces across views, orders its work after the clients' (and theirs
after its own), and stages views through host memory for the peer links.
Views are numpy arrays on the host backend and cupy arrays on the CUDA
backend; the collectives' copy and combine steps (`np.copyto`, `np.add(...,
out=...)`) go through numpy's dispatch protocols, which hand cupy arrays to
cupy's kernels, so `collectives.run_local` serves both unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

from gradsync.protocol.dtypes import ReduceOp


@dataclasses.dataclass(eq=False)
class Slab:
    """One daemon-owned buffer that a client maps: a shm segment or a device allocation."""

    segment_id: int
    nbytes: int
    owner: str  # who asked for it, for error messages and stats
    backend: Backend
    #: The backend's own handle (an mmap, or a device allocation record).
    handle: Any
    device: int | None = None

    def view(self, offset: int, count: int, dtype: np.dtype) -> Any:
        """A typed view of `count` elements at `offset` (bounds checked by the caller)."""
        return self.backend.view(self, offset, count, dtype)


class Backend(Protocol):
    """Allocate / map / reduce / copy for one kind of memory."""

    #: "host" or "cuda": also the name clients use.
    kind: str
    @property
    def in_use(self) -> int:
        """Bytes held by live slabs."""
    #: Whether reductions may be cut into ranges run on the daemon's thread pool.
    parallel_ranges: bool

    def allocate(
        self, segment_id: int, nbytes: int, owner: str, request: Mapping[str, Any]
    ) -> Slab:
        """A new slab; `request` holds the client's alloc fields (device, events)."""

    def export(self, slab: Slab) -> dict[str, Any]:
        """What the client needs to map the slab, for the alloc reply."""

    def release(self, slab: Slab) -> None:
        """Give the slab's memory back once nothing in the daemon uses it any more."""

    def view(self, slab: Slab, offset: int, count: int, dtype: np.dtype) -> Any:
        """A typed array over part of the slab."""

    def reduce(self, slots: Sequence[Any], op: ReduceOp, dtype: str, start: int,
               stop: int) -> None:
        """Reduce elements [start, stop) of every slot and write the result to all."""

    def running(self, slabs: Sequence[Slab]) -> AbstractContextManager[None]:
        """Around the kernels of one collective on `slabs`: order them after the
        clients' work on the slabs, and the clients' next work after them."""

    def close(self) -> None:
        """After every slab was released: finish pending work, free what is left."""

    def to_host(
        self, views: Sequence[Any], dtype: np.dtype
    ) -> tuple[list[Any], Callable[[], Callable[[], None]]]:
        """Host arrays of `dtype` with the views' contents (device views of bfloat16
        are uint16: the host copy has the real type), and `copy_back`.

        `to_host` may block until the copies are done: call it off the loop.
        `copy_back()` only queues the copies back (call it inside `running`, on
        the loop) and returns `wait`, which blocks until they are done and the
        host arrays can go (call it off the loop)."""
