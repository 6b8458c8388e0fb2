"""FSDP2 with its communication buffers in daemon memory: its collectives copy nothing.

FSDP2 allocates a fresh all-gather output and reduce-scatter input for every
unshard and every gradient reduction.  On backend "gradsync" such buffers
would be staged through a scratch segment each time; through
`use_daemon_memory(model)` FSDP2 takes them from a pool of daemon-memory
buffers instead (its `set_custom_all_gather` / `set_custom_reduce_scatter`
hooks), so the daemon reduces them where they lie.  A buffer returns to the
pool once the last tensor viewing it is gone.
"""

from __future__ import annotations

import collections
import math
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from gradsync.protocol.errors import InvalidArgumentError

__all__ = ["DaemonMemoryPool", "use_daemon_memory"]


class DaemonMemoryPool:
    """Daemon-memory byte buffers handed out as tensors and taken back when they die.

    Idle buffers are kept by size up to `max_idle_bytes` in all; the client
    frees the rest in the daemon as they are dropped.
    """

    def __init__(self, group: Any = None, max_idle_bytes: int = 1 << 30) -> None:
        self._group = group
        self.max_idle_bytes = max_idle_bytes
        self._idle: dict[int, collections.deque[np.ndarray]] = collections.defaultdict(
            collections.deque
        )
        self._idle_bytes = 0
        self._lock = threading.Lock()
        #: Buffers handed out, and how many of them came back from the idle lists.
        self.handed_out = 0
        self.reused = 0

    def tensor(self, size: Sequence[int | torch.SymInt], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor of `size` in daemon memory."""
        from gradsync.client.torch.backend import empty

        shape = tuple(int(s) for s in size)
        nbytes = max(1, math.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            idle = self._idle.get(nbytes)
            array = idle.popleft() if idle else None
            self.handed_out += 1
            if array is not None:
                self._idle_bytes -= nbytes
                self.reused += 1
        if array is None:
            array = empty(nbytes, dtype=torch.uint8, group=self._group).numpy()
        tensor = torch.from_numpy(array)
        weakref.finalize(tensor.untyped_storage(), self._give_back, array)
        flat = tensor.view(dtype)
        return flat[: math.prod(shape)].view(shape)

    def _give_back(self, array: np.ndarray) -> None:
        with self._lock:
            if self._idle_bytes + array.nbytes <= self.max_idle_bytes:
                self._idle[array.nbytes].append(array)
                self._idle_bytes += array.nbytes


class _PoolAlloc:
    def __init__(self, pool: DaemonMemoryPool) -> None:
        self._pool = pool

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        if device.type != "cpu":  # device buffers: torch's own allocator
            return torch.empty(*size, dtype=dtype, device=device)
        return self._pool.tensor(size, dtype)


class DaemonMemoryAllGather(_PoolAlloc, AllGather):
    """FSDP2's all-gather, on buffers from a `DaemonMemoryPool`."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
        group: dist.ProcessGroup, async_op: bool = False,
    ) -> dist.Work | None:
        work: dist.Work | None = dist.all_gather_into_tensor(
            output_tensor, input_tensor, group=group, async_op=async_op)
        return work


class DaemonMemoryReduceScatter(_PoolAlloc, ReduceScatter):
    """FSDP2's reduce-scatter, on buffers from a `DaemonMemoryPool`."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
        group: dist.ProcessGroup, op: Any, async_op: bool = False,
    ) -> dist.Work | None:
        work: dist.Work | None = dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        return work


def use_daemon_memory(model: torch.nn.Module, pool: DaemonMemoryPool | None = None) -> int:
    """Give every FSDP2 module in `model` daemon-memory communication buffers.

    Call it after `fully_shard`; returns how many FSDP modules it set.  The
    process group must be of backend "gradsync".
    """
    pool = pool or DaemonMemoryPool()
    count = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(DaemonMemoryAllGather(pool))
            module.set_custom_reduce_scatter(DaemonMemoryReduceScatter(pool))
            count += 1
    if count == 0:
        raise InvalidArgumentError("use_daemon_memory: no FSDP2 module (fully_shard) in model")
    return count
