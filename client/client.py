"""`Client`: a training process's handle on its node's gradsync daemon."""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from types import TracebackType
from typing import Any

import numpy as np

from gradsync.client.buffers import ScratchPool, ScratchSlot, SegmentRegistry
from gradsync.client.connection import Connection
from gradsync.client.environment import resolve_identity
from gradsync.client.work import Work
from gradsync.protocol.dtypes import ReduceOp, check_op_for_dtype, dtype_name, parse_reduce_op
from gradsync.protocol.errors import DaemonUnavailableError, GradsyncError, InvalidArgumentError

#: How long past the collective deadline a client waits for the daemon itself.
_GUARD_MARGIN_S = 30.0
_HELLO_TIMEOUT_S = 30.0
ALGORITHMS = ("auto", "ring", "tree", "rhd", "star")


class Client:
    """Connects to the local daemon and runs collectives on numpy arrays.

    Unset arguments come from the environment (see `gradsync.client.environment`):
    `GRADSYNC_DAEMON`, `GRADSYNC_JOB`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    `LOCAL_WORLD_SIZE`, `GRADSYNC_TIMEOUT_S`.
    """

    def __init__(
        self,
        daemon: str | None = None,
        job: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        timeout_s: float | None = None,
    ) -> None:
        identity = resolve_identity(
            daemon, job, rank, world_size, local_rank, local_world_size, timeout_s
        )
        self.daemon = identity.daemon
        self.job = identity.job
        self.rank = identity.rank
        self.world_size = identity.world_size
        self.local_rank = identity.local_rank
        self.local_world_size = identity.local_world_size
        self.timeout_s = identity.timeout_s
        self.algorithm: str | None = os.environ.get("GRADSYNC_ALGO") or None
        self._segments = SegmentRegistry()
        self._scratch = ScratchPool(self._segments)
        self._submit_lock = threading.Lock()
        self._sequence = 0
        self._closed = False
        self._connection = Connection(self.daemon)
        try:
            welcome = self._connection.call(
                "hello",
                timeout_s=_HELLO_TIMEOUT_S,
                job=self.job,
                rank=self.rank,
                world_size=self.world_size,
                local_rank=self.local_rank,
                local_world_size=self.local_world_size,
                pid=os.getpid(),
            )
        except GradsyncError:
            self._connection.close()
            raise
        self.daemon_version: str = welcome.get("version", "?")
        self.daemon_pid: int = welcome.get("pid", -1)
        self._daemon_timeout_s = float(welcome.get("collective_timeout_s", 300.0))

    def __repr__(self) -> str:
        return (
            f"<gradsync Client rank {self.rank}/{self.world_size} job {self.job!r} "
            f"daemon {self.daemon}>"
        )

    # -- lifecycle ----------------------------------------------------------

    def close(self) -> None:
        """Leave the job and disconnect; arrays from `empty()` stay usable as memory."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(GradsyncError):
            self._connection.send("bye", expect_reply=False)
        self._connection.close()
        self._scratch.clear()
        self._segments.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise DaemonUnavailableError("this gradsync Client is closed")
        while self._segments.collected:
            segment_id = self._segments.collected.popleft()
            self._connection.send("free", expect_reply=False, segment=segment_id)

    # -- buffers ------------------------------------------------------------

    def empty(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        """An uninitialised array in daemon-owned shared memory (zero-copy collectives)."""
        self._check_open()
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        np_dtype = np.dtype(dtype)
        try:
            dtype_name(np_dtype)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        count = math.prod(dims)
        if count < 0 or any(d < 0 for d in dims):
            raise InvalidArgumentError(f"negative dimension in shape {dims}")
        if count == 0:
            return np.empty(dims, dtype=np_dtype)
        reply = self._connection.call("alloc", timeout_s=_HELLO_TIMEOUT_S,
                                      nbytes=count * np_dtype.itemsize)
        mapping = self._segments.map(reply["segment"], reply["name"], reply["nbytes"], True)
        return np.frombuffer(mapping, dtype=np_dtype, count=count).reshape(dims)

    def _scratch_slot(self, nbytes: int) -> ScratchSlot:
        slot = self._scratch.take(nbytes)
        if slot is not None:
            return slot
        capacity = ScratchPool.capacity_for(nbytes)
        reply = self._connection.call("alloc", timeout_s=_HELLO_TIMEOUT_S, nbytes=capacity)
        mapping = self._segments.map(reply["segment"], reply["name"], reply["nbytes"], False)
        return ScratchSlot(reply["segment"], reply["nbytes"], mapping)

    # -- collectives --------------------------------------------------------

    def all_reduce(
        self,
        array: np.ndarray,
        op: str | ReduceOp = "sum",
        async_op: bool = False,
        algorithm: str | None = None,
    ) -> Work | None:
        """Reduce `array` across all ranks, in place.

        Arrays from `empty()` are reduced where they lie; other C-contiguous
        arrays are staged through a scratch segment and copied back on success.
        `algorithm` (ring, tree, rhd, star or auto) overrides the daemons'
        choice between nodes; it defaults to `GRADSYNC_ALGO`, else the daemon's.
        """
        self._check_open()
        algorithm = algorithm or self.algorithm
        if algorithm is not None and algorithm not in ALGORITHMS:
            raise InvalidArgumentError(
                f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}"
            )
        wire_dtype, reduce_op = self._check_array(array, op)
        count = int(array.size)
        located = self._segments.locate(array) if count else None
        on_success = on_finish = None
        if count == 0:
            segment_id, offset = None, 0
        elif located is not None:
            segment_id, offset = located
        else:
            slot = self._scratch_slot(array.nbytes)
            staged = slot.view(array.dtype, count)
            np.copyto(staged, array.reshape(-1))
            segment_id, offset = slot.segment_id, 0

            def on_success() -> None:
                np.copyto(array.reshape(-1), staged)

            def on_finish() -> None:
                self._scratch.give_back(slot)

        fields: dict[str, Any] = {
            "segment": segment_id,
            "offset": offset,
            "count": count,
            "dtype": wire_dtype,
            "op": reduce_op.value,
            "timeout_s": self.timeout_s,
            "algorithm": algorithm,
        }
        with self._submit_lock:
            key = self._sequence
            self._sequence += 1
            try:
                request_id = self._connection.send("allreduce", key=key, **fields)
            except GradsyncError:
                if on_finish is not None:
                    on_finish()
                raise
        timeout = self.timeout_s or self._daemon_timeout_s
        work = Work(
            self._connection,
            request_id,
            lambda: f"all_reduce #{key} ({wire_dtype}[{count}] {reduce_op.value}) of job "
            f"{self.job!r} rank {self.rank}",
            time.monotonic() + timeout + _GUARD_MARGIN_S,
            on_success,
            on_finish,
        )
        if async_op:
            return work
        work.wait()
        return None

    @staticmethod
    def _check_array(array: Any, op: str | ReduceOp) -> tuple[str, ReduceOp]:
        if not isinstance(array, np.ndarray):
            raise InvalidArgumentError(
                f"expected a numpy array, got {type(array).__name__}"
            )
        if not array.flags.c_contiguous:
            raise InvalidArgumentError(
                "array must be C-contiguous; pass np.ascontiguousarray(a) and copy back"
            )
        if not array.flags.writeable:
            raise InvalidArgumentError("array is read-only; collectives write in place")
        try:
            wire_dtype = dtype_name(array.dtype)
            reduce_op = parse_reduce_op(op)
            check_op_for_dtype(reduce_op, wire_dtype)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        return wire_dtype, reduce_op
