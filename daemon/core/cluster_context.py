"""What the parts of `ClusterJobs` (cluster.py) share: the daemon's jobs and
settings, the links they send through, the daemon's one failure path for
collectives, and what they count of the peers' messages."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from gradsync.daemon.core.interfaces import NOT_CONNECTED, FailedCollectives, PeerTransport
from gradsync.protocol.errors import ProtocolError

if TYPE_CHECKING:
    from gradsync.daemon.config import DaemonConfig
    from gradsync.daemon.core.matching import Job
    from gradsync.daemon.stats import StatsRecorder

#: A slice's payload as the links hand it on: a buffer (memoryview, bytes, a
#: ZeroMQ frame's buffer) or, for a slice received in place, its placement.
Frame = Any
#: Sends one membership message to a daemon, this one included
#: (`ClusterJobs.send_membership`).
Send = Callable[[str, dict[str, Any]], None]

log = logging.getLogger("gradsync.daemon.cluster")


@dataclasses.dataclass
class ClusterCounters:
    """What the cluster core counts of the peers' messages (dropped ones, mostly)."""

    #: Undecodable, or failing the peer protocol's checks.
    malformed: int = 0
    #: For a generation of a job that has ended or not formed here.
    stale_generation: int = 0
    #: Announcements and withdrawals overtaken by a newer one from the same daemon.
    stale_membership: int = 0
    dropped_unknown_job: int = 0
    #: Slices received straight into their collective's buffer.
    slices_placed: int = 0
    #: Jobs ended because a peer sent more early slices than max_shm_bytes.
    early_refused: int = 0

    @contextlib.contextmanager
    def dropping_bad(self, header: Mapping[str, Any], peer: str,
                     logger: logging.Logger) -> Iterator[None]:
        """Handle one peer message: one that fails the protocol's checks, or whose
        handling hits a bug, is counted as malformed, logged and dropped; the daemon
        keeps serving."""
        try:
            yield
        except ProtocolError as exc:
            self.malformed += 1
            logger.warning("dropped a bad %r message from peer %s: %s", header.get("kind"),
                           peer, exc)
        except Exception:  # a bug: say so, drop the message, keep serving
            self.malformed += 1
            logger.exception("failed to handle a %r message from %s", header.get("kind"), peer)


@dataclasses.dataclass
class ClusterContext:
    """The daemon's multi-node jobs and what every part of the cluster core uses."""

    config: DaemonConfig
    #: The daemon's jobs (DaemonState.jobs), as the request handlers keep them.
    jobs: dict[str, Job]
    stats: StatsRecorder | None
    counters: ClusterCounters = dataclasses.field(default_factory=ClusterCounters)
    #: The peer links (`ClusterJobs.connect`).
    transport: PeerTransport = NOT_CONNECTED
    #: The daemon's one failure path for collectives (`ClusterJobs.connect`).
    failures: FailedCollectives | None = None

    def reachable(self) -> list[str]:
        """This daemon and the peers it can reach now: where a job's coordinator
        is picked from (membership.py `coordinators_of`)."""
        transport = self.transport
        return [transport.endpoint, *(peer for peer in transport.peers
                                      if peer != transport.endpoint and transport.reachable(peer))]
