"""gradsync.client: what a training process imports to talk to its daemon.

`Client`, `Work` and `ReduceOp` load on first use (PEP 562): they import numpy
(and ml_dtypes once a bfloat16 array comes along, see protocol/dtypes.py), which
cost more than a command such as `gradsync ping` spends in all, and every
submodule import (`gradsync.client.cli`) runs this file.
The errors and the version are plain Python and load at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradsync.protocol.errors import (
    CollectiveError,
    CollectiveTimeoutError,
    DaemonLostError,
    DaemonShuttingDownError,
    DaemonUnavailableError,
    GradsyncError,
    InvalidArgumentError,
    JobError,
    MismatchError,
    PeerLostError,
    ProtocolError,
    RankLostError,
    ResourceError,
    ShmExhaustedError,
    VersionMismatchError,
)
from gradsync.protocol.version import __version__

if TYPE_CHECKING:
    from gradsync.client.client import Client
    from gradsync.client.work import Work
    from gradsync.protocol.dtypes import ReduceOp

#: The names loaded on first use, and the module each comes from.
_LAZY = {
    "Client": "gradsync.client.client",
    "Work": "gradsync.client.work",
    "ReduceOp": "gradsync.protocol.dtypes",
}

__all__ = [
    "Client",
    "CollectiveError",
    "CollectiveTimeoutError",
    "DaemonLostError",
    "DaemonShuttingDownError",
    "DaemonUnavailableError",
    "GradsyncError",
    "InvalidArgumentError",
    "JobError",
    "MismatchError",
    "PeerLostError",
    "ProtocolError",
    "RankLostError",
    "ReduceOp",
    "ResourceError",
    "ShmExhaustedError",
    "VersionMismatchError",
    "Work",
    "__version__",
]


if not TYPE_CHECKING:  # hidden from mypy, which then sees the names above as they are

    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(__all__))
