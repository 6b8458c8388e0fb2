"""Compression per torch process group on backend "gradsync".

    import gradsync.client.torch.compression as gc
    gc.set_compression(None, "fp8", error_feedback=True)   # the default group

After that line torch's DDP, FSDP2 and any other user of the group send the
float32/float64 sum and avg allreduces and reduce-scatters of that group
compressed between daemons; every other collective stays exact.  Without it
the group follows `GRADSYNC_COMPRESSION` (job-wide, read when the group is
made).  The setting is the group's client's default (client/compression.py),
so nothing in the process group's collectives changes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradsync.client.compression import Compression
from gradsync.protocol.errors import InvalidArgumentError


def _gradsync_backend(group: Any) -> Any:
    """The `ProcessGroupGradsync` behind `group` (None: the default group)."""
    from gradsync.client.torch.backend import ProcessGroupGradsync

    if group is None:
        group = dist.distributed_c10d._get_default_group()
    if isinstance(group, ProcessGroupGradsync):  # torch's group is ours (extended API)
        return group
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        backend = None
    if not isinstance(backend, ProcessGroupGradsync):
        raise InvalidArgumentError(
            f"set_compression: group {getattr(group, 'group_name', group)!r} does not run on "
            "backend gradsync")
    return backend


def set_compression(group: Any, compression: str | None, error_feedback: bool = False) -> None:
    """Compress `group`'s float sums between daemons with `compression` ("bf16",
    "fp8"; None or "none": exact), feeding rounding residuals back with
    `error_feedback`.  `group`: a process group, or None for the default one."""
    _gradsync_backend(group).client.compression = Compression.parse(compression, error_feedback)


def compression_of(group: Any) -> Compression:
    """What `group` sends between daemons now."""
    chosen: Compression = _gradsync_backend(group).client.compression
    return chosen
