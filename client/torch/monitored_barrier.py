"""`monitored_barrier` for groups on gradsync: a barrier whose error names who is missing.

torch's own `dist.monitored_barrier` refuses every backend but gloo before it
reaches the process group, so gradsync offers its own with the same
arguments, and `install` (run when `gradsync.client.torch` is imported) makes
torch's function call it for groups on gradsync.  It needs no extra round: the
daemon matched the barrier, so its timeout error already lists the ranks that
never submitted it, and every rank that did arrive raises naming all of them
(gloo names them on rank 0 only, and only the first unless `wait_all_ranks`).
"""

from __future__ import annotations

import datetime
import functools
from typing import Any

import torch
import torch.distributed as dist

from gradsync.client.torch.backend import ProcessGroupGradsync
from gradsync.client.torch.work import torch_error
from gradsync.protocol.errors import CollectiveTimeoutError, GradsyncError

__all__ = ["install", "monitored_barrier"]

#: torch's own, which `install` wraps.
_TORCH_MONITORED_BARRIER = dist.monitored_barrier


def monitored_barrier(
    group: Any = None,
    timeout: datetime.timedelta | float | None = None,
    wait_all_ranks: bool = False,
) -> None:
    """Wait for every rank of `group` (default: the world) up to `timeout`.

    Raises `DistBackendError` naming the ranks that did not arrive in time, in
    gloo's words first ("Rank 1 failed to pass monitoredBarrier in 2000 ms"),
    then gradsync's; `wait_all_ranks` names them all in gloo's part too
    (gradsync's names them all anyway).
    """
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = _gradsync_backend(group)
    if backend is None:
        raise ValueError(
            f"gradsync's monitored_barrier needs a group on backend gradsync, not "
            f"{dist.get_backend(group)!r} (use torch.distributed.monitored_barrier there)")
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    name = backend.group_name or "default"
    try:
        # A zero timeout still takes part, so every rank's collectives stay in step.
        backend.client.barrier(timeout_s=None if seconds is None else max(seconds, 1e-3))
    except CollectiveTimeoutError as exc:
        missing = exc.details.get("missing", "?")
        raise dist.DistBackendError(
            f"{_gloo_words(backend.rank(), missing, seconds, wait_all_ranks)} (gradsync: "
            f"ranks {missing} of process group {name!r} did not arrive within "
            f"{seconds if seconds is not None else 'the group timeout'}"
            f"{'s' if seconds is not None else ''}; rank {backend.rank()} did)") from exc
    except GradsyncError as exc:
        raise torch_error(exc, name) from exc


def _gloo_words(rank: int, missing: Any, seconds: float | None, all_ranks: bool) -> str:
    """What gloo says where it fails, the phrases torch's own tests look for."""
    ms = "?" if seconds is None else f"{round(seconds * 1000)}"
    if seconds is not None and seconds <= 0:
        return f"Rank {rank} timed out in monitoredBarrier after {ms} ms"
    if not isinstance(missing, list) or not missing:
        return f"Ranks failed to pass monitoredBarrier in {ms} ms"
    if all_ranks and len(missing) > 1:
        return f"Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier in {ms} ms"
    return f"Rank {missing[0]} failed to pass monitoredBarrier in {ms} ms"


def install() -> None:
    """Let `torch.distributed.monitored_barrier` serve groups on gradsync too.

    torch's own refuses every backend but gloo before it reaches the group; the
    wrapper sends a gradsync group here and everything else to torch's, unchanged.
    """
    if getattr(dist.monitored_barrier, "__wrapped__", None) is _TORCH_MONITORED_BARRIER:
        return

    @functools.wraps(_TORCH_MONITORED_BARRIER)
    def dispatching(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        mine = group if group is not None else dist.distributed_c10d._get_default_group()
        if mine is not dist.GroupMember.NON_GROUP_MEMBER and _gradsync_backend(mine) is not None:
            monitored_barrier(mine, timeout, wait_all_ranks)
        else:
            _TORCH_MONITORED_BARRIER(group, timeout, wait_all_ranks)

    dist.monitored_barrier = dispatching
    dist.distributed_c10d.monitored_barrier = dispatching


def _gradsync_backend(group: Any) -> ProcessGroupGradsync | None:
    """The gradsync process group behind `group` (itself, or its CPU backend), else None."""
    if isinstance(group, ProcessGroupGradsync):
        return group
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (RuntimeError, AttributeError):
        return None
    return backend if isinstance(backend, ProcessGroupGradsync) else None
