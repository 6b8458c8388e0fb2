"""The allreduce implementations under test, as seen from one rank.

Each contender gives the measurement loop the same four things: a float32
buffer of a given length, a zero-argument function that sum-allreduces that
buffer in place, a barrier, and an exact max over ranks of one float (used to
agree on sample counts).  Heavy imports (gradsync, torch, mpi4py) happen only
in the contender that needs them, so a missing library only costs its column.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from benchmarks.machine import process_cpu_s


class Contender(Protocol):
    """One rank's handle on an allreduce implementation."""

    rank: int
    world_size: int
    #: pid of the gradsync daemon this rank talks to; None where there is none.
    daemon_pid: int | None

    def allocate(self, count: int) -> np.ndarray:
        """A float32 buffer of `count` elements, where this contender wants it."""
        ...

    def reducer(self, buffer: np.ndarray) -> Callable[[], None]:
        """A function that sum-allreduces `buffer` in place, as cheaply as the API allows."""
        ...

    def barrier(self) -> None: ...

    def agree_max(self, value: float) -> float:
        """The maximum of `value` over all ranks, identical on every rank."""
        ...

    def daemon_cpu_s(self) -> float | None:
        """CPU seconds the gradsync daemon has used so far; None where there is none."""
        ...

    def close(self) -> None: ...


class GradsyncContender:
    """gradsync through its public `Client`; `zero_copy` picks `empty()` or numpy buffers.

    `algorithm` is passed to every timed `all_reduce` (None: the daemons' default);
    it only matters between daemons, and may be changed between sizes.
    """

    def __init__(self, zero_copy: bool, algorithm: str | None = None) -> None:
        from gradsync.client import Client

        self.client = Client()
        self.zero_copy = zero_copy
        self.algorithm = algorithm
        self.rank = self.client.rank
        self.world_size = self.client.world_size
        self.daemon_pid: int | None = self.client.daemon_pid
        # There is no barrier collective yet: a one-element allreduce stands in for it.
        self._barrier_buffer = self.client.empty((1,), np.float32)
        self._agree_buffer = self.client.empty((1,), np.float64)

    def allocate(self, count: int) -> np.ndarray:
        if self.zero_copy:
            buffer: np.ndarray = self.client.empty((count,), np.float32)
            return buffer
        return np.empty(count, dtype=np.float32)

    def reducer(self, buffer: np.ndarray) -> Callable[[], None]:
        client = self.client
        algorithm = self.algorithm

        def op() -> None:
            client.all_reduce(buffer, op="sum", algorithm=algorithm)

        return op

    def barrier(self) -> None:
        self.client.all_reduce(self._barrier_buffer, op="sum")

    def agree_max(self, value: float) -> float:
        self._agree_buffer[0] = value
        self.client.all_reduce(self._agree_buffer, op="max")
        return float(self._agree_buffer[0])

    def daemon_cpu_s(self) -> float | None:
        return process_cpu_s(self.client.daemon_pid)

    def close(self) -> None:
        self.client.close()


class TorchContender:
    """torch.distributed on `backend` (gloo, or gradsync's own), initialised through a
    file store; ordinary CPU tensors, as torch users pass them."""

    def __init__(self, backend: str, init_file: str, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        if backend == "gradsync":
            import gradsync.client.torch  # noqa: F401 (registers the backend)

        self._torch: Any = torch
        self._dist: Any = dist
        self._backend = backend
        self._tensors: dict[int, Any] = {}
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        group = dist.group.WORLD
        client = getattr(group, "client", None)  # gradsync's process group has one
        self.daemon_pid: int | None = client.daemon_pid if client is not None else None

    def allocate(self, count: int) -> np.ndarray:
        if self._backend == "gloo":
            return np.empty(count, dtype=np.float32)
        # A torch tensor in shared memory (share_memory_(), where the gradsync backend
        # also moves tensors that come back, such as DDP's buckets): the backend maps it.
        tensor = self._torch.empty(count, dtype=self._torch.float32)
        tensor.share_memory_()
        buffer: np.ndarray = tensor.numpy()
        self._tensors[buffer.ctypes.data] = tensor
        return buffer

    def reducer(self, buffer: np.ndarray) -> Callable[[], None]:
        # The tensor `allocate` made, else a view of `buffer` (shares its memory).
        tensor = self._tensors.get(buffer.ctypes.data)
        if tensor is None:
            tensor = self._torch.from_numpy(buffer)
        all_reduce = self._dist.all_reduce
        sum_op = self._dist.ReduceOp.SUM

        def op() -> None:
            all_reduce(tensor, op=sum_op)

        return op

    def barrier(self) -> None:
        self._dist.barrier()

    def agree_max(self, value: float) -> float:
        tensor = self._torch.tensor([value], dtype=self._torch.float64)
        self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MAX)
        return float(tensor[0])

    def daemon_cpu_s(self) -> float | None:
        return None if self.daemon_pid is None else process_cpu_s(self.daemon_pid)

    def close(self) -> None:
        self._dist.destroy_process_group()


class MpiContender:
    """mpi4py's buffer-based `Allreduce(MPI.IN_PLACE, ...)` under mpirun."""

    def __init__(self) -> None:
        from mpi4py import MPI

        self._mpi: Any = MPI
        self.comm: Any = MPI.COMM_WORLD
        self.rank = int(self.comm.Get_rank())
        self.world_size = int(self.comm.Get_size())
        self.daemon_pid: int | None = None

    def allocate(self, count: int) -> np.ndarray:
        return np.empty(count, dtype=np.float32)

    def reducer(self, buffer: np.ndarray) -> Callable[[], None]:
        allreduce = self.comm.Allreduce
        in_place = self._mpi.IN_PLACE
        spec = [buffer, self._mpi.FLOAT]
        sum_op = self._mpi.SUM

        def op() -> None:
            allreduce(in_place, spec, op=sum_op)

        return op

    def barrier(self) -> None:
        self.comm.Barrier()

    def agree_max(self, value: float) -> float:
        return float(self.comm.allreduce(value, op=self._mpi.MAX))

    def daemon_cpu_s(self) -> float | None:
        return None

    def close(self) -> None:
        pass  # mpi4py finalizes at exit


def make_contender(key: str, init_file: str, timeout_s: float) -> Contender:
    if key == "gradsync-empty":
        return GradsyncContender(zero_copy=True)
    if key == "gradsync-numpy":
        return GradsyncContender(zero_copy=False)
    if key == "gloo":
        return TorchContender("gloo", init_file, timeout_s)
    if key == "gradsync-torch":
        return TorchContender("gradsync", init_file, timeout_s)
    if key == "mpi":
        return MpiContender()
    raise ValueError(f"unknown contender {key!r}")
