"""The daemon's shared state, passed explicitly to whoever needs it.

One `DaemonState` per daemon: its jobs, its client sessions, and the counters
that `gradsync ping` and the statistics show.  Each part of the daemon owns
its own counters (a typed record it alone writes): the client side
(`RequestCounters`), the statistics endpoint (`StatsEndpointCounters`), the
cluster core (`ClusterCounters`, daemon/core/cluster.py) and the peer links;
`counters()` puts them together under the names they have always had.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from gradsync.daemon.core.cluster_context import ClusterCounters

if TYPE_CHECKING:
    from gradsync.daemon.config import DaemonConfig
    from gradsync.daemon.core.matching import Job
    from gradsync.daemon.io.session import ClientSession


@dataclasses.dataclass
class RequestCounters:
    """Counted by the client side: the sessions and the request handlers."""

    collectives: int = 0
    failed: int = 0
    #: Client requests that could not be decoded or checked.
    malformed: int = 0


@dataclasses.dataclass
class StatsEndpointCounters:
    """Counted by the statistics endpoint."""

    #: Requests that could not be decoded.
    malformed: int = 0
    #: Readers whose CURVE key the endpoint's ZAP handler refused.
    stats_rejected_keys: int = 0


class DaemonState:
    """Jobs, sessions and counters of one daemon."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.jobs: dict[str, Job] = {}
        self.sessions: dict[int, ClientSession] = {}
        self.requests = RequestCounters()
        self.stats_endpoint = StatsEndpointCounters()
        #: The cluster core's counters, once this daemon has peers.
        self.cluster: ClusterCounters | None = None
        #: The peer links' own counters (shown with a `links_` prefix).
        self.link_counters: Callable[[], Mapping[str, int]] = dict
        #: The shared-memory fast path's counters (run/fast_path.py).
        self.fast_counters: Callable[[], Mapping[str, int]] = dict
        #: Error feedback's residuals held (run/residuals.py), once this daemon has peers.
        self.error_feedback: Callable[[], Mapping[str, int]] = dict
        #: Deadline timers armed and not yet fired or cancelled (io/loop_clock.py).
        self.deadline_timers: Callable[[], int] = lambda: 0
        #: Set once the daemon begins to stop: no new requests, no results.
        self.shutting_down = False

    def counters(self) -> dict[str, int]:
        """Every counter, as `ping` and the statistics name them."""
        requests, stats = self.requests, self.stats_endpoint
        cluster = self.cluster or ClusterCounters()
        return {
            "malformed": requests.malformed + stats.malformed + cluster.malformed,
            "collectives": requests.collectives,
            "failed": requests.failed,
            "stale_generation": cluster.stale_generation,
            "stale_membership": cluster.stale_membership,
            "dropped_unknown_job": cluster.dropped_unknown_job,
            "stats_rejected_keys": stats.stats_rejected_keys,
            "slices_placed": cluster.slices_placed,
            "early_refused": cluster.early_refused,
            "deadline_timers": self.deadline_timers(),
            **self.fast_counters(),
            **{f"links_{name}": value for name, value in self.link_counters().items()},
        }
