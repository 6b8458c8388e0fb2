"""Which peers a daemon heartbeats: its ring neighbours, and the peers its jobs use.

Heartbeating every configured peer ten times a second costs every daemon
O(M) messages a second, O(M²) in all: 45,000 a second per daemon at 1,024.
At rest a daemon needs to hear only enough peers that every daemon is watched
by some: its `count` nearest on either side of a ring of every daemon in
sorted order, `count` being log2 of the daemons by default, so that each
daemon is watched by 2 log2(M) others.  The peers a job uses are heartbeated
while the job lasts, whatever their place on that ring: the same number of
nearest members on the job's own ring (so a job of every daemon costs no more),
the coordinator announced to, and the announcers of a job coordinated here
until it forms (ClusterJobs.peers_in_use).

The ring is the same for everyone (every daemon sorts the same endpoints), so
watching is mutual: a daemon's neighbours are those whose neighbour it is,
and a suspect's own neighbours are the witnesses worth asking about it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def neighbour_count(daemons: int) -> int:
    """The default: log2 of the daemons, rounded up, at least 1."""
    return max(1, math.ceil(math.log2(max(daemons, 2))))


def ring_neighbours(me: str, daemons: Iterable[str], count: int = 0) -> frozenset[str] | None:
    """The `count` daemons on either side of `me` on the ring of `daemons` (and
    `me`) in sorted order; `count` 0: `neighbour_count`.  None where that is every
    other daemon (a few daemons: every one watches every other)."""
    ring = sorted(set(daemons) | {me})
    size = len(ring)
    count = count or neighbour_count(size)
    if size <= 2 * count + 1:
        return None
    index = ring.index(me)
    return frozenset(ring[(index + step) % size]
                     for step in range(-count, count + 1) if step != 0)
