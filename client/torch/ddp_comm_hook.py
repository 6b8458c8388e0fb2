"""`comm_hook`: torch's own DDP, its gradient buckets averaged through gradsync.

Kept apart from our DDP wrapper (`ddp.py`): here torch owns the buckets.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from gradsync.client.client import Client
from gradsync.client.torch.buckets import as_array
from gradsync.client.work import Work
from gradsync.protocol.errors import GradsyncError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket

__all__ = ["comm_hook"]


def comm_hook(state: Client, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A torch DDP communication hook that averages each bucket through gradsync.

    Register it with `ddp.register_comm_hook(client, comm_hook)`.  torch owns
    the bucket's memory, so the client stages it through shared memory (one
    copy each way); a waiter thread per client completes the returned future
    once the daemon is done, so backward keeps running meanwhile.
    """
    tensor = bucket.buffer()
    work = state.all_reduce(tensor if tensor.is_cuda else as_array(tensor), op="avg",
                            async_op=True)
    assert work is not None
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    _waiter_for(state).put((work, future, tensor))
    return future


def _annotate_for_torch_ddp() -> None:
    """Give `comm_hook` evaluated annotations: torch's DDP compares them with the classes.

    (`from __future__ import annotations` leaves them as strings, which
    `register_comm_hook` rejects.)
    """
    annotations: dict[str, Any] = {
        "state": Client, "return": torch.futures.Future[torch.Tensor]
    }
    if torch.distributed.is_available():
        from torch._C._distributed_c10d import GradBucket as TorchGradBucket  # dist.GradBucket

        annotations["bucket"] = TorchGradBucket
    comm_hook.__annotations__ = annotations


_annotate_for_torch_ddp()

_Pending = tuple[Work, "torch.futures.Future[torch.Tensor]", torch.Tensor]
_WAITERS: weakref.WeakKeyDictionary[Client, queue.SimpleQueue[_Pending | None]] = (
    weakref.WeakKeyDictionary()
)
_WAITERS_LOCK = threading.Lock()


def _waiter_for(client: Client) -> queue.SimpleQueue[_Pending | None]:
    """The queue of the client's waiter thread (started on first use, stopped with the client)."""
    with _WAITERS_LOCK:
        pending = _WAITERS.get(client)
        if pending is None:
            pending = queue.SimpleQueue()
            _WAITERS[client] = pending
            threading.Thread(
                target=_complete_futures, args=(pending,), name="gradsync-comm-hook", daemon=True
            ).start()
            weakref.finalize(client, pending.put, None)
        return pending


def _complete_futures(pending: queue.SimpleQueue[_Pending | None]) -> None:
    """Complete each hook's future in submission order, with the result or the error."""
    while (item := pending.get()) is not None:
        work, future, tensor = item
        try:
            work.wait()
        except GradsyncError as exc:
            # torch's stub types the argument as the result type; it takes an exception.
            future.set_exception(exc)  # type: ignore[arg-type]
        else:
            future.set_result(tensor)
