"""Every buffer the daemon owns, whatever memory it lives in.

`Buffers` numbers slabs of all backends from one counter and finds the
backend of a slab by its id.  The host backend always exists; the CUDA
backend is built on the first device allocation, so a daemon that never sees
one never imports cupy.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping
from typing import Any

from gradsync.daemon.backends.base import Backend, Slab
from gradsync.daemon.backends.host import HostBackend
from gradsync.daemon.backends.shm_pool import ShmPool
from gradsync.protocol.errors import InvalidArgumentError, ShmExhaustedError

log = logging.getLogger("gradsync.daemon.buffers")

__all__ = ["Backend", "Buffers", "Slab"]


class Buffers:
    """The slabs of one daemon, with one byte budget over all backends."""

    def __init__(self, max_bytes: int, shm_mode: int = 0o600) -> None:
        self.max_bytes = max_bytes
        self.host = HostBackend(ShmPool(max_bytes, mode=shm_mode))
        self._cuda: Backend | None = None
        self._cuda_error: str | None = None
        self._ids = itertools.count(1)
        self._slabs: dict[int, Slab] = {}

    @property
    def in_use(self) -> int:
        return self.host.in_use + (self._cuda.in_use if self._cuda is not None else 0)

    def __len__(self) -> int:
        return len(self._slabs)

    def get(self, segment_id: int) -> Slab | None:
        return self._slabs.get(segment_id)

    def allocate(self, nbytes: int, owner: str, request: Mapping[str, Any]) -> Slab:
        """A slab of at least `nbytes` in host memory, or on `request["device"]`."""
        device = request.get("device")
        backend = self.host if device is None else self.cuda()
        self._check_sum(nbytes, owner, "host" if backend is self.host else "device")
        slab = backend.allocate(next(self._ids), nbytes, owner, request)
        self._slabs[slab.segment_id] = slab
        return slab

    def _check_sum(self, nbytes: int, owner: str, kind: str) -> None:
        """The host pool checks its own bytes; once device memory is in use too,
        every allocation is checked against the sum."""
        if self._cuda is not None and self.in_use + nbytes > self.max_bytes:
            raise ShmExhaustedError(
                f"allocating {nbytes} bytes of {kind} memory for {owner} would exceed "
                f"max_shm_bytes={self.max_bytes} ({self.in_use} in use); raise "
                "--max-shm-bytes",
                {"requested": nbytes, "in_use": self.in_use, "limit": self.max_bytes},
            )

    def allocate_unreserved(self, nbytes: int, owner: str) -> tuple[Slab, Callable[[], None]]:
        """A host slab whose pages are reserved by the `reserve` returned, which the
        caller runs (off the event loop) before the slab is written: see
        `ShmPool.allocate_unreserved`."""
        self._check_sum(nbytes, owner, "host")
        slab, reserve = self.host.allocate_unreserved(next(self._ids), nbytes, owner)
        self._slabs[slab.segment_id] = slab
        return slab, reserve

    def attach(self, path: str, nbytes: int, owner: str) -> Slab:
        """A host slab over memory a client already shares (not counted in the budget)."""
        slab = self.host.attach(next(self._ids), path, nbytes, owner)
        self._slabs[slab.segment_id] = slab
        return slab

    def adopt(self, name: str, nbytes: int, owner: str) -> Slab:
        """A host slab over segment `name` that a dead daemon left (a checkpoint's part);
        at start-up, before any device memory, so the host pool's budget is the check."""
        slab = self.host.adopt(next(self._ids), name, nbytes, owner)
        self._slabs[slab.segment_id] = slab
        return slab

    def detach(self, segment_id: int) -> str | None:
        """Stop using a host slab but leave its segment for a later daemon; its name."""
        slab = self._slabs.get(segment_id)
        if slab is None or slab.backend is not self.host:
            return None
        del self._slabs[segment_id]
        return self.host.pool.detach(segment_id)

    @property
    def attached(self) -> int:
        """Bytes of client memory the daemon maps (`attach`)."""
        return self.host.pool.attached

    def release(self, segment_id: int,
                unmap_on: Callable[[Callable[[], None]], object] | None = None) -> None:
        """Release a slab; a host slab's unmapping (where its pages are freed) runs
        through `unmap_on` where given (see `ShmPool.release`)."""
        slab = self._slabs.pop(segment_id, None)
        if slab is None:
            return
        if unmap_on is not None and slab.backend is self.host:
            self.host.pool.release(segment_id, unmap_on)
        else:
            slab.backend.release(slab)

    def release_all(self) -> None:
        for segment_id in list(self._slabs):
            self.release(segment_id)
        if self._cuda is not None:
            self._cuda.close()

    def cuda(self) -> Backend:
        """The CUDA backend, built on first use; a clear error where it cannot work."""
        if self._cuda is not None:
            return self._cuda
        if self._cuda_error is None:
            try:
                from gradsync.daemon.backends.cuda import CudaBackend
                self._cuda = CudaBackend()
                return self._cuda
            except InvalidArgumentError as exc:
                self._cuda_error = exc.message
            except Exception as exc:  # a driver or runtime failure while setting up
                self._cuda_error = f"CUDA set-up failed: {type(exc).__name__}: {exc}"
            log.warning("device buffers unavailable: %s", self._cuda_error)
        raise InvalidArgumentError(f"this daemon cannot serve device buffers: {self._cuda_error}")
