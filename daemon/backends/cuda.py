"""The CUDA backend: device memory shared with CUDA IPC, reductions with cupy.

Slabs are raw `cudaMalloc` allocations (never cupy's memory pool: an IPC
handle names a whole allocation, and the pool sub-allocates), exported with
`cudaIpcGetMemHandle`; the handle reaches the client only over the local
socket.  Ordering needs no host stall on either side: each slab has two
interprocess events.  The client's event (opened here once per slab) is
recorded after the kernels that produced the data, and the daemon's stream
waits on it before reducing; the daemon's event is recorded after its
kernels, and the client's stream waits on it before anything reads the
result.  One non-blocking stream per device does all of the daemon's work,
so work on one slab is ordered.  Memory is freed only after the daemon's
queued kernels on it are done (an event per pending free), and only when its
importer let go: the client closes its handle before it asks to free, and a
dead client's handles died with it.

This module is imported on the first device allocation only; a daemon that
serves host buffers never imports cupy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from gradsync.daemon.backends.base import Slab
from gradsync.protocol.dtypes import ReduceOp
from gradsync.protocol.errors import InvalidArgumentError, ShmExhaustedError

log = logging.getLogger("gradsync.daemon.cuda")

_EVENT_FLAGS = 0x02 | 0x04  # cudaEventDisableTiming | cudaEventInterprocess
_PLAIN_EVENT_FLAGS = 0x02  # cudaEventDisableTiming
_ALIGN = 512
_HANDLE_BYTES = 64
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the pointers
_NOT_READY = 600  # cudaErrorNotReady, as eventQuery returns it
#: Most slots one fused kernel takes (its parameter list grows with them).
_MAX_FUSED = 64


def _import_cupy() -> Any:
    try:
        import cupy
    except ImportError:
        raise InvalidArgumentError(
            "cupy is not installed on this node (pip install 'gradsync[cuda]')"
        ) from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError, or a driver that cannot load
        raise InvalidArgumentError(f"no usable CUDA device: {exc}") from None
    if count < 1:
        raise InvalidArgumentError("no CUDA device on this node")
    return cupy


@dataclasses.dataclass(eq=False)
class DeviceAllocation:
    """A slab's device memory and its two events."""

    device: int
    pointer: int
    nbytes: int
    memory: Any  # cupy.cuda.UnownedMemory over `pointer`
    ipc_handle: bytes
    done_event: int  # ours, recorded after our kernels on the slab
    done_handle: bytes
    client_event: int | None  # the client's, opened from its handle


class CudaBackend:
    """Device slabs; views are cupy arrays (bfloat16 as uint16 bit patterns)."""

    kind = "cuda"
    parallel_ranges = False

    def __init__(self) -> None:
        self.cp = _import_cupy()
        from gradsync.daemon.backends import cuda_kernels

        self.kernels = cuda_kernels
        self.runtime = self.cp.cuda.runtime
        self.device_count = int(self.runtime.getDeviceCount())
        self.in_use = 0
        self._streams: dict[int, Any] = {}
        #: (event, allocation) whose memory is freed once the event completed.
        self._pending_frees: list[tuple[int, DeviceAllocation]] = []
        self._enable_peer_access()
        log.info("CUDA backend: %d devices", self.device_count)

    # -- set-up -----------------------------------------------------------------

    def _enable_peer_access(self) -> None:
        """Direct copies between devices where the hardware allows; staged otherwise."""
        for device in range(self.device_count):
            for peer in range(self.device_count):
                if peer == device or not self.runtime.deviceCanAccessPeer(device, peer):
                    continue
                with self.cp.cuda.Device(device), contextlib.suppress(Exception):
                    self.runtime.deviceEnablePeerAccess(peer)

    def stream(self, device: int) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            with self.cp.cuda.Device(device):
                stream = self._streams[device] = self.cp.cuda.Stream(non_blocking=True)
        return stream

    # -- slabs ------------------------------------------------------------------

    def allocate(
        self, segment_id: int, nbytes: int, owner: str, request: Mapping[str, Any]
    ) -> Slab:
        self._reap()
        device = request.get("device")
        if not isinstance(device, int) or not 0 <= device < self.device_count:
            raise InvalidArgumentError(
                f"device {device!r} for {owner}: this node has CUDA devices "
                f"0..{self.device_count - 1}"
            )
        event_handle = request.get("event")
        if event_handle is not None and (
            not isinstance(event_handle, bytes) or len(event_handle) != _HANDLE_BYTES
        ):
            raise InvalidArgumentError(f"'event' must be a {_HANDLE_BYTES}-byte IPC handle")
        size = -(-nbytes // _ALIGN) * _ALIGN
        with self.cp.cuda.Device(device):
            try:
                pointer = int(self.runtime.malloc(size))
            except Exception as exc:
                raise ShmExhaustedError(
                    f"allocating {size} bytes on cuda:{device} for {owner}: {exc}",
                    {"requested": size, "device": device},
                ) from None
            done = 0
            try:
                ipc_handle = bytes(self.runtime.ipcGetMemHandle(pointer))
                done = int(self.runtime.eventCreateWithFlags(_EVENT_FLAGS))
                done_handle = bytes(self.runtime.ipcGetEventHandle(done))
                client_event = (int(self.runtime.ipcOpenEventHandle(event_handle))
                                if event_handle is not None else None)
            except Exception as exc:
                if done:
                    self.runtime.eventDestroy(done)
                self.runtime.free(pointer)
                raise InvalidArgumentError(
                    f"cannot export device memory for {owner}: {exc}"
                ) from None
        memory = self.cp.cuda.UnownedMemory(pointer, size, None, device)
        allocation = DeviceAllocation(device, pointer, size, memory, ipc_handle, done,
                                      done_handle, client_event)
        self.in_use += size
        return Slab(segment_id, size, owner, self, allocation, device)

    def export(self, slab: Slab) -> dict[str, Any]:
        allocation: DeviceAllocation = slab.handle
        return {"device": allocation.device, "ipc_handle": allocation.ipc_handle,
                "event": allocation.done_handle}

    def release(self, slab: Slab) -> None:
        """Free once the kernels already queued on the slab's device are done."""
        allocation: DeviceAllocation = slab.handle
        self.in_use -= allocation.nbytes
        with self.cp.cuda.Device(allocation.device):
            marker = int(self.runtime.eventCreateWithFlags(_PLAIN_EVENT_FLAGS))
            self.runtime.eventRecord(marker, self.stream(allocation.device).ptr)
        self._pending_frees.append((marker, allocation))
        self._reap()

    def close(self) -> None:
        """At shutdown, after every slab was released: wait for the streams, free all."""
        for stream in self._streams.values():
            stream.synchronize()
        self._reap()

    def _reap(self) -> None:
        still: list[tuple[int, DeviceAllocation]] = []
        for marker, allocation in self._pending_frees:
            status = self.runtime.eventQuery(marker)
            if status == _NOT_READY:  # its last kernels are still running
                still.append((marker, allocation))
                continue
            if status != 0:  # a sticky error: nothing will ever run on it again
                log.warning("freeing device memory of cuda:%d after CUDA error %d",
                            allocation.device, status)
            with self.cp.cuda.Device(allocation.device):
                self.runtime.eventDestroy(marker)
                self.runtime.eventDestroy(allocation.done_event)
                if allocation.client_event is not None:
                    self.runtime.eventDestroy(allocation.client_event)
                self.runtime.free(allocation.pointer)
        self._pending_frees = still

    def view(self, slab: Slab, offset: int, count: int, dtype: np.dtype) -> Any:
        allocation: DeviceAllocation = slab.handle
        device_dtype = np.dtype(np.uint16) if dtype.name == "bfloat16" else dtype
        pointer = self.cp.cuda.MemoryPointer(allocation.memory, offset)
        return self.cp.ndarray((count,), dtype=device_dtype, memptr=pointer)

    # -- ordering ---------------------------------------------------------------

    @contextlib.contextmanager
    def running(self, slabs: Sequence[Slab]) -> Iterator[None]:
        """Run the enclosed kernels on the first slab's device and stream, ordered
        after the clients' work on every slab and before their next."""
        home = slabs[0].handle.device if slabs else 0
        stream = self.stream(home)
        for slab in slabs:
            client_event = slab.handle.client_event
            if client_event is None:
                continue
            # The slab's own device stream too: staging copies run there.
            for device in {home, slab.handle.device}:
                with self.cp.cuda.Device(device):
                    self.runtime.streamWaitEvent(self.stream(device).ptr, client_event, 0)
        try:
            with self.cp.cuda.Device(home), stream:
                yield
        finally:  # after a failed kernel too: the clients' streams wait on what was queued
            self._signal(home, stream, slabs)

    def _signal(self, home: int, stream: Any, slabs: Sequence[Slab]) -> None:
        marker = None
        for slab in slabs:
            allocation: DeviceAllocation = slab.handle
            if allocation.device == home:
                self.runtime.eventRecord(allocation.done_event, stream.ptr)
                continue
            # cudaEventRecord needs the event's own device: hop through its stream.
            if marker is None:
                with self.cp.cuda.Device(home):
                    marker = int(self.runtime.eventCreateWithFlags(_PLAIN_EVENT_FLAGS))
                    self.runtime.eventRecord(marker, stream.ptr)
            other = self.stream(allocation.device)
            with self.cp.cuda.Device(allocation.device):
                self.runtime.streamWaitEvent(other.ptr, marker, 0)
                self.runtime.eventRecord(allocation.done_event, other.ptr)
        if marker is not None:
            self.runtime.eventDestroy(marker)  # released once its waits are done

    # -- kernels ----------------------------------------------------------------

    def reduce(self, slots: Sequence[Any], op: ReduceOp, dtype: str, start: int,
               stop: int) -> None:
        """Inside `running`: combine every slot into the first, then copy it back out."""
        if len(slots) < 2 or start >= stop:
            return
        acc = slots[0][start:stop]
        home = acc.device.id
        if all(slot.device.id == home for slot in slots) and len(slots) <= _MAX_FUSED:
            # One pass: each slot read once and written once.
            self.kernels.allreduce_in_place([slot[start:stop] for slot in slots], op, dtype)
            return
        stream = self.cp.cuda.get_current_stream()
        staged = None
        for slot in slots[1:]:
            part = slot[start:stop]
            if part.device.id != home:
                if staged is None:
                    staged = self.cp.empty_like(acc)
                self._copy(staged, part, stream)
                part = staged
            self.kernels.combine(acc, part, op, dtype)
        if op is ReduceOp.AVG:
            self.kernels.divide(acc, len(slots), dtype)
        for slot in slots[1:]:
            self._copy(slot[start:stop], acc, stream)

    def _copy(self, target: Any, source: Any, stream: Any) -> None:
        """Device to device, across devices too (peer access or staged by the driver)."""
        self.runtime.memcpyAsync(target.data.ptr, source.data.ptr, source.nbytes,
                                 _MEMCPY_DEFAULT, stream.ptr)

    def to_host(
        self, views: Sequence[Any], dtype: np.dtype
    ) -> tuple[list[Any], Callable[[], Callable[[], None]]]:
        """Pinned host copies of device views (blocks until copied: call off the
        loop); see `Backend.to_host` for `copy_back`."""
        hosts: list[Any] = []
        pairs: list[tuple[Any, Any]] = []
        for view in views:
            if view is None:
                hosts.append(None)
                continue
            pinned = self.cp.cuda.alloc_pinned_memory(max(1, view.nbytes))
            host = np.frombuffer(pinned, dtype=dtype, count=view.size)
            with self.cp.cuda.Device(view.device.id):
                self.runtime.memcpyAsync(host.ctypes.data, view.data.ptr, view.nbytes,
                                         _MEMCPY_DEFAULT, self.stream(view.device.id).ptr)
            hosts.append(host)
            pairs.append((view, host))
        # Only the streams these copies went to (the loop may add others meanwhile).
        streams = [self.stream(device) for device in {v.device.id for v, _ in pairs}]
        for stream in streams:
            stream.synchronize()

        def copy_back() -> Callable[[], None]:
            for view, host in pairs:
                with self.cp.cuda.Device(view.device.id):
                    self.runtime.memcpyAsync(view.data.ptr, host.ctypes.data, view.nbytes,
                                             _MEMCPY_DEFAULT, self.stream(view.device.id).ptr)

            def wait() -> None:
                for stream in streams:
                    stream.synchronize()
                pairs.clear()  # the pinned buffers may go now

            return wait

        return hosts, copy_back
