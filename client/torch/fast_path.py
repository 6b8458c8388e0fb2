"""Small allreduces through torch, done on the fast page before `allreduce()` returns.

torch calls a process group's `allreduce()` and then waits on the Work it
gets, so a small one issued asynchronously and completed later by a thread
costs two thread hand-offs, which are most of its time.  One small enough
for the job's fast page (a single contiguous CPU tensor) is tried there
first, at once, for at most `PAGE_WAIT_S`: if every rank of the node comes
in that time, `allreduce()` hands back a completed Work; if not, the key is
withdrawn and the collective goes over the socket as any other, so a rank
whose peers come late is held up that long at most, never waits for them.

At these sizes the Python around the page is the time (benchmarks/RESULTS.md),
so the view of a tensor that keeps coming back (a framework allreduces the
same flag or loss tensor every step) is made once and looked up after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gradsync.client.client import Client
from gradsync.client.fast_path import PageCall
from gradsync.client.torch.completer import FutureCompleter
from gradsync.client.torch.tensors import as_buffer, flat_wire_tensor, wire_op
from gradsync.client.torch.work import CompletedWork, Operation, TorchWork, torch_error
from gradsync.protocol.errors import GradsyncError

#: How long `allreduce()` waits on the fast page for the other ranks before it
#: sends the collective over the socket (and returns a Work still in flight).
#: Longer than a sleeping peer's wake-up on a VM (fast_path.WAKER_SPIN_S).
PAGE_WAIT_S = 2e-3
#: Views kept: each holds its tensor's memory (at most the page's limit, 64 KiB).
VIEWS_KEPT = 8

#: (address, dtype, elements, reduce op) → (the wire tensor, its array, its checked call)
_ViewKey = tuple[int, torch.dtype, int, Any]
_View = tuple[torch.Tensor, np.ndarray, PageCall]


@dataclasses.dataclass(frozen=True)
class _Last:
    """The tensor object and op kind of the last page allreduce, what it took, and the
    completed handle it got (torch's caller waits on it and drops it; it holds only
    the tensor, so handing it out again for the same tensor changes nothing)."""

    tensor: torch.Tensor
    op_type: type
    op_kind: int
    address: int
    numel: int
    array: np.ndarray
    call: PageCall
    done: CompletedWork


class FastPathAllreduce:
    """A group's small allreduces on its client's fast page."""

    def __init__(
        self, client: Client, completer: FutureCompleter, group_name: Callable[[], str]
    ) -> None:
        self._client = client
        self._completer = completer
        self._group_name = group_name
        self._limit = client.fast_path_bytes
        self._views: dict[_ViewKey, _View] = {}
        #: The last call's tensor (the same object) and op: its view without a lookup.
        self._last: _Last | None = None

    def __call__(self, tensors: Sequence[torch.Tensor], op: Any) -> dist.Work | None:
        """The allreduce's Work (complete if it ended on the page), or None when the
        page cannot take it (no page, more than one tensor, too big, not contiguous,
        not on the CPU)."""
        if not self._limit or len(tensors) != 1:
            return None
        tensor = tensors[0]
        last = self._last
        # A torch ReduceOp hashes to its kind (SUM 0, AVG 1, ...): 0.07 us, where `==`
        # costs 0.3-0.7 us.  The one kind with more to it, PREMUL_SUM, is refused.
        if (last is not None and tensor is last.tensor and type(op) is last.op_type
                and hash(op) == last.op_kind
                and tensor.data_ptr() == last.address and tensor.numel() == last.numel
                and tensor.is_contiguous()):
            array, call, done = last.array, last.call, last.done  # the same call again
        else:
            try:
                found = self._view(tensor, op)
            except GradsyncError as exc:  # the tensor's dtype or the op refused
                raise torch_error(exc, self._group_name()) from exc
            if found is None:
                return None
            array, call = found
            done = CompletedWork([tensor])
            self._last = _Last(tensor, type(op), hash(op), tensor.data_ptr(), tensor.numel(),
                               array, call, done)
        try:
            work = self._client.page_all_reduce(array, call, PAGE_WAIT_S)
        except GradsyncError as exc:
            raise torch_error(exc, self._group_name()) from exc
        if work is None:
            return done  # finished: one handle serves every call that ends so
        outputs = list(tensors)
        return TorchWork(Operation(self._group_name, "allreduce", [work], outputs),
                         self._completer)

    def _view(self, tensor: torch.Tensor, op: Any) -> tuple[np.ndarray, PageCall] | None:
        """The array over `tensor`'s memory and its checked call, made once per tensor.

        A kept view is the right one while the tensor it holds still starts at the
        address: that memory cannot belong to anything else, so a tensor found there,
        contiguous and of the same dtype and length, is a view of the same bytes.
        """
        address = tensor.data_ptr()
        key = (address, tensor.dtype, tensor.numel(), getattr(op, "op", op))
        kept = self._views.get(key)
        if (kept is not None and kept[0].data_ptr() == address and tensor.is_cpu
                and tensor.is_contiguous()):
            return kept[1], kept[2]
        if (not tensor.is_cpu or not tensor.is_contiguous()
                or tensor.numel() * tensor.element_size() > self._limit):
            return None
        wire = flat_wire_tensor(tensor)
        array = as_buffer(wire)
        view = (wire, array, self._client.page_call(array, wire_op(tensor, op)))
        if len(self._views) >= VIEWS_KEPT:
            self._views.clear()
        self._views[key] = view
        return view[1], view[2]

    def forget(self) -> None:
        """Let go of the kept views (the group shuts down)."""
        self._views.clear()
        self._last = None
