"""Device buffers on the client side: the daemon's CUDA IPC slabs, ordered by events.

`Client.empty(..., device=N)` asks the daemon for a slab on device N, opens
its IPC handle once (one import per slab, in the process's primary context
for that device, the same one torch and cupy use) and returns a cupy array
or torch tensor over it: gradients written there are reduced where they lie.
Other device arrays go through a scratch slab with one device-to-device copy
each way.  A collective never waits on the host: before submitting, the client records
the slab's "ready" event on the array's current stream (the daemon's stream
waits on it); when the daemon answers, that stream waits on the daemon's
"done" event, so later kernels on it read the result (only closing a slab
synchronises its device).  Imported only when a
device array or `device=` appears; cupy stays optional.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from gradsync.protocol.codec import Message, is_integer
from gradsync.protocol.dtypes import dtype_name
from gradsync.protocol.errors import InvalidArgumentError

_EVENT_FLAGS = 0x02 | 0x04  # cudaEventDisableTiming | cudaEventInterprocess
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault
_MIN_SCRATCH = 1 << 20

#: torch dtype names → gradsync wire dtypes.
_TORCH_DTYPES = {
    "torch.float16": "float16", "torch.bfloat16": "bfloat16", "torch.float32": "float32",
    "torch.float64": "float64", "torch.int8": "int8", "torch.uint8": "uint8",
    "torch.int32": "int32", "torch.int64": "int64",
}


def is_device_array(array: Any) -> bool:
    """A torch CUDA tensor, or anything with `__cuda_array_interface__` (cupy, numba)."""
    if isinstance(array, np.ndarray):
        return False
    if type(array).__module__.startswith("torch"):
        return bool(getattr(array, "is_cuda", False))
    return hasattr(type(array), "__cuda_array_interface__")


def parse_device(device: Any) -> int:
    """A CUDA device ordinal from 3, "cuda", "cuda:3" or a torch.device."""
    if is_integer(device) and device >= 0:
        return device
    text = str(device)
    if text == "cuda":
        return 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise InvalidArgumentError(f"device must be a CUDA device like 'cuda:0' or 0, got {device!r}")


@dataclasses.dataclass(frozen=True)
class DeviceArrayInfo:
    """What the client needs of a device array: where, how big, which stream orders it."""

    pointer: int
    nbytes: int
    count: int
    device: int
    dtype: str
    stream: int  # the stream the array's producers and consumers run on


def describe(array: Any, cupy: Any) -> DeviceArrayInfo:
    """Check a device array (contiguous, writeable, a supported dtype) and describe it."""
    if type(array).__module__.startswith("torch"):
        import torch

        if not array.is_contiguous():
            raise InvalidArgumentError("tensor must be contiguous; pass t.contiguous() and copy")
        name = _TORCH_DTYPES.get(str(array.dtype))
        if name is None:
            raise InvalidArgumentError(f"unsupported dtype {array.dtype}")
        device = int(array.device.index or 0)
        stream = int(torch.cuda.current_stream(device).cuda_stream)
        return DeviceArrayInfo(int(array.data_ptr()), array.numel() * array.element_size(),
                               array.numel(), device, name, stream)
    interface = array.__cuda_array_interface__
    shape = tuple(interface["shape"])
    dtype = np.dtype(interface["typestr"])
    count = int(np.prod(shape)) if shape else 1
    strides = interface.get("strides")
    if strides is not None and tuple(strides) != _c_strides(shape, dtype.itemsize):
        raise InvalidArgumentError("array must be C-contiguous; pass cupy.ascontiguousarray(a)")
    pointer, read_only = interface["data"]
    if read_only:
        raise InvalidArgumentError("array is read-only; collectives write in place")
    try:
        name = dtype_name(dtype)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None
    device = int(getattr(getattr(array, "device", None), "id", -1))
    if device < 0:
        device = int(cupy.cuda.runtime.pointerGetAttributes(pointer).device)
    with cupy.cuda.Device(device):
        stream = int(cupy.cuda.get_current_stream().ptr)
    return DeviceArrayInfo(int(pointer), count * dtype.itemsize, count, device, name, stream)


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


@dataclasses.dataclass(eq=False)
class DeviceSlab:
    """A daemon slab opened in this process."""

    segment_id: int
    device: int
    pointer: int
    nbytes: int
    ready_event: int  # ours: recorded after the producers of the data
    done_event: int  # the daemon's, opened from its handle
    closed: bool = False


@dataclasses.dataclass(frozen=True)
class DevicePlacement:
    segment: int
    offset: int
    on_success: Callable[[], None] | None
    on_finish: Callable[[], None] | None


class DeviceBuffers:
    """This client's device slabs: allocation, lookup by pointer, scratch, events."""

    def __init__(self, call: Callable[..., Message], free: Callable[[int], None]) -> None:
        try:
            import cupy
        except ImportError:
            raise InvalidArgumentError(
                "device arrays need cupy in the training process "
                "(pip install 'gradsync[cuda]')"
            ) from None
        self.cp = cupy
        self.runtime = cupy.cuda.runtime
        self._call = call
        self._free = free
        # Reentrant: a slab's finalizer (close_slab) may run from a garbage
        # collection inside a block that holds the lock.
        self._lock = threading.RLock()
        self._slabs: dict[int, DeviceSlab] = {}
        self._scratch: list[DeviceSlab] = []

    # -- slabs ------------------------------------------------------------------

    def allocate(self, nbytes: int, device: int) -> DeviceSlab:
        """A new slab on `device`, opened here."""
        with self.cp.cuda.Device(device):
            ready = int(self.runtime.eventCreateWithFlags(_EVENT_FLAGS))
            try:
                handle = bytes(self.runtime.ipcGetEventHandle(ready))
                reply = self._call("alloc", nbytes=nbytes, device=device, event=handle)
            except BaseException:
                self.runtime.eventDestroy(ready)
                raise
            pointer = 0
            try:
                pointer = int(self.runtime.ipcOpenMemHandle(bytes(reply["ipc_handle"])))
                done = int(self.runtime.ipcOpenEventHandle(bytes(reply["event"])))
            except Exception as exc:
                if pointer:  # opened: close it before the daemon frees the memory
                    self.runtime.ipcCloseMemHandle(pointer)
                self.runtime.eventDestroy(ready)
                self._free(int(reply["segment"]))
                raise InvalidArgumentError(
                    f"cannot open the daemon's device memory on cuda:{device}: {exc} (is the "
                    "daemon on this node, and allowed to share this GPU?)"
                ) from None
        slab = DeviceSlab(int(reply["segment"]), device, pointer, int(reply["nbytes"]),
                          ready, done)
        with self._lock:
            self._slabs[slab.segment_id] = slab
        return slab

    def array(self, slab: DeviceSlab, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """A cupy array over the whole slab's first elements; closing follows its life."""
        owner = _SlabOwner()
        weakref.finalize(owner, self.close_slab, slab, True)
        memory = self.cp.cuda.UnownedMemory(slab.pointer, slab.nbytes, owner, slab.device)
        return self.cp.ndarray(shape, dtype=dtype, memptr=self.cp.cuda.MemoryPointer(memory, 0))

    def close_slab(self, slab: DeviceSlab, free_in_daemon: bool) -> None:
        """Close our import of a slab (first), then let the daemon free it."""
        with self._lock:
            if slab.closed:
                return
            slab.closed = True
            self._slabs.pop(slab.segment_id, None)
        with self.cp.cuda.Device(slab.device):
            self.runtime.deviceSynchronize()  # nothing of ours may still touch it
            self.runtime.ipcCloseMemHandle(slab.pointer)
            self.runtime.eventDestroy(slab.done_event)
            self.runtime.eventDestroy(slab.ready_event)
        if free_in_daemon:
            self._free(slab.segment_id)

    def close(self) -> None:
        """Close every import (the client is closing; the daemon frees the slabs)."""
        with self._lock:
            slabs = list(self._slabs.values())
            self._scratch.clear()
        for slab in slabs:
            self.close_slab(slab, False)

    def locate(self, info: DeviceArrayInfo) -> tuple[DeviceSlab, int] | None:
        with self._lock:
            for slab in list(self._slabs.values()):  # a finalizer may remove one
                if (slab.device == info.device and slab.pointer <= info.pointer
                        and info.pointer + info.nbytes <= slab.pointer + slab.nbytes):
                    return slab, info.pointer - slab.pointer
        return None

    # -- placing one array of a collective ---------------------------------------

    def place(self, info: DeviceArrayInfo, copy_in: bool, copy_out: bool) -> DevicePlacement:
        """Hand an array to the daemon: in place if it lies in a slab, else via scratch."""
        located = self.locate(info)
        if located is not None:
            slab, offset = located
            self._record(slab, info.stream)
            # On failure too: the daemon may have queued kernels on the slab before.
            return DevicePlacement(slab.segment_id, offset,
                                   None, lambda: self._wait(slab, info.stream))
        scratch = self._take_scratch(info.nbytes, info.device)
        with self.cp.cuda.Device(info.device):
            # Its last user may have been another stream: wait for that copy-out
            # (recorded in give_back) before anything here overwrites the scratch.
            self.runtime.streamWaitEvent(info.stream, scratch.ready_event, 0)
            if copy_in:
                self.runtime.memcpyAsync(scratch.pointer, info.pointer, info.nbytes,
                                         _MEMCPY_DEFAULT, info.stream)
            self._record(scratch, info.stream)

        def after() -> None:
            self._wait(scratch, info.stream)
            if copy_out:
                with self.cp.cuda.Device(info.device):
                    self.runtime.memcpyAsync(info.pointer, scratch.pointer, info.nbytes,
                                             _MEMCPY_DEFAULT, info.stream)

        def give_back() -> None:
            # Record after the copy-out (and, on failure, after whatever the daemon
            # queued): the daemon and the scratch's next user, on any stream, wait for it.
            self._wait(scratch, info.stream)
            self._record(scratch, info.stream)
            with self._lock:
                self._scratch.append(scratch)

        return DevicePlacement(scratch.segment_id, 0, after, give_back)

    def _take_scratch(self, nbytes: int, device: int) -> DeviceSlab:
        with self._lock:
            fitting = [s for s in self._scratch if s.device == device and s.nbytes >= nbytes]
            if fitting:
                best = min(fitting, key=lambda s: s.nbytes)
                self._scratch.remove(best)
                return best
        return self.allocate(max(_MIN_SCRATCH, 1 << max(0, nbytes - 1).bit_length()), device)

    def _record(self, slab: DeviceSlab, stream: int) -> None:
        with self.cp.cuda.Device(slab.device):
            self.runtime.eventRecord(slab.ready_event, stream)

    def _wait(self, slab: DeviceSlab, stream: int) -> None:
        with self.cp.cuda.Device(slab.device):
            self.runtime.streamWaitEvent(stream, slab.done_event, 0)


class _SlabOwner:
    """Kept alive by every cupy array over a slab; its collection closes the slab."""
