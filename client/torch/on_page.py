"""Small allreduces through torch, done on the fast page before `allreduce()` returns.

torch calls a process group's `allreduce()` and then waits on the Work it
gets, so a small one issued asynchronously and completed later by a thread
costs two thread hand-offs, which are most of its time.  One small enough
for the job's fast page (a single contiguous CPU tensor) is tried there
first, at once, for at most `PAGE_WAIT_S`: if every rank of the node comes
in that time, `allreduce()` hands back a completed Work; if not, the key is
withdrawn and the collective goes over the socket as any other, so a rank
whose peers come late is held up that long at most, never waits for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradsync.client.client import Client
from gradsync.client.torch.tensors import as_buffer, flat_wire_tensor, wire_op
from gradsync.client.work import Work as GradsyncWork

#: How long `allreduce()` waits on the fast page for the other ranks before it
#: sends the collective over the socket (and returns a Work still in flight).
#: Longer than a sleeping peer's wake-up on a VM (fast_path.WAKER_SPIN_S).
PAGE_WAIT_S = 2e-3


def page_issue(
    client: Client, tensors: Sequence[torch.Tensor], op: Any
) -> Callable[[], list[GradsyncWork | None]] | None:
    """The issue step of an allreduce the fast page may finish at once, or None
    when it cannot (no page, more than one tensor, too big, not contiguous, not CPU)."""
    limit = client.fast_path_bytes
    if not limit or len(tensors) != 1:
        return None
    tensor = tensors[0]
    if (tensor.device.type != "cpu" or not tensor.is_contiguous()
            or tensor.numel() * tensor.element_size() > limit):
        return None
    array, name = as_buffer(flat_wire_tensor(tensor)), wire_op(tensor, op)

    def issue() -> list[GradsyncWork | None]:
        return [client.all_reduce(array, op=name, async_op=True, _fast_wait_s=PAGE_WAIT_S)]

    return issue
