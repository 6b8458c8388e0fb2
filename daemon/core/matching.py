"""Jobs, their members, and the matching of collectives by key.

A job is the set of ranks that share a name on this daemon.  Each collective a
member submits carries a key (the member's own sequence number, or a name) and
a fingerprint; a collective is ready when every local member has submitted the
same key.  Matching is pure bookkeeping: this module never touches buffers,
sockets or the event loop, so its rules are easy to test and to read.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from gradsync.daemon.core.cluster_job import ClusterJob
from gradsync.protocol.errors import (
    CollectiveTimeoutError,
    GradsyncError,
    InvalidArgumentError,
    JobError,
    MismatchError,
    RankLostError,
)
from gradsync.protocol.peer import Fingerprint

if TYPE_CHECKING:  # other layers' types only: the core never calls into them
    from gradsync.daemon.backends import Slab
    from gradsync.daemon.core.deadlines import Timer

Key = int | str

#: How many failed keys a job remembers, so late arrivals fail fast.
_FAILED_KEYS_KEPT = 4096


@dataclasses.dataclass
class Submission:
    """One member's part of a collective: where its data is and how to answer."""

    rank: int
    fingerprint: Fingerprint
    view: np.ndarray | None
    #: respond(error, timing): timing holds the daemon's CLOCK_MONOTONIC times of
    #: the collective (first submission, start, completion) on success.
    respond: Callable[..., None]
    timeout_s: float
    out: np.ndarray | None = None
    submitted_at: float = 0.0
    #: The slabs `view` and `out` lie in (their backend runs the kernels).
    slabs: tuple[Slab, ...] = ()


@dataclasses.dataclass
class CollectiveCall:
    """One key's collective on this daemon, from its first local submission to
    its answer: waiting for the other local ranks (in `Job.pending`), then,
    once every one has submitted, running (`run/runs.py`)."""

    key: Key
    first_seen: float
    deadline_s: float
    submissions: dict[int, Submission] = dataclasses.field(default_factory=dict)
    timer: Timer | None = None  # the deadline's (core/deadlines.py)
    matched_at: float = 0.0  # when the last local rank submitted
    job_name: str = ""
    stall_reported: bool = False


@dataclasses.dataclass
class Member:
    """A connected rank of a job."""

    rank: int
    local_rank: int
    pid: int
    session_id: int


class Job:
    """Membership and matching state of one job on this daemon."""

    def __init__(
        self,
        name: str,
        world_size: int,
        local_world_size: int,
        clock: Callable[[], float],
    ) -> None:
        self.name = name
        #: Now, in seconds of CLOCK_MONOTONIC (a fake in core tests).
        self.clock = clock
        self.world_size = world_size
        self.local_world_size = local_world_size
        self.members: dict[int, Member] = {}
        self.pending: dict[Key, CollectiveCall] = {}
        self.failed: OrderedDict[Key, GradsyncError] = OrderedDict()
        self.broken: GradsyncError | None = None
        self.completed = 0
        #: Its state across daemons (used when world_size > local_world_size).
        self.across = ClusterJob()

    @property
    def multi_node(self) -> bool:
        return self.world_size > self.local_world_size

    def describe(self) -> str:
        return f"job {self.name!r}"

    # -- membership ---------------------------------------------------------

    def check_compatible(self, world_size: int, local_world_size: int) -> None:
        if (world_size, local_world_size) != (self.world_size, self.local_world_size):
            raise JobError(
                f"{self.describe()} has world_size={self.world_size}, "
                f"local_world_size={self.local_world_size}; this client says "
                f"world_size={world_size}, local_world_size={local_world_size}"
            )

    def add_member(self, member: Member) -> None:
        if self.broken is not None:
            raise JobError(
                f"{self.describe()} cannot take new members: {self.broken.message}; "
                "it re-forms once all its current members have disconnected"
            )
        existing = self.members.get(member.rank)
        if existing is not None:
            raise JobError(
                f"rank {member.rank} of {self.describe()} is already connected "
                f"(pid {existing.pid}); this client is pid {member.pid}"
            )
        for other in self.members.values():
            if other.local_rank == member.local_rank:
                raise JobError(
                    f"local_rank {member.local_rank} of {self.describe()} is already "
                    f"taken by rank {other.rank} (pid {other.pid})"
                )
        self.members[member.rank] = member

    def remove_member(self, rank: int, reason: str) -> list[CollectiveCall]:
        """Drop a member; the job is broken for everyone else. Returns failed pendings."""
        member = self.members.pop(rank, None)
        if member is None:
            return []
        if self.broken is None:
            self.broken = RankLostError(
                f"rank {rank} (pid {member.pid}) of {self.describe()} {reason}",
                {"job": self.name, "rank": rank, "pid": member.pid},
            )
        failed = list(self.pending.values())
        self.pending.clear()
        return failed

    # -- matching -----------------------------------------------------------

    def submit(self, key: Key, submission: Submission) -> CollectiveCall | None:
        """Record a submission; return the collective once every member is in.

        Raises the error the submitter should get at once (job broken, key
        already failed, duplicate submission).
        """
        if self.broken is not None:
            # A fresh error each time: raising the stored one would hang this call's
            # frames (and the submission's view of shared memory) on its traceback,
            # a cycle through the job that keeps the segment mapped until the
            # cyclic garbage collector happens to run.
            raise type(self.broken)(self.broken.message, self.broken.details)
        failed = self.failed.get(key)
        if failed is not None:
            raise type(failed)(f"{failed.message} (rank {submission.rank} arrived late)",
                               failed.details)
        pending = self.pending.get(key)
        if pending is None:
            now = self.clock()
            pending = CollectiveCall(key, now, submission.timeout_s, job_name=self.name)
            self.pending[key] = pending
        if submission.rank in pending.submissions:
            raise InvalidArgumentError(
                f"rank {submission.rank} submitted key {key!r} of {self.describe()} twice"
            )
        submission.submitted_at = self.clock()
        pending.submissions[submission.rank] = submission
        if len(pending.submissions) < self.local_world_size:
            return None
        del self.pending[key]
        pending.matched_at = submission.submitted_at
        return pending

    def mismatch(self, pending: CollectiveCall) -> MismatchError | None:
        """A `MismatchError` naming every rank's fingerprint, if they disagree."""
        prints = {sub.fingerprint for sub in pending.submissions.values()}
        if len(prints) == 1:
            return None
        sent = "; ".join(
            f"rank {rank} sent {sub.fingerprint.describe()}"
            for rank, sub in sorted(pending.submissions.items())
        )
        error = MismatchError(
            f"key {pending.key!r} of {self.describe()}: ranks disagree: {sent}",
            {
                "job": self.name,
                "key": pending.key,
                "sent": {
                    str(rank): sub.fingerprint.describe()
                    for rank, sub in pending.submissions.items()
                },
            },
        )
        self.remember_failure(pending.key, error)
        return error

    def expire(self, key: Key) -> tuple[CollectiveCall, CollectiveTimeoutError] | None:
        """Time out a pending collective; the error names the missing ranks."""
        pending = self.pending.pop(key, None)
        if pending is None:
            return None
        if self.multi_node:
            missing = sorted(set(self.members) - set(pending.submissions))
            absent = self.local_world_size - len(self.members)
            detail = f"; {absent} local ranks never connected" if absent else ""
        else:
            missing = sorted(set(range(self.world_size)) - set(pending.submissions))
            never = [rank for rank in missing if rank not in self.members]
            detail = f"; never connected: {never[:32]}" if never else ""
        shown = f"{missing[:32]} and {len(missing) - 32} more" if len(missing) > 32 else missing
        error = CollectiveTimeoutError(
            f"key {pending.key!r} of {self.describe()} timed out after "
            f"{pending.deadline_s:g}s waiting for ranks {shown}{detail} "
            f"(submitted: {sorted(pending.submissions)})",
            {"job": self.name, "key": pending.key, "missing": missing[:1024]},
        )
        self.remember_failure(key, error)
        return pending, error

    def remember_failure(self, key: Key, error: GradsyncError) -> None:
        self.failed[key] = error
        while len(self.failed) > _FAILED_KEYS_KEPT:
            self.failed.popitem(last=False)
