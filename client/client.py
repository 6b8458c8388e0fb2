"""`Client`: a training process's handle on its node's gradsync daemon."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, overload

import numpy as np

from gradsync.client.array_checks import Checked, check_array
from gradsync.client.buffers import Placed, ScratchPool, ScratchSlot, SegmentRegistry
from gradsync.client.compression import Compression, choose, from_environment
from gradsync.client.connection import Connection
from gradsync.client.cuda import DeviceArrayInfo, DeviceBuffers, parse_device
from gradsync.client.environment import resolve_identity
from gradsync.client.fast_path import FastPath, PageCall, offered_fast_path
from gradsync.client.subgroups import group_job, local_ranks
from gradsync.client.work import Work
from gradsync.protocol import requests as wire
from gradsync.protocol.codec import is_integer
from gradsync.protocol.dtypes import ReduceOp, dtype_name, parse_reduce_op
from gradsync.protocol.errors import (
    DaemonShuttingDownError,
    DaemonUnavailableError,
    GradsyncError,
    InvalidArgumentError,
)
from gradsync.protocol.peer import ALGORITHM_CHOICES
from gradsync.protocol.requests import ALLREDUCE

#: A collective's buffer: a numpy array, a cupy array or a CUDA torch tensor.
Buffer = Any


#: How long past the collective deadline a client waits for the daemon itself.
_GUARD_MARGIN_S = 30.0
_HELLO_TIMEOUT_S = 30.0
#: The longest a run of fast-path allreduces goes without looking for a lost daemon.
PROBE_INTERVAL_S = 1e-3
_LOG = logging.getLogger("gradsync.client")
ALGORITHMS = ALGORITHM_CHOICES


class _Reconnected(Exception):
    """`Client._on_page`: the daemon went away while the key was on the page."""


#: (numpy dtype, op as given, elements, algorithm) → the PageCall of a host array seen.
_PageCallKey = tuple[Any, Any, int, str | None]
#: PageCalls a client keeps (the same few arrays come back every step).
_PAGE_CALLS_KEPT = 256


class Client:
    """Connects to the local daemon and runs collectives on numpy arrays, cupy
    arrays and CUDA torch tensors (device buffers: see `gradsync.client.cuda`).

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
        _segments: SegmentRegistry | None = None,
    ) -> None:
        identity = resolve_identity(
            daemon, job, rank, world_size, local_rank, local_world_size, timeout_s
        )
        if identity.note is not None:
            # A plain `python train.py` in an sbatch script: say it runs alone.
            warnings.warn(f"gradsync: {identity.note}", RuntimeWarning, stacklevel=2)
        self.daemon = identity.daemon
        self.job = identity.job
        self.rank = identity.rank
        self.world_size = identity.world_size
        self.local_rank = identity.local_rank
        self.local_world_size = identity.local_world_size
        self.timeout_s = identity.timeout_s
        self.algorithm: str | None = os.environ.get("GRADSYNC_ALGO") or None
        #: The default wire format between daemons (GRADSYNC_COMPRESSION), for the
        #: float sums it applies to; a call's `compression` overrides it.
        self.compression: Compression = from_environment()
        self._segments = _segments or SegmentRegistry()
        #: A registry shared with other clients of this process (a sub-group's, or the
        #: torch backend's) outlives this client: its segments leave it when this
        #: client's session ends, on close() or when it is collected unclosed (a torchft
        #: replica's group dropped without shutdown); the finalizer holds no client.
        self._segment_key = self._segments.new_client()
        self._retire_segments = weakref.finalize(self, self._segments.retire,
                                                 self._segment_key)
        self._scratch = ScratchPool(self._segments)
        self._submit_lock = threading.Lock()
        #: This session's collective keys, 0, 1, 2, ... (next() is atomic).
        self._keys = itertools.count()
        self._closed = False
        #: When a fast-path call next probes the socket for a daemon gone (_check_open).
        self._probe_due = 0.0
        self._barrier_buffer: np.ndarray | None = None
        self._device: DeviceBuffers | None = None
        self._groups: list[Client] = []
        self._groups_created = 0
        #: Global ranks of a sub-group's members (None for a job's own client).
        self.ranks: tuple[int, ...] | None = None
        self._connection = Connection(self.daemon)
        self._fast: FastPath | None = None
        self._page_calls: dict[_PageCallKey, PageCall] = {}
        self._open_session()

    def _open_session(self) -> None:
        """Say hello on `self._connection`: join the job as a new session."""
        try:
            welcome = self._connection.call(
                "hello", timeout_s=_HELLO_TIMEOUT_S, job=self.job, rank=self.rank,
                world_size=self.world_size, local_rank=self.local_rank,
                local_world_size=self.local_world_size, pid=os.getpid())
        except GradsyncError:
            self._connection.close()
            raise
        self.daemon_version: str = welcome.get("version", "?")
        self.daemon_pid: int = welcome.get("pid", -1)
        self._daemon_timeout_s = float(welcome.get("collective_timeout_s", 300.0))
        #: The job's shared-memory fast path for small synchronous allreduces, if any.
        self._fast = offered_fast_path(self._connection, self.rank, self.world_size,
                                       self.local_world_size, welcome.get("fast_page"))
        #: The largest allreduce (bytes) the fast path may take, 0 without one.
        self.fast_path_bytes = 0 if self._fast is None else self._fast.limit

    def _close_fast_path(self) -> None:
        # A collective of another thread may still be on the page: then the mapping
        # stays (it goes with the process) rather than vanish under that thread.
        if self._fast is not None and self._fast.lock.acquire(timeout=1.0):
            try:
                self._fast.close()
            finally:
                self._fast.lock.release()
        self._fast = None

    def _reconnect(self) -> None:
        """After the daemon went away (a restart): a new session, a new job incarnation.
        The lost daemon's segments are forgotten (arrays from `empty()` stay valid, now
        staged); keys restart at 0, as on every rank that reconnects."""
        lost, old_pid = self._connection.lost, self.daemon_pid
        self._close_fast_path()
        self._scratch.clear()
        self._segments.clear()
        self._segments.collected.clear()
        with self._submit_lock:
            self._keys, self._connection = itertools.count(), Connection(self.daemon)
        self._open_session()
        _LOG.warning("gradsync: rank %d of job %r reconnected to the daemon at %s (pid %d, "
                     "was %d: %s); a new session, collectives in flight were lost",
                     self.rank, self.job, self.daemon, self.daemon_pid, old_pid, lost)

    def __repr__(self) -> str:
        return (
            f"<gradsync Client rank {self.rank}/{self.world_size} job {self.job!r} "
            f"daemon {self.daemon}>"
        )

    # -- lifecycle ----------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether `close()` has ended this client's session."""
        return self._closed

    def close(self) -> None:
        """Leave the job and disconnect; arrays from `empty()` stay usable as memory.

        Except device arrays from `empty(device=...)`: their IPC imports are
        closed here (the daemon frees the memory once the client lets go), so
        they must not be touched after `close()`.
        """
        if self._closed:
            return
        self._closed = True
        for group in self._groups:
            group.close()
        if self._device is not None:
            self._device.close()
        self._close_fast_path()
        with contextlib.suppress(GradsyncError):
            self._connection.send("bye", expect_reply=False)
        self._connection.close()
        self._scratch.clear()
        self._retire_segments()  # the daemon frees them with this session

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_open(self, probe: bool = True) -> None:
        """Raise if closed; reconnect if the daemon went away; free let-go segments.

        Finding a daemon that went away takes a poll of the socket (a system call,
        ~1 us: a sixth of a fast-path allreduce), so with `probe=False` (a call
        that may end on the fast page, which needs no daemon) it is made at most
        every PROBE_INTERVAL_S; an idle client still notices at its next call.
        """
        if self._closed:
            raise DaemonUnavailableError("this gradsync Client is closed")
        if probe or time.monotonic() >= self._probe_due:
            self._probe_due = time.monotonic() + PROBE_INTERVAL_S
            if self._connection.lost is not None:
                self._reconnect()
        if self._segments.collected:
            self._free_collected()

    def _free_collected(self) -> None:
        """Free in the daemon the segments this process let go of, and wait for it:
        one round trip, only when something was let go, so /dev/shm has the space
        back before the next collective returns (the fast path too)."""
        sent = []
        while self._segments.collected:
            segment_id = self._segments.collected.popleft()
            sent.append(self._connection.send("free", segment=segment_id))
        deadline = time.monotonic() + _HELLO_TIMEOUT_S
        for request_id in sent:
            reply = self._connection.wait(request_id, deadline)
            if reply is None:
                raise DaemonUnavailableError(
                    f"the gradsync daemon at {self.daemon} did not confirm freeing "
                    f"{len(sent)} segment(s) within {_HELLO_TIMEOUT_S}s",
                    {"endpoint": self.daemon},
                )
            # An error reply (a segment the daemon no longer knows) has nothing to free.

    # -- buffers ------------------------------------------------------------

    @overload
    def empty(
        self, shape: int | tuple[int, ...], dtype: Any = ..., device: None = None,
        like: None = None,
    ) -> np.ndarray: ...

    @overload
    def empty(
        self, shape: int | tuple[int, ...], dtype: Any = ..., *, device: Any,
        like: str | None = None,
    ) -> Any: ...

    def empty(
        self, shape: int | tuple[int, ...], dtype: Any = np.float32, device: Any = None,
        like: str | None = None,
    ) -> Any:
        """An uninitialised array in daemon-owned memory (zero-copy collectives).

        Host shared memory by default (a numpy array).  With `device` ("cuda:N"
        or N), device memory the daemon shares by CUDA IPC: a cupy array, or a
        torch tensor with `like="torch"` (the only form for bfloat16, which
        cupy lacks).
        """
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
        if like not in (None, "torch"):
            raise InvalidArgumentError(f"like must be None or 'torch', got {like!r}")
        if device is not None:
            return self._empty_on_device(dims, np_dtype, parse_device(device), like)
        if like is not None:
            raise InvalidArgumentError("like='torch' needs a device (host arrays are numpy)")
        if count == 0:
            return np.empty(dims, dtype=np_dtype)
        reply = self._connection.call("alloc", timeout_s=_HELLO_TIMEOUT_S,
                                      nbytes=count * np_dtype.itemsize)
        mapping = self._segments.map(reply["segment"], reply["name"], reply["nbytes"], True,
                                     self._segment_key)
        return np.frombuffer(mapping, dtype=np_dtype, count=count).reshape(dims)

    def attach(self, fd: int, nbytes: int, address: int, owner: object) -> None:
        """Let the daemon map memory this process already shares through `fd`.

        `address` is where that memory starts here, `owner` what keeps it
        alive (a torch storage moved to shared memory, say).  Arrays inside it
        are then reduced where they lie, like those from `empty()`.  The daemon
        accepts only processes of its own user; others get InvalidArgumentError
        and keep staging.
        """
        self._check_open()
        reply = self._connection.call("attach", timeout_s=_HELLO_TIMEOUT_S, fd=fd,
                                      nbytes=nbytes)
        self._segments.adopt(reply["segment"], address, nbytes, owner, self._segment_key)

    def call(self, kind: str, **fields: Any) -> dict[str, Any]:
        """One request of a family served outside this class (checkpoints:
        `gradsync.client.checkpoints`) and its reply; an error reply raises."""
        self._check_open()
        return self._connection.call(kind, timeout_s=_HELLO_TIMEOUT_S, **fields)

    def _device_buffers(self) -> DeviceBuffers:
        if self._device is None:
            self._device = DeviceBuffers(
                lambda kind, **fields: self._connection.call(
                    kind, timeout_s=_HELLO_TIMEOUT_S, **fields
                ),
                self._segments.collected.append,
            )
        return self._device

    def _empty_on_device(
        self, dims: tuple[int, ...], dtype: np.dtype, device: int, like: str | None
    ) -> Any:
        buffers = self._device_buffers()
        bfloat16 = dtype_name(dtype) == "bfloat16"
        if bfloat16 and like != "torch":
            raise InvalidArgumentError("cupy has no bfloat16: pass like='torch' for it")
        slab = buffers.allocate(max(1, math.prod(dims)) * dtype.itemsize, device)
        array = buffers.array(slab, dims, np.dtype(np.uint16) if bfloat16 else dtype)
        if like != "torch":
            return array
        import torch

        tensor = torch.as_tensor(array, device=f"cuda:{device}")
        return tensor.view(torch.bfloat16) if bfloat16 else tensor

    def _scratch_slot(self, nbytes: int) -> ScratchSlot:
        slot = self._scratch.take(nbytes)
        if slot is not None:
            return slot
        capacity = ScratchPool.capacity_for(nbytes)
        reply = self._connection.call("alloc", timeout_s=_HELLO_TIMEOUT_S, nbytes=capacity)
        mapping = self._segments.map(reply["segment"], reply["name"], reply["nbytes"], False,
                                     self._segment_key)
        return ScratchSlot(reply["segment"], reply["nbytes"], mapping)

    # -- collectives --------------------------------------------------------

    def all_reduce(
        self,
        array: Buffer,
        op: str | ReduceOp = "sum",
        async_op: bool = False,
        algorithm: str | None = None,
        timeout_s: float | None = None,
        compression: str | None = None,
        error_feedback: bool = False,
        _fast_wait_s: float | None = None,
    ) -> Work | None:
        """Reduce `array` across all ranks, in place.

        Arrays from `empty()` are reduced where they lie; other C-contiguous
        arrays are staged through a scratch segment and copied back on success.
        Device arrays are ordered by their current CUDA stream: once this
        returns (or the Work's `wait()` does), that stream waits for the
        daemon's kernels, so work queued on it after reads the result.
        `algorithm` (ring, tree, rhd, star or auto) overrides the daemons'
        choice between nodes; it defaults to `GRADSYNC_ALGO`, else the daemon's.
        `timeout_s`: this collective's deadline (default: the client's).
        `compression` ("bf16", "fp8" or "none"; "auto", "auto:bf16", "auto:fp8":
        the daemons compress where the link is slower than their codec) sets the
        wire format between daemons of a float32/float64 sum or avg (default:
        `GRADSYNC_COMPRESSION` where it applies); `error_feedback` adds each
        daemon's rounding residual of this buffer to its next call
        (docs/compression.md).
        """
        self._check_open(probe=False)  # the fast page needs no daemon: probed below
        timeout_s = timeout_s or self.timeout_s
        algorithm = algorithm or self.algorithm
        if algorithm is not None and algorithm not in ALGORITHMS:
            raise InvalidArgumentError(
                f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}"
            )
        fast = self._fast  # async_op too with _fast_wait_s (the torch backend's): None if done
        if (fast is not None and (not async_op or _fast_wait_s is not None)
                # Compression is between daemons: only an explicit ask for a format can
                # refuse (the socket path's choose() says why), so "none" stays here.
                and compression in (None, "none", "") and not error_feedback):
            call = self._page_call_of(array, op, algorithm, fast.limit)
            if call is not None:
                wait_s = min(timeout_s or self._daemon_timeout_s, _fast_wait_s or math.inf)
                try:
                    tried = self._on_page(fast, array, call, wait_s)
                except _Reconnected:
                    return self.all_reduce(array, op, async_op, algorithm, timeout_s,
                                           compression, error_feedback, _fast_wait_s)
                if tried is None:
                    return None
                key, waited_s = tried
                return self._all_reduce_over_socket(
                    array, call.dtype, call.op, call.count, None, async_op, algorithm,
                    timeout_s, compression, error_feedback, key, waited_s)
        wire_dtype, reduce_op, count, device = self._check_array(array, op)
        self._check_open()
        return self._all_reduce_over_socket(
            array, wire_dtype, reduce_op, count, device, async_op, algorithm, timeout_s,
            compression, error_feedback, None, 0.0)

    def _page_call_of(
        self, array: Buffer, op: str | ReduceOp, algorithm: str | None, limit: int
    ) -> PageCall | None:
        """`array`'s allreduce as the fast page takes it, checked (and raising) as every
        collective's array is; None if it is not for the page (not a host array, too big).
        Kept per (dtype, op, length, algorithm), with contiguity and writability checked
        every call."""
        if type(array) is np.ndarray:  # the common case first: a host array seen before
            call = self._page_calls.get((array.dtype, op, array.size, algorithm))
            if call is not None:
                flags = array.flags
                if flags.c_contiguous and flags.writeable:
                    return call
        elif not isinstance(array, np.ndarray):
            return None  # a device array, or no array: the socket path checks it
        if array.nbytes > limit:
            return None  # for the socket path, which checks it (once)
        wire_dtype, reduce_op, count, _ = self._check_array(array, op)
        call = PageCall.of(wire_dtype, reduce_op, count, algorithm)
        if len(self._page_calls) >= _PAGE_CALLS_KEPT:
            self._page_calls.clear()
        self._page_calls[(array.dtype, op, array.size, algorithm)] = call
        return call

    def page_call(self, array: np.ndarray, op: str | ReduceOp) -> PageCall:
        """What `page_all_reduce` needs of `array` and `op`, checked once (the torch
        backend keeps it with a tensor it sees again and again)."""
        wire_dtype, reduce_op, count, _ = self._check_array(array, op)
        return PageCall.of(wire_dtype, reduce_op, count, self.algorithm)

    def page_all_reduce(self, array: np.ndarray, call: PageCall, wait_s: float) -> Work | None:
        """`all_reduce(array, op, async_op=True)` of the torch backend's small host
        tensors: tried on the fast page for at most `wait_s` first (None: done),
        without the per-call checks `page_call` made once."""
        self._check_open(probe=False)
        fast = self._fast
        if fast is None or array.nbytes > fast.limit:
            return self.all_reduce(array, call.op, async_op=True, _fast_wait_s=wait_s)
        try:
            tried = self._on_page(fast, array, call,
                                  min(self.timeout_s or self._daemon_timeout_s, wait_s))
        except _Reconnected:
            return self.all_reduce(array, call.op, async_op=True, _fast_wait_s=wait_s)
        if tried is None:
            return None
        key, waited_s = tried
        return self._all_reduce_over_socket(
            array, call.dtype, call.op, call.count, None, True, self.algorithm, self.timeout_s,
            None, False, key, waited_s)

    def _on_page(
        self, fast: FastPath, array: np.ndarray, call: PageCall, wait_s: float
    ) -> tuple[int, float] | None:
        """One allreduce on the fast page: None when it ended there, else the key and
        the seconds it waited, for the socket path to go on with.  Raises _Reconnected
        when the daemon went away meanwhile: the whole call then goes to the new
        session (keys from 0 there), as it would have after the probe."""
        with fast.lock:
            key = self._next_key()
            waited_s = fast.all_reduce(array, call, key, wait_s)
        if waited_s is None:
            return None
        if fast.page.stopping:  # the socket path's answer, which it can no longer give
            raise DaemonShuttingDownError("daemon shutting down")
        connection = self._connection
        self._check_open()
        if self._connection is not connection:
            raise _Reconnected
        return key, waited_s

    def _all_reduce_over_socket(
        self, array: Buffer, wire_dtype: str, reduce_op: ReduceOp, count: int,
        device: DeviceArrayInfo | None, async_op: bool, algorithm: str | None,
        timeout_s: float | None, compression: str | None, error_feedback: bool,
        key: int | None, waited_s: float,
    ) -> Work | None:
        """The allreduce through the daemon (`key`: the one the fast page gave up)."""
        chosen = choose(compression, error_feedback, self.compression, ALLREDUCE, wire_dtype,
                        reduce_op.value, device is not None)
        placed = self._place(array, copy_in=True, copy_out=True, device=device)
        request = functools.partial(
            wire.Collective, ALLREDUCE, segment=placed.segment, offset=placed.offset,
            count=count, dtype=wire_dtype, op=reduce_op, timeout_s=timeout_s,
            algorithm=algorithm, waited_s=waited_s, compression=chosen.format,
            # A staged array's scratch slot serves other arrays too: the daemon keys
            # residuals by slot, so a staged one gets none (docs/compression.md).
            error_feedback=chosen.error_feedback and placed.on_finish is None,
        )
        return self._issue(
            request, [placed], async_op,
            f"all_reduce ({wire_dtype}[{count}] {reduce_op.value})", key, timeout_s,
        )

    def _next_key(self) -> int:
        return next(self._keys)  # atomic: one bytecode-level call under the GIL

    # -- the other collectives (torch.distributed's names and semantics) ---------

    def broadcast(self, array: Buffer, src: int, async_op: bool = False) -> Work | None:
        """Rank `src`'s `array` into every rank's `array`, in place."""
        return self._collective("broadcast", array, None, async_op, root=src, in_place=True)

    def reduce(
        self, array: Buffer, dst: int, op: str | ReduceOp = "sum", async_op: bool = False
    ) -> Work | None:
        """Reduce every rank's `array` into rank `dst`'s, in place; others keep theirs."""
        return self._collective("reduce", array, None, async_op, root=dst, op=op, in_place=True)

    def all_gather(
        self, output: Buffer, input: Buffer, async_op: bool = False
    ) -> Work | None:
        """`output` (world_size × input elements) receives every rank's input, in rank order."""
        return self._collective("all_gather", input, output, async_op)

    def reduce_scatter(
        self, output: Buffer, input: Buffer, op: str | ReduceOp = "sum",
        async_op: bool = False, compression: str | None = None, error_feedback: bool = False,
    ) -> Work | None:
        """`input` holds world_size chunks; rank r's `output` gets chunk r reduced over
        ranks.  `compression`, `error_feedback`: as for `all_reduce`."""
        return self._collective("reduce_scatter", input, output, async_op, op=op,
                                compression=(compression, error_feedback))

    def gather(
        self, output: Buffer | None, input: Buffer, dst: int, async_op: bool = False
    ) -> Work | None:
        """Rank `dst`'s `output` (world_size × input) receives every rank's input."""
        return self._collective("gather", input, output, async_op, root=dst)

    def scatter(
        self, output: Buffer, input: Buffer | None, src: int, async_op: bool = False
    ) -> Work | None:
        """Rank `src`'s `input` (world_size chunks): chunk r goes to rank r's `output`."""
        return self._collective("scatter", input, output, async_op, root=src)

    def all_to_all(
        self, output: Buffer, input: Buffer, async_op: bool = False
    ) -> Work | None:
        """Equal splits: rank i's j-th input chunk becomes rank j's i-th output chunk."""
        return self._collective("all_to_all", input, output, async_op)

    def barrier(self, async_op: bool = False, timeout_s: float | None = None) -> Work | None:
        """Return once every rank of the job has reached its barrier.

        On timeout the `CollectiveTimeoutError` names the ranks that did not
        arrive (`details["missing"]`): the daemon knows who submitted.
        """
        if self._barrier_buffer is None:
            self._barrier_buffer = self.empty(1, np.int8)
        return self.all_reduce(self._barrier_buffer, "max", async_op=async_op,
                               timeout_s=timeout_s)

    def _collective(
        self,
        kind: str,
        input: Buffer | None,
        output: Buffer | None,
        async_op: bool,
        root: int | None = None,
        op: str | ReduceOp | None = None,
        in_place: bool = False,
        compression: tuple[str | None, bool] = (None, False),
    ) -> Work | None:
        self._check_open()
        if root is not None and not (
            is_integer(root) and 0 <= root < self.world_size
        ):
            raise InvalidArgumentError(
                f"{kind}: root rank must be in [0, {self.world_size}), got {root!r}"
            )
        arrays = [a for a in (input, output) if a is not None]
        if not arrays:
            raise InvalidArgumentError(f"{kind}: no buffer given")
        checked = {id(a): self._check_array(a, op or "sum") for a in arrays}
        names = [checked[id(a)].dtype for a in arrays]
        if len(set(names)) > 1:
            raise InvalidArgumentError(f"{kind}: input is {names[0]} but output is {names[1]}")
        reduce_op = parse_reduce_op(op) if op is not None else None
        chosen = choose(*compression, self.compression, kind, names[0],
                        reduce_op.value if reduce_op else None,
                        checked[id(arrays[0])].device is not None)
        placed_in = self._place(input, copy_in=True, copy_out=in_place,
                                device=checked[id(input)].device if input is not None else None)
        placed_out = self._place(output, copy_in=False, copy_out=True,
                                 device=checked[id(output)].device if output is not None else None)
        request = functools.partial(
            wire.Collective, kind, segment=placed_in.segment, offset=placed_in.offset,
            count=0 if input is None else checked[id(input)].elements,
            out_segment=placed_out.segment, out_offset=placed_out.offset,
            out_count=None if output is None else checked[id(output)].elements,
            dtype=names[0], op=reduce_op, root=root, timeout_s=self.timeout_s,
            compression=chosen.format,
            error_feedback=chosen.error_feedback and placed_in.on_finish is None,
        )
        return self._issue(request, [placed_in, placed_out], async_op, kind)

    def _place(
        self, array: Any, copy_in: bool, copy_out: bool, device: DeviceArrayInfo | None = None
    ) -> Placed:
        """Where the daemon finds `array`: its own segment, or a scratch copy.

        `device` is the description `_check_array` made of a device array.
        """
        if device is not None:
            if device.count == 0:
                return Placed(None, 0)
            placed = self._device_buffers().place(device, copy_in, copy_out)
            return Placed(placed.segment, placed.offset, placed.on_success, placed.on_finish)
        if array is None or array.size == 0:
            return Placed(None, 0)
        located = self._segments.locate(array)
        if located is not None:
            return Placed(*located)
        slot = self._scratch_slot(array.nbytes)
        staged = slot.view(array.dtype, int(array.size))
        if copy_in:
            np.copyto(staged, array.reshape(-1))

        def copy_back() -> None:
            np.copyto(array.reshape(-1), staged)

        return Placed(
            slot.segment_id, 0, copy_back if copy_out else None,
            lambda: self._scratch.give_back(slot),
        )

    def _issue(
        self, request: Callable[..., wire.Collective], placed: list[Placed], async_op: bool,
        what: str, key: int | None = None, timeout_s: float | None = None,
    ) -> Work | None:
        """Send one collective, `request(key=...)`, with `key` (default: the next
        one); wait unless `async_op`."""
        successes = [p.on_success for p in placed if p.on_success is not None]
        finishes = [p.on_finish for p in placed if p.on_finish is not None]

        def on_success() -> None:
            for step in successes:
                step()

        def on_finish() -> None:
            for step in finishes:
                step()

        with self._submit_lock:
            if key is None:
                key = next(self._keys)
            try:
                request_id = self._connection.send_message(request(key=key).to_wire)
            except GradsyncError:
                on_finish()
                raise
        timeout = timeout_s or self.timeout_s or self._daemon_timeout_s
        work = Work(
            self._connection,
            request_id,
            lambda: f"{what} #{key} of job {self.job!r} rank {self.rank}",
            time.monotonic() + timeout + _GUARD_MARGIN_S,
            on_success if successes else None,
            on_finish if finishes else None,
        )
        if async_op:
            return work
        work.wait()
        return None

    # -- sub-groups --------------------------------------------------------------

    def new_group(self, ranks: Sequence[int]) -> Client | None:
        """A sub-group of these ranks, numbered in the order given (torch's new_group).

        Every rank of the job must call it, in the same order; non-members get
        None.  The group is an independent job in the daemons, with its own
        keys, and has every collective method; closing this client closes it.
        """
        self._check_open()
        self._groups_created += 1
        members, name = group_job(self.job, self.world_size, self._groups_created, ranks)
        if self.rank not in members:
            return None
        local = local_ranks(self._connection, self.job, self.local_world_size,
                            self.timeout_s or self._daemon_timeout_s, _HELLO_TIMEOUT_S)
        local_members = [r for r in members if r in local]
        group = Client(
            daemon=self.daemon, job=name, rank=members.index(self.rank),
            world_size=len(members), local_rank=local_members.index(self.rank),
            local_world_size=len(local_members), timeout_s=self.timeout_s,
            _segments=self._segments,
        )
        group.ranks = tuple(members)
        self._groups.append(group)
        return group

    def _check_array(self, array: Any, op: str | ReduceOp) -> Checked:
        """What a collective needs to know of its array, after checking it."""
        return check_array(array, op, self._cupy)

    def _cupy(self) -> Any:
        """cupy, as the device buffers loaded it (for a device array's description)."""
        return self._device_buffers().cp
