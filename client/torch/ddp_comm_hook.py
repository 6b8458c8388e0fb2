"""`comm_hook`: torch's own DDP, its gradient buckets averaged through gradsync.

Kept apart from our DDP wrapper (`ddp.py`): here torch owns the buckets.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from gradsync.client.client import Client
from gradsync.client.torch.buckets import as_array
from gradsync.client.torch.completer import FutureCompleter
from gradsync.client.work import Work
from gradsync.protocol.errors import GradsyncError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket

__all__ = ["comm_hook"]


def comm_hook(state: Client, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A torch DDP communication hook that averages each bucket through gradsync.

    Register it with `ddp.register_comm_hook(client, comm_hook)`.  torch owns
    the bucket's memory, so the client stages it through shared memory (one
    copy each way); a completer thread per client completes the returned future
    once the daemon is done, so backward keeps running meanwhile.
    """
    tensor = bucket.buffer()
    work = state.all_reduce(tensor if tensor.is_cuda else as_array(tensor), op="avg",
                            async_op=True)
    assert work is not None
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    _completer_for(state).submit(functools.partial(_settle_when_done, work, future, tensor))
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

#: Each client's completer (started on first use, stopped once the client is gone).
_COMPLETERS: weakref.WeakKeyDictionary[Client, FutureCompleter] = weakref.WeakKeyDictionary()
_COMPLETERS_LOCK = threading.Lock()


def _completer_for(client: Client) -> FutureCompleter:
    """The client's completer: its futures complete in submission order, on its thread."""
    with _COMPLETERS_LOCK:
        completer = _COMPLETERS.get(client)
        if completer is None:
            completer = _COMPLETERS[client] = FutureCompleter("gradsync-comm-hook")
            weakref.finalize(client, completer.stop)
        return completer


def _settle_when_done(
    work: Work, future: torch.futures.Future[torch.Tensor], tensor: torch.Tensor
) -> Callable[[], None]:
    """Wait for the bucket's allreduce; what then completes its future, with the result or
    the error."""
    try:
        work.wait()
    except GradsyncError as exc:
        # torch's stub types the argument as the result type; it takes an exception.
        return functools.partial(future.set_exception, exc)  # type: ignore[arg-type]
    return functools.partial(future.set_result, tensor)
