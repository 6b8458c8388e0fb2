"""gradsync.client: what a training process imports to talk to its daemon."""

from gradsync.client.client import Client
from gradsync.client.work import Work
from gradsync.protocol.dtypes import ReduceOp
from gradsync.protocol.errors import (
    CollectiveError,
    CollectiveTimeoutError,
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

__all__ = [
    "Client",
    "CollectiveError",
    "CollectiveTimeoutError",
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
