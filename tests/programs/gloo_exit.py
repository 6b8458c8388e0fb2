"""Leaving a rank program that met torch's gloo without tripping torch 2.13's
exit abort.

torch 2.13's DistributedDataParallel keeps its gloo process group alive after
destroy_process_group() (its pt_gloo_runloop threads stay), and a normal
interpreter exit now and then aborts with "terminate called without an active
exception".  A 7-line program with DDP, gloo and no gradsync at all does the
same (once in 76 two-rank runs here; in CI runs of the accelerate and fabric
reference runs too).  Called once every result is written.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def exit_past_torch_gloo(code: int) -> None:
    """Exit without running C++ static destructors."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave_if_gloo() -> None:
    """On a gloo default group: wait until every rank is here (its record written:
    a launcher may return as soon as rank 0 does), then exit that way."""
    if dist.is_initialized() and dist.get_backend() == "gloo":
        dist.barrier()
        exit_past_torch_gloo(0)
