"""Allreduce between daemons: schedules, their simulator and the alpha-beta cost model.

Everything here is pure: no sockets, no event loop.  An algorithm is a function
``(rank, size, count) -> Schedule``; `ALGORITHMS` names them.  See
`schedule.py` for the rules an executor may rely on.
"""

from __future__ import annotations

from collections.abc import Callable

from gradsync.daemon.algorithms.rhd import rhd
from gradsync.daemon.algorithms.ring import ring
from gradsync.daemon.algorithms.schedule import (
    Recv,
    Schedule,
    ScheduleError,
    Send,
    Step,
    check_schedules,
)
from gradsync.daemon.algorithms.star import star
from gradsync.daemon.algorithms.tree import double_binary_tree, tree
from gradsync.protocol.peer import ALGORITHM_NAMES

#: Schedule builder: ``(rank, size, count) -> Schedule``.
Algorithm = Callable[[int, int, int], Schedule]

#: The builders, under the names protocol/peer.py gives them (both wires use those).
ALGORITHMS: dict[str, Algorithm] = dict(zip(ALGORITHM_NAMES, (ring, tree, rhd, star),
                                            strict=True))


def build_schedules(algorithm: str, size: int, count: int) -> list[Schedule]:
    """Every daemon's schedule for one collective, in rank order (for tests and checks)."""
    try:
        make = ALGORITHMS[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {algorithm!r}; expected one of: {', '.join(ALGORITHMS)}"
        ) from None
    return [make(rank, size, count) for rank in range(size)]


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "Recv",
    "Schedule",
    "ScheduleError",
    "Send",
    "Step",
    "build_schedules",
    "check_schedules",
    "double_binary_tree",
    "rhd",
    "ring",
    "star",
    "tree",
]
