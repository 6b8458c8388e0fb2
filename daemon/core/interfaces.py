"""What the core needs from the layers above it, as types the core defines.

The core (matching, membership, the cluster's reactions to peers) never
imports `run/`, `io/` or `peers/`: they implement these, and the core is
driven with them, or with fakes in tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from gradsync.protocol.errors import GradsyncError
from gradsync.protocol.peer import Fingerprint

if TYPE_CHECKING:
    from gradsync.daemon.core.matching import CollectiveCall


class PlacedPayload:
    """A slice's payload received straight into its collective's buffer.

    The run layer's placements derive from this (`run/receives.py`); a data
    stream (peers/stream.py) fills one as the payload arrives, instead of a
    fresh buffer, and hands it on in place of a buffer; the core tells such a
    payload from a received one by this type alone.
    """

    #: Bytes of the payload still to come.
    remaining: int

    def __len__(self) -> int:
        raise NotImplementedError

    def window(self) -> memoryview:
        """Where the next bytes go: non-empty, at most `remaining` bytes."""
        raise NotImplementedError

    def advance(self, count: int) -> None:
        """The first `count` bytes of the last window were written."""
        raise NotImplementedError

    def absorb(self, data: memoryview) -> int:
        """Take the first bytes of `data` (authenticated plaintext) without a
        window, e.g. reduce them where they lie; how many it took (0: none, write
        them into the window instead)."""
        return 0

    def cancel(self) -> None:
        raise NotImplementedError


def is_placed(payload: Any) -> bool:
    """True for a payload that was received in place (see `CollectiveRun.place`)."""
    return isinstance(payload, PlacedPayload)


class CollectiveRun(Protocol):
    """One collective's inter-daemon phase, as the core drives it from peers'
    messages (`run.executor.ScheduleRun` is the one)."""

    fingerprint: Fingerprint | None
    algorithm: str
    #: The schedule step it is at (-1 before the first).
    step: int

    @property
    def steps(self) -> int: ...

    def deliver(self, peer: int, step: int, transfer: int, offset: int, payload: Any) -> None:
        """A slice from daemon index `peer`; raises ProtocolError if it does not fit."""

    def place(
        self, peer: int, step: int, transfer: int, offset: int, nbytes: int
    ) -> PlacedPayload | None:
        """Where a slice of the current step can be received in place, or None."""

    def fail(self, error: GradsyncError) -> None:
        """End the run with `error`."""

    def needs_from(self, peer: int) -> bool:
        """Whether the run still expects a slice directly from daemon index `peer`."""

    def waiting_for(self) -> list[int]:
        """Daemon indices whose slices the current step still needs."""

    def raw_nbytes(self, nbytes: int) -> int:
        """Buffer bytes a payload of `nbytes` carries (more, when compressed)."""


class IncomingMessage(Protocol):
    """A message a peer sent, as the links hand it on (`peers.events.PeerMessage`)."""

    @property
    def peer(self) -> str: ...

    @property
    def header(self) -> dict[str, Any]: ...

    @property
    def payloads(self) -> Sequence[Any]: ...


class PeerTransport(Protocol):
    """What the cluster needs from the peer links (`PeerLinks` is one)."""

    endpoint: str

    @property
    def peers(self) -> Sequence[str]: ...

    def post(
        self, peer: str, header: dict[str, Any], payloads: Sequence[Any] = (),
        zero_copy: bool = False,
    ) -> Any: ...

    def link_costs(self) -> tuple[float, float] | None: ...

    def reachable(self, peer: str) -> bool:
        """Whether what is posted to `peer` is expected to arrive: its link is up,
        or opens on first use and has not been given up on."""
        ...


class FailedCollectives(Protocol):
    """Where the core sends a collective it fails before it ran: the one failure path,
    which answers its ranks once, counts it and cancels its deadline
    (`run.runs.CollectiveRuns` is the one)."""

    def fail(self, pending: CollectiveCall, error: GradsyncError) -> None: ...


class _NotConnected:
    """The transport of a `ClusterJobs` not yet connected to its links."""

    endpoint = ""
    peers: tuple[str, ...] = ()

    def post(self, peer: str, header: dict[str, Any], payloads: Sequence[Any] = (),
             zero_copy: bool = False) -> Any:
        raise RuntimeError("ClusterJobs.connect() was not called")

    def link_costs(self) -> tuple[float, float] | None:
        return None

    def reachable(self, peer: str) -> bool:
        return False


NOT_CONNECTED = _NotConnected()
