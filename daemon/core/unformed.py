"""Jobs this daemon broke before they formed because a peer was lost: what to
tell that peer when it comes back and announces the job.

A peer that restarts (or whose link was cut) misses the withdrawal sent while
it was down: links drop control messages to a peer that is not up.  Its ranks
then join the job again and wait, until their deadline, for ranks that gave
up here.  So each such break is remembered for the peer (a while, once): when
the peer announces the job, it gets an `Unformable` naming its own
announcement, and its ranks fail now with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gradsync.daemon.core.interfaces import PeerTransport
from gradsync.daemon.core.membership import BOOT, Announcement
from gradsync.protocol.errors import GradsyncError, PeerLostError, error_from_wire
from gradsync.protocol.peer import Announce, Unformable

if TYPE_CHECKING:
    from gradsync.daemon.core.matching import Job

__all__ = ["UnformedJobs", "unformable_error"]

#: How long a break is remembered for the lost peer (a restart takes seconds).
KEEP_S = 120.0
#: At most this many remembered, the oldest forgotten first.
KEEP_AT_MOST = 1024


class UnformedJobs:
    """(job, lost peer) → why the job broke here, for a while."""

    def __init__(self, clock: Callable[[], float]) -> None:
        #: Now, in seconds of CLOCK_MONOTONIC (a fake in core tests).
        self.clock = clock
        self._kept: dict[tuple[str, str], tuple[float, str, str]] = {}

    def remember(self, job: str, peers: list[str], error: GradsyncError) -> None:
        expires = self.clock() + KEEP_S
        for peer in peers:
            self._kept[(job, peer)] = (expires, error.message, error.code)
        while len(self._kept) > KEEP_AT_MOST:
            del self._kept[next(iter(self._kept))]

    def answer(self, peer: str, message: Announce) -> Unformable | None:
        """The answer to `peer`'s announcement of a job remembered for it."""
        kept = self._kept.get((message.job, peer))
        if kept is None or kept[0] < self.clock():
            return None
        return Unformable(message.job, message.boot, message.incarnation, kept[1], kept[2])

    def forget(self, job: str, peer: str) -> None:
        """Answered: a later run of the job under the same name must not hear it."""
        self._kept.pop((job, peer), None)

    def tell(self, peer: str, held: Announcement | None, job: Job | None,
             transport: PeerTransport) -> None:
        """Tell `peer`, once it is up, that its announced job (`held`) broke here
        before forming (`job` is this daemon's, gone or broken), while it was lost."""
        answer = (self.answer(peer, held.share)
                  if held is not None and (job is None or job.broken) else None)
        if answer is not None and transport.is_up(peer):  # else: at its peer_up
            self.forget(answer.job, peer)
            transport.post(peer, answer.to_wire())

    def heard(self, peer: str, message: Unformable, job: Job | None) -> GradsyncError | None:
        """The error that breaks `job`, still forming in the run the answer names,
        or None (and counted nowhere: a stale answer changes nothing)."""
        across = job.across if job is not None else None
        if (job is None or across is None or job.broken is not None
                or across.formation is not None or across.announcement is None
                or (message.boot, message.incarnation) != (BOOT, across.incarnation)):
            return None
        return unformable_error(peer, message, job.describe())


def unformable_error(peer: str, message: Unformable, description: str) -> GradsyncError:
    """What the ranks of a job here get when `peer` says it can never form."""
    return error_from_wire(
        message.code or PeerLostError.code,
        f"peer daemon {peer} broke {description} before it formed, while this daemon was "
        f"lost to it ({message.reason}); its ranks will not join this run of the job",
        {"job": message.job, "peer": peer},
    )
