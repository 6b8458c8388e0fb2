"""Our `DistributedDataParallel`: gradients are views of daemon memory, handed over as they fill.

`DistributedDataParallel` is a drop-in for `torch.nn.parallel.DistributedDataParallel`
on CPU: gradients are views into daemon-owned shared-memory buckets, each bucket
is handed to the daemon (`all_reduce(avg, async_op=True)`) by a post-accumulate-grad
hook the moment its last gradient is ready, while backward goes on, and the end
of backward waits for all of them, so `loss.backward(); optimizer.step()` needs
nothing more.  `StepRecord` and `BucketTiming` record how much of it overlapped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from gradsync.client.client import Client
from gradsync.client.compression import Compression
from gradsync.client.torch.buckets import (
    MIB,
    Bucket,
    assign_buckets,
    bucket_elements,
    make_bucket,
    numpy_dtype,
)
from gradsync.client.work import Work
from gradsync.protocol.errors import InvalidArgumentError

#: Bucket dtypes whose allreduce may be compressed between daemons.
COMPRESSIBLE = (torch.float32, torch.float64)

__all__ = ["BucketTiming", "DistributedDataParallel", "StepRecord"]

#: Offsets of tensors packed into one broadcast buffer (any dtype can view them).
_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class BucketTiming:
    """When one bucket of a step was handed over and what the daemon saw.

    `handed_over` is this process's `time.monotonic()`; `timing` holds the
    daemon's CLOCK_MONOTONIC `submitted`, `matched` and `completed` times, on
    the same clock, so they compare directly with `StepRecord.backward_end`.
    """

    index: int
    dtype: str
    nbytes: int
    params: tuple[str, ...]
    handed_over: float
    during_backward: bool
    timing: dict[str, float]


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """The overlap record of one synchronised backward."""

    #: time.monotonic() when autograd finished (the end-of-backward callback ran).
    backward_end: float
    #: time.monotonic() once every bucket's result was in place.
    synced: float
    buckets: tuple[BucketTiming, ...]

    def hidden_fraction(self) -> float:
        """Share of communication time (hand-over to completion) spent before backward ended."""
        total = hidden = 0.0
        for bucket in self.buckets:
            completed = bucket.timing.get("completed", self.synced)
            span = max(0.0, completed - bucket.handed_over)
            total += span
            hidden += max(0.0, min(completed, self.backward_end) - bucket.handed_over)
        return hidden / total if total > 0 else 0.0


class DistributedDataParallel(torch.nn.Module):
    """Data-parallel training through gradsync, as torch's DDP does it through a process group.

    At construction, rank 0's parameters and buffers are broadcast to every
    rank and the trainable parameters are grouped into buckets (reverse
    registration order, a first bucket of `first_bucket_mb` so communication
    starts early, then up to `bucket_cap_mb`, one dtype each).  A backward
    after a forward outside `no_sync()` averages every gradient across ranks.
    Parameters that got no gradient on some rank take part with zeros; those no
    rank used keep the gradient they had (None after `zero_grad()`), as with
    torch's `find_unused_parameters=True`.  `last_step` records the overlap.
    As torch's DDP does, the first synchronised backward records the order in
    which gradients became ready, and the buckets are rebuilt in rank 0's
    order (every rank the same) when it differs from the assumed one.
    `compression` ("bf16", "fp8") and `error_feedback` set the wire format of
    float32/float64 buckets between daemons (docs/compression.md).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        client: Client | None = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        gradient_as_bucket_view: bool = True,
        broadcast_buffers: bool = True,
        compression: str | None = None,
        error_feedback: bool = False,
    ) -> None:
        super().__init__()
        #: The wire format between daemons for float32/float64 buckets
        #: (docs/compression.md; None: the client's default, GRADSYNC_COMPRESSION); other
        #: buckets stay exact.
        self.compression = Compression.parse(compression, error_feedback)
        if bucket_cap_mb <= 0 or first_bucket_mb <= 0:
            raise InvalidArgumentError(
                f"bucket sizes must be positive, got bucket_cap_mb={bucket_cap_mb}, "
                f"first_bucket_mb={first_bucket_mb}"
            )
        self.module = module
        self.client = client if client is not None else Client()
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.broadcast_buffers = broadcast_buffers
        #: The overlap record of the last synchronised backward.
        self.last_step: StepRecord | None = None

        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        #: Where the buckets live: None for host shared memory, else the CUDA device.
        self._device = _one_device(module)
        self._names = [name for name, _ in named]
        self._params = [param for _, param in named]
        for name, param in named:
            try:
                numpy_dtype(param.dtype)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"parameter {name}: {exc}") from None
            if param.is_sparse:
                raise InvalidArgumentError(f"sparse parameter {name} is not supported")

        with torch.no_grad():  # a one-off buffer: freed in the daemon once dropped
            _StateBroadcaster(self.client).run([*module.parameters(), *module.buffers()])
        self._buffer_sync = _StateBroadcaster(self.client)

        self._caps = (int(first_bucket_mb * MIB), int(bucket_cap_mb * MIB))
        self._set_buckets(self._allocate_buckets(assign_buckets(self._params, *self._caps)))
        #: Indices in the order their gradients became ready, until the rebuild.
        self._ready_order: list[int] | None = []
        # Per accumulation window (reset after each synchronised backward).
        self._used = [False] * len(self._params)
        self._materialized = [False] * len(self._params)
        # Per backward.
        self._require_backward_grad_sync = True
        self._buffers_stale = True
        self._armed = False
        self._callback_queued = False
        self._next_bucket = 0
        self._in_flight: list[tuple[Bucket, Work, float, bool]] = []

        me = weakref.ref(self)
        self._hook_handles = [
            param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                _grad_hook(me, i)
            )
            for i, param in enumerate(self._params)
        ]

    def _set_buckets(self, buckets: list[Bucket]) -> None:
        self._buckets = buckets
        self._slot = {
            i: (bucket, position)
            for bucket in buckets
            for position, i in enumerate(bucket.param_indices)
        }

    def _allocate_buckets(self, assignment: list[list[int]]) -> list[Bucket]:
        buckets = []
        for index, indices in enumerate(assignment):
            dtype = numpy_dtype(self._params[indices[0]].dtype)
            count = bucket_elements(indices, self._params)
            array = (self.client.empty(count, dtype) if self._device is None
                     else self.client.empty(count, dtype, device=self._device, like="torch"))
            buckets.append(make_bucket(index, indices, self._params, array))
        return buckets

    # -- what users call ------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; arm the next backward to synchronise gradients.

        As in torch's DDP, the decision is taken here: a forward inside
        `no_sync()` (or without autograd) leaves its backward local.  Buffers
        are re-broadcast from rank 0 before the first forward and before each
        forward that follows a synchronising one (torch's rule), so every rank
        must run the same sequence of forwards; evaluate on one rank through
        `.module`.
        """
        grad_enabled = torch.is_grad_enabled()
        if self.broadcast_buffers and self._buffers_stale:
            with torch.no_grad():
                self._buffer_sync.run(list(self.module.buffers()))
        self._armed = grad_enabled and self._require_backward_grad_sync
        # torch's rule: buffers are re-broadcast before the forward after a synchronising
        # one, so the first evaluation after training also sees rank 0's running stats.
        self._buffers_stale = self._armed
        if self._armed:
            self._reset_backward()
        if grad_enabled and self.gradient_as_bucket_view:
            self._attach_grads()
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first synchronised backward after averages the sum."""
        previous = self._require_backward_grad_sync
        self._require_backward_grad_sync = False
        try:
            yield
        finally:
            self._require_backward_grad_sync = previous

    @property
    def bucket_layout(self) -> list[list[str]]:
        """Parameter names per bucket, in the order the buckets are handed over."""
        return [[self._names[i] for i in bucket.param_indices] for bucket in self._buckets]

    def bucket_tensors(self) -> list[torch.Tensor]:
        """Each bucket's whole shared-memory array as a tensor (gradients, then flags)."""
        return [bucket.tensor for bucket in self._buckets]

    # -- gradients in the buckets --------------------------------------------------

    def _attach_grads(self) -> None:
        """Point every `param.grad` at its bucket view before backward accumulates into it."""
        with torch.no_grad():
            for bucket in self._buckets:
                grads = [self._params[i].grad for i in bucket.param_indices]
                zeroed = all(g is None for g in grads)
                if zeroed:  # the usual case after zero_grad(): one fill for the bucket
                    bucket.tensor.zero_()
                for position, i in enumerate(bucket.param_indices):
                    grad, view = grads[position], bucket.views[position]
                    if not self._params[i].requires_grad:  # frozen since construction
                        continue
                    if grad is None:
                        if not zeroed:
                            view.zero_()
                        self._params[i].grad = view
                        self._materialized[i] = True
                    elif grad.data_ptr() != view.data_ptr():
                        view.copy_(grad)
                        self._params[i].grad = view

    def _grad_ready(self, index: int) -> None:
        """Post-accumulate-grad hook: mark one gradient ready; hand over full buckets."""
        param = self._params[index]
        bucket, position = self._slot[index]
        view = bucket.views[position]
        grad = param.grad
        if grad is None:
            return
        self._used[index] = True
        if self.gradient_as_bucket_view and grad.data_ptr() != view.data_ptr():
            # The grad was reset to None after forward: one copy, then back in the bucket.
            with torch.no_grad():
                view.copy_(grad)
            param.grad = view
        if not self._armed:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if position in bucket.ready:
            raise RuntimeError(
                f"gradsync DDP: parameter {self._names[index]} received its gradient twice "
                "in one backward (reentrant backward or a second backward without forward)"
            )
        if self._ready_order is not None:
            self._ready_order.append(index)
        if not self.gradient_as_bucket_view:
            with torch.no_grad():
                view.copy_(grad)
        bucket.ready.add(position)
        if bucket.is_ready:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Hand over ready buckets strictly in order, so every rank keys them alike."""
        while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].is_ready:
            self._launch(self._buckets[self._next_bucket], during_backward=True)
            self._next_bucket += 1

    def _launch(self, bucket: Bucket, during_backward: bool) -> None:
        flags = [1.0 if self._used[i] else 0.0 for i in bucket.param_indices]
        bucket.flags.copy_(torch.tensor(flags, dtype=bucket.dtype))
        handed_over = time.monotonic()
        wire = self.compression if bucket.dtype in COMPRESSIBLE else Compression()
        work = self.client.all_reduce(bucket.array, op="avg", async_op=True,
                                      compression=wire.format,
                                      error_feedback=wire.error_feedback)
        assert work is not None
        self._in_flight.append((bucket, work, handed_over, during_backward))

    def _fill_missing(self, bucket: Bucket) -> None:
        """Put what a parameter without a gradient this backward contributes into its view."""
        with torch.no_grad():
            for position, i in enumerate(bucket.param_indices):
                if position in bucket.ready:
                    continue
                param, view = self._params[i], bucket.views[position]
                grad = param.grad
                if grad is None:
                    view.zero_()
                    if self.gradient_as_bucket_view:
                        param.grad = view
                        self._materialized[i] = True
                elif grad.data_ptr() != view.data_ptr():
                    view.copy_(grad)
                    if self.gradient_as_bucket_view:
                        param.grad = view
                bucket.ready.add(position)

    def _finish_backward(self) -> None:
        """End of backward: hand over the rest, wait for all buckets, put results in place."""
        backward_end = time.monotonic()
        try:
            for bucket in self._buckets[self._next_bucket :]:
                self._fill_missing(bucket)
                self._launch(bucket, during_backward=False)
            self._next_bucket = len(self._buckets)
            for _, work, _, _ in self._in_flight:
                work.wait()
            synced = time.monotonic()
            self._apply_results()
            if self._ready_order is not None:
                order, self._ready_order = self._ready_order, None
                self._rebuild_buckets(order)
            self.last_step = StepRecord(
                backward_end,
                synced,
                tuple(
                    BucketTiming(
                        bucket.index,
                        str(bucket.dtype).removeprefix("torch."),
                        bucket.nbytes,
                        tuple(self._names[i] for i in bucket.param_indices),
                        handed_over,
                        during_backward,
                        dict(work.timing),
                    )
                    for bucket, work, handed_over, during_backward in self._in_flight
                ),
            )
        finally:
            self._armed = False
            self._reset_backward()

    def _apply_results(self) -> None:
        """Gradients of used parameters are the averages; unused ones keep what they had."""
        with torch.no_grad():
            for bucket in self._buckets:
                used_anywhere = [flag != 0 for flag in bucket.flags.tolist()]
                for position, i in enumerate(bucket.param_indices):
                    param, view = self._params[i], bucket.views[position]
                    if self.gradient_as_bucket_view:
                        if not used_anywhere[position] and self._materialized[i]:
                            param.grad = None
                    elif used_anywhere[position]:
                        if param.grad is None:
                            param.grad = view.clone()
                        else:
                            param.grad.copy_(view)
        self._used = [False] * len(self._params)
        self._materialized = [False] * len(self._params)

    def _rebuild_buckets(self, observed: list[int]) -> None:
        """Lay the buckets out in the order gradients became ready (rank 0's order).

        Runs once, at the end of the first synchronised backward, on every rank
        (the agreement is a broadcast).  Gradients move to the new buckets.
        """
        observed = list(dict.fromkeys(observed))
        seen = set(observed)
        order = observed + [i for i in reversed(range(len(self._params))) if i not in seen]
        if self.client.world_size > 1:
            agreed = np.array(order, dtype=np.int64)
            self.client.broadcast(agreed, src=0)
            order = [int(i) for i in agreed]
        assignment = assign_buckets(self._params, *self._caps, order=order)
        if assignment == [bucket.param_indices for bucket in self._buckets]:
            return
        buckets = self._allocate_buckets(assignment)
        with torch.no_grad():
            for bucket in buckets:
                bucket.tensor.zero_()
                for position, i in enumerate(bucket.param_indices):
                    param, view = self._params[i], bucket.views[position]
                    if param.grad is None:
                        continue
                    view.copy_(param.grad)
                    if self.gradient_as_bucket_view:
                        param.grad = view
        self._set_buckets(buckets)

    def _reset_backward(self) -> None:
        self._callback_queued = False
        self._next_bucket = 0
        self._in_flight = []
        if self._ready_order is not None:
            self._ready_order.clear()  # a backward that failed records nothing
        for bucket in self._buckets:
            bucket.ready.clear()


def _one_device(module: torch.nn.Module) -> int | None:
    """None when every parameter and buffer is on the CPU, else their one CUDA device.

    CUDA buckets live in device memory the daemon shares by CUDA IPC.
    """
    devices = {t.device for t in [*module.parameters(), *module.buffers()]}
    if all(device.type == "cpu" for device in devices):
        return None
    if len(devices) == 1:
        (device,) = devices
        if device.type == "cuda":
            return int(device.index or 0)
    names = ", ".join(sorted(str(d) for d in devices))
    raise InvalidArgumentError(
        f"gradsync's DistributedDataParallel needs the module on the CPU or on one CUDA "
        f"device; it is on {names}"
    )


def _grad_hook(
    ddp: weakref.ReferenceType[DistributedDataParallel], index: int
) -> Callable[[torch.Tensor], None]:
    """A per-parameter hook that does not keep the wrapper alive."""

    def hook(_: torch.Tensor) -> None:
        wrapper = ddp()
        if wrapper is not None:
            wrapper._grad_ready(index)

    return hook


class _StateBroadcaster:
    """Rank 0's tensors into every rank's, packed as bytes into one shared-memory broadcast."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._layout: tuple[tuple[torch.dtype, int], ...] = ()
        self._array: np.ndarray | None = None

    def run(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite `tensors` with rank 0's values (callers hold torch.no_grad())."""
        tensors = [t for t in tensors if t.numel() > 0]
        if self._client.world_size == 1 or not tensors:
            return
        offsets, total = [], 0
        for tensor in tensors:
            total = -(-total // _ALIGN) * _ALIGN
            offsets.append(total)
            total += tensor.numel() * tensor.element_size()
        layout = tuple((t.dtype, t.numel()) for t in tensors)
        if self._array is None or layout != self._layout:
            self._array = self._client.empty(total, np.uint8)
            self._layout = layout
        flat = torch.from_numpy(self._array)
        views = [
            flat[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, offset in zip(tensors, offsets, strict=True)
        ]
        if self._client.rank == 0:
            for tensor, view in zip(tensors, views, strict=True):
                view.copy_(tensor)
        self._client.broadcast(self._array, src=0)
        if self._client.rank != 0:
            for tensor, view in zip(tensors, views, strict=True):
                tensor.copy_(view)
