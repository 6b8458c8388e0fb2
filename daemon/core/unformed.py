"""Jobs broken before they formed because a peer was lost: what to tell that
peer when it comes back, and what a daemon that comes back is told.

A peer that restarts (or whose link was cut) misses what was sent while it
was down: links drop control messages to a peer that is not up.  Its ranks
then join the job again and would wait, until their deadline, for ranks that
gave up elsewhere.  So each such break is remembered for the peer (a while,
once): when the peer is up again, the daemon that broke the job tells it
(`Broke`), if its own run of the job is still broken or gone; the peer's
ranks of that job, already there or joining within `KEEP_S`, fail at once
with the reason.
"""

from __future__ import annotations

from collections.abc import Callable

from gradsync.protocol.errors import GradsyncError, PeerLostError, error_from_wire
from gradsync.protocol.peer import Broke

__all__ = ["HeardBreaks", "UnformedJobs", "broke_error"]

#: How long a break is remembered for the lost peer, and by it once told (a
#: restart takes seconds).
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

    def due(self, peer: str, still_broken: Callable[[str], bool]) -> list[Broke]:
        """What to tell `peer`, up again: the jobs remembered for it whose run here
        is still broken or gone (`still_broken(job)`); each is told once."""
        now = self.clock()
        told = []
        for (job, lost), (expires, reason, code) in list(self._kept.items()):
            if lost != peer:
                continue
            del self._kept[(job, lost)]
            if expires >= now and still_broken(job):
                told.append(Broke(job, reason, code))
        return told


class HeardBreaks:
    """Jobs a peer broke while this daemon was lost to it (`Broke`): they end
    the run of that job here, there already or created within `KEEP_S`."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._heard: dict[str, tuple[float, str, Broke]] = {}

    def keep(self, peer: str, message: Broke) -> None:
        self._heard[message.job] = (self.clock() + KEEP_S, peer, message)
        while len(self._heard) > KEEP_AT_MOST:
            del self._heard[next(iter(self._heard))]

    def take(self, job: str, description: str) -> GradsyncError | None:
        """The error that ends this run of `job`, once, or None."""
        heard = self._heard.pop(job, None)
        if heard is None or heard[0] < self.clock():
            return None
        return broke_error(heard[1], heard[2], description)


def broke_error(peer: str, message: Broke, description: str) -> GradsyncError:
    """What the ranks of a job here get when `peer` broke it while this daemon was
    lost to it."""
    return error_from_wire(
        message.code or PeerLostError.code,
        f"peer daemon {peer} broke {description} before it formed, while this daemon was "
        f"lost to it ({message.reason}); its ranks will not join this run of the job",
        {"job": message.job, "peer": peer},
    )
