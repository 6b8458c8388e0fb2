"""What one job is across daemons, beside its local matching (`matching.Job`).

Kept apart from `Job` so that matching stays about the local ranks: this is
the state `cluster.py` (membership, peer messages, failures) and
`run/multi_node.py` (the inter-daemon phase) share for a job whose world is
larger than this daemon's ranks.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from gradsync.daemon.core.cost_epochs import CostEpochs
from gradsync.daemon.core.membership import Announcement, Formation
from gradsync.protocol.errors import GradsyncError
from gradsync.protocol.peer import Key, Slice

if TYPE_CHECKING:  # the run layer's type only: the core never calls into it
    from gradsync.daemon.run.executor import ScheduleRun


class ClusterJob:
    """A job's membership across daemons, its generation, and what runs over it."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.incarnation = 0
        self.announcement: Announcement | None = None
        self.withdrawn = False
        #: Why this daemon withdraws once its running collectives end (`ClusterJobs._break`).
        self.withdrawal: GradsyncError | None = None
        #: The job ended normally: its ranks left after their last collective (a rank
        #: said `bye`, here or on a peer).  Its end is then news, not a warning.
        self.ended_cleanly = False
        #: (daemon, reason) of the peer's withdrawal that ended the job here; passed on
        #: as it came, so that daemons further on name where the end began.
        self.end_origin: tuple[str, str] | None = None
        self.formation: Formation | None = None
        self.formed: asyncio.Future[Formation] = (loop or asyncio.get_event_loop()).create_future()
        self.runs: dict[Key, ScheduleRun] = {}
        self.early_slices: list[tuple[str, Slice, Any]] = []
        self.early_by_key: dict[Key, list[tuple[str, Slice, Any]]] = {}
        #: Payload bytes held in `early_slices` and `early_by_key`.
        self.early_bytes = 0
        #: Member daemons that withdrew or were lost since the job formed.
        self.gone: set[str] = set()
        #: `auto`'s link costs as the members agree on them, epoch by epoch.
        self.costs = CostEpochs()
