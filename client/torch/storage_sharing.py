"""Zero-copy CPU memory for the process group: per-daemon segment registries, shared storages.

A tensor in daemon memory is reduced where it lies; everything else is staged.
This module decides which memory the daemon knows: the segments of every
client of this process (one registry per daemon), and CPU storages moved to
shared memory once collectives keep coming back to them (`StorageSharer`).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from gradsync.client.buffers import SegmentRegistry
from gradsync.client.client import Client
from gradsync.protocol.errors import GradsyncError

log = logging.getLogger("gradsync.client.torch")

__all__ = ["SHARER", "StorageSharer", "registry_for"]


#: One segment registry per daemon, shared by every group's client in this process,
#: so a tensor from `empty()` is found (and not staged) whichever group uses it.
_REGISTRIES: dict[str, SegmentRegistry] = {}
_REGISTRIES_LOCK = threading.Lock()


def registry_for(daemon: str) -> SegmentRegistry:
    """The segment registry of every client of this process that talks to `daemon`."""
    with _REGISTRIES_LOCK:
        return _REGISTRIES.setdefault(daemon, SegmentRegistry())


class StorageSharer:
    """Moves CPU storages that collectives use again and again into memory the daemon maps.

    A tensor's second collective moves its storage to shared memory in place
    (what `Tensor.share_memory_()` does: views follow, the data is copied once)
    and lets the daemon map it, so it is reduced where it lies from then on,
    like a tensor from `empty()`.  DDP's buckets take this path.  Only storages
    of at least `MIN_BYTES`, mostly covered by the tensor, and resizable: not
    `torch.from_numpy` memory nor storages exported with `.numpy()`, which
    numpy arrays may alias (the backend's own arrays do not use `.numpy()`).
    A storage already in shared memory (`share_memory_()`) does not move: it
    is mapped on first use.
    `GRADSYNC_TORCH_SHARE=0` keeps every tensor staged.
    """

    MIN_BYTES = 64 * 1024

    def __init__(self) -> None:
        self.enabled = os.environ.get("GRADSYNC_TORCH_SHARE", "1") not in ("0", "false", "no")
        self._lock = threading.Lock()
        #: storage → [state, collectives in flight on it]; state is "seen" (staged
        #: before), "attached" or "refused".
        self._state: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()

    def offer(self, tensor: torch.Tensor, client: Client) -> Any:
        """Share `tensor`'s storage if it is due; returns a token for `release`, or None.

        A storage moves only while no collective of this process uses it (a
        staged one would copy its result into the old memory).
        """
        if (not self.enabled or tensor.device.type != "cpu" or not tensor.is_contiguous()
                or tensor.numel() * tensor.element_size() < self.MIN_BYTES):
            return None
        storage = tensor.untyped_storage()
        with self._lock:
            entry = self._state.get(storage)
            if entry is None:
                if storage.is_shared():  # shared already (share_memory_()): nothing moves
                    state = self._share(tensor, storage, client)
                else:
                    # Not resizable: numpy memory (from_numpy) or exported by .numpy(), so
                    # numpy arrays may alias it and moving it would cut them off.
                    state = "seen" if storage.resizable() else "refused"
                entry = self._state[storage] = [state, 0]
            elif entry[0] == "seen" and entry[1] == 0:
                entry[0] = (self._share(tensor, storage, client) if storage.resizable()
                            else "refused")
            entry[1] += 1
        return storage

    def release(self, tokens: Sequence[Any]) -> None:
        """The collectives that took these tokens are over."""
        with self._lock:
            for storage in tokens:
                entry = self._state.get(storage)
                if entry is not None:
                    entry[1] -= 1

    @staticmethod
    def _share(tensor: torch.Tensor, storage: Any, client: Client) -> str:
        if storage.nbytes() > 2 * tensor.numel() * tensor.element_size():
            return "refused"  # mostly other tensors' memory: not worth moving
        try:
            fd, nbytes = storage._share_fd_cpu_()
            client.attach(int(fd), int(nbytes), int(storage.data_ptr()), storage)
        except (GradsyncError, RuntimeError) as exc:
            log.debug("staging a %d-byte storage: cannot share it (%s)", storage.nbytes(), exc)
            return "refused"
        return "attached"


#: The process's one sharer: a storage moves once, whichever group uses it.
SHARER = StorageSharer()
