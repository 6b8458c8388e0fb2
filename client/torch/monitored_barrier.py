"""`monitored_barrier` for groups on gradsync: a barrier whose error names who is missing.

torch's own `dist.monitored_barrier` refuses every backend but gloo before it
reaches the process group, so gradsync offers its own with the same
arguments.  It needs no extra round: the daemon matched the barrier, so its
timeout error already lists the ranks that never submitted it, and every rank
that did arrive raises naming all of them (gloo names them on rank 0 only, and
only the first unless `wait_all_ranks`).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from gradsync.client.torch.backend import ProcessGroupGradsync
from gradsync.client.torch.work import torch_error
from gradsync.protocol.errors import CollectiveTimeoutError, GradsyncError

__all__ = ["monitored_barrier"]


def monitored_barrier(
    group: Any = None,
    timeout: datetime.timedelta | None = None,
    wait_all_ranks: bool = False,
) -> None:
    """Wait for every rank of `group` (default: the world) up to `timeout`.

    Raises `DistBackendError` naming the ranks that did not arrive in time;
    `wait_all_ranks` is accepted for torch's signature (all are always named).
    """
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = group if isinstance(group, ProcessGroupGradsync) else _cpu_backend(group)
    if not isinstance(backend, ProcessGroupGradsync):
        raise ValueError(
            f"gradsync's monitored_barrier needs a group on backend gradsync, not "
            f"{dist.get_backend(group)!r} (use torch.distributed.monitored_barrier there)")
    seconds = timeout.total_seconds() if timeout is not None else None
    name = backend.group_name or "default"
    try:
        backend.client.barrier(timeout_s=seconds)
    except CollectiveTimeoutError as exc:
        missing = exc.details.get("missing", "?")
        raise dist.DistBackendError(
            f"gradsync monitored_barrier: ranks {missing} of process group {name!r} did "
            f"not arrive within {seconds if seconds is not None else 'the group timeout'}"
            f"{'s' if seconds is not None else ''} (rank {backend.rank()} did)") from exc
    except GradsyncError as exc:
        raise torch_error(exc, name) from exc


def _cpu_backend(group: Any) -> Any:
    """The backend a wrapping group runs CPU tensors on (None: it has none)."""
    try:
        return group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return None
