"""The exception hierarchy shared by client and daemon, and its wire codes.

The daemon failing (`DaemonUnavailableError`) is kept apart from a collective
failing (`CollectiveError` and its subclasses): the first means "no daemon to
talk to", the second "the daemon is fine, this operation is not".
"""

from __future__ import annotations

from typing import Any


class GradsyncError(Exception):
    """Root of every error gradsync raises on purpose."""

    code = "error"

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = dict(details or {})


class DaemonUnavailableError(GradsyncError):
    """No daemon answers at the endpoint, or the connection to it broke."""

    code = "daemon_unavailable"


class DaemonLostError(DaemonUnavailableError):
    """The daemon of this session went away (stopped, crashed, restarted).

    What was in flight is lost; the client's next call opens a new session.
    """

    code = "daemon_lost"


class DaemonShuttingDownError(DaemonUnavailableError):
    """The daemon is stopping and failed the operation instead of finishing it."""

    code = "shutting_down"


class ProtocolError(GradsyncError):
    """A message was malformed, of an unknown kind, or of another version."""

    code = "protocol"


class VersionMismatchError(ProtocolError):
    """Client and daemon speak incompatible protocol versions."""

    code = "version_mismatch"


class InvalidArgumentError(GradsyncError, ValueError):
    """A call's arguments cannot be served (wrong dtype, op, layout, ...)."""

    code = "invalid_argument"


class JobError(GradsyncError):
    """A client cannot join its job (duplicate rank, inconsistent sizes, ...)."""

    code = "job"


class ResourceError(GradsyncError):
    """The daemon cannot allocate what was asked for."""

    code = "resource"


class ShmExhaustedError(ResourceError):
    """Shared memory would exceed `max_shm_bytes` or the free space of /dev/shm."""

    code = "shm_exhausted"


class CheckpointError(GradsyncError):
    """A checkpoint request the daemon refuses: none complete, another job's, a step
    already committed, a commit whose parts are not all in."""

    code = "checkpoint"


class CollectiveError(GradsyncError):
    """A collective operation failed; no buffer holds a partial result."""

    code = "collective"


class MismatchError(CollectiveError):
    """Ranks submitted the same key with different op, dtype, size or reduce op."""

    code = "mismatch"


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete within its deadline."""

    code = "timeout"


class RankLostError(CollectiveError):
    """A member of the job died or left while others waited for it."""

    code = "rank_lost"


class PeerLostError(CollectiveError):
    """A peer daemon died or stopped answering (multi-node jobs)."""

    code = "peer_lost"


_BY_CODE: dict[str, type[GradsyncError]] = {
    cls.code: cls
    for cls in (
        GradsyncError,
        DaemonUnavailableError,
        DaemonLostError,
        DaemonShuttingDownError,
        ProtocolError,
        VersionMismatchError,
        InvalidArgumentError,
        JobError,
        ResourceError,
        ShmExhaustedError,
        CheckpointError,
        CollectiveError,
        MismatchError,
        CollectiveTimeoutError,
        RankLostError,
        PeerLostError,
    )
}


def as_collective_error(
    error: GradsyncError, kind: type[CollectiveError] = CollectiveError
) -> CollectiveError:
    """`error` as a collective's failure: itself if it is one, else a `kind` with its
    message and details (a job breaking, say, fails its collectives)."""
    return error if isinstance(error, CollectiveError) else kind(error.message, error.details)


def error_from_wire(code: str, message: str, details: dict[str, Any]) -> GradsyncError:
    """Rebuild the exception a daemon reported; unknown codes become the root type."""
    cls = _BY_CODE.get(code, GradsyncError)
    return cls(message, details)
