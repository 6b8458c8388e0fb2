"""What one job is across daemons, beside its local matching (`matching.Job`).

Kept apart from `Job` so that matching stays about the local ranks: this is
the state of a job whose world is larger than this daemon's ranks.  Its one
writer is the cluster core (`ClusterJobs` in cluster.py, and its parts): the
inter-daemon phase (run/multi_node.py) and the request handlers (io/service.py)
tell it what happened, and read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gradsync.daemon.core.auto import AutoPolicy
from gradsync.daemon.core.interfaces import CollectiveRun
from gradsync.daemon.core.membership import Announcement, Formation
from gradsync.daemon.core.outcome import Outcome
from gradsync.protocol.errors import GradsyncError
from gradsync.protocol.peer import Key, Slice

#: A kept slice: the peer it came from, its header, and its payload frames.
KeptSlice = tuple[str, Slice, Any]


def payload_bytes(slices: Sequence[KeptSlice]) -> int:
    """Payload bytes of kept slices."""
    return sum(memoryview(frame).nbytes for _, _, frames in slices for frame in frames)


class EarlySlices:
    """Slices that came before their job formed here, or before their collective
    started here, and the payload bytes they hold (checked against max_shm_bytes)."""

    def __init__(self) -> None:
        #: For a job not formed yet (their key is judged once it forms).
        self.unformed: list[KeptSlice] = []
        #: For collectives this daemon's ranks have not submitted yet.
        self.by_key: dict[Key, list[KeptSlice]] = {}
        self.nbytes = 0

    def keep(self, key: Key | None, kept: KeptSlice, nbytes: int) -> None:
        """Hold a slice of collective `key` (None: the job has not formed)."""
        self.nbytes += nbytes
        if key is None:
            self.unformed.append(kept)
        else:
            self.by_key.setdefault(key, []).append(kept)

    def take_unformed(self) -> list[KeptSlice]:
        taken, self.unformed = self.unformed, []
        self.nbytes -= payload_bytes(taken)
        return taken

    def take(self, key: Key) -> list[KeptSlice]:
        """The slices kept for `key`, no longer held (its collective runs, or failed)."""
        taken = self.by_key.pop(key, [])
        self.nbytes -= payload_bytes(taken)
        return taken

    def clear(self) -> None:
        self.unformed.clear()
        self.by_key.clear()
        self.nbytes = 0


class ClusterJob:
    """A job's membership across daemons, its generation, and what runs over it."""

    def __init__(self) -> None:
        self.incarnation = 0
        self.announcement: Announcement | None = None
        self.withdrawn = False
        #: Why this daemon withdraws once its running collectives end (`JobFailures.break_job`).
        self.withdrawal: GradsyncError | None = None
        #: The job ended normally: its ranks left after their last collective (a rank
        #: said `bye`, here or on a peer).  Its end is then news, not a warning.
        self.ended_cleanly = False
        #: (daemon, reason) of the peer's withdrawal that ended the job here; passed on
        #: as it came, so that daemons further on name where the end began.
        self.end_origin: tuple[str, str] | None = None
        #: The member declared lost or cut off that ended the job (here, or as a
        #: peer's withdrawal said): its data will not come.  Passed on as it came.
        self.lost = ""
        self.formation: Formation | None = None
        #: Settled with the formation (or the error that ended the job before it).
        self.formed: Outcome[Formation] = Outcome()
        #: The collectives whose inter-daemon phase runs here now, by key.
        self.runs: dict[Key, CollectiveRun] = {}
        self.early = EarlySlices()
        #: Member daemons that withdrew or were lost since the job formed.
        self.gone: set[str] = set()
        #: `auto` for this job: the link costs the members agree on, epoch by
        #: epoch, and its picks.
        self.auto = AutoPolicy()

    def fail_if_waiting_on_gone(self, run: CollectiveRun, error: GradsyncError) -> None:
        """A run that still needs data from a member daemon that left or was lost
        cannot finish; one that already holds everything from them can."""
        assert self.formation is not None
        if any(run.needs_from(self.formation.index_of(gone)) for gone in self.gone):
            run.fail(error)
