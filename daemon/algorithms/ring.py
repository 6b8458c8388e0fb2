"""Ring allreduce: reduce-scatter then all-gather around the ring of daemons.

The buffer is cut into M chunks.  In reduce-scatter step s daemon r sends
chunk (r - s) mod M to r + 1 and reduces chunk (r - s - 1) mod M arriving from
r - 1; after M - 1 steps it holds the full reduction of chunk (r + 1) mod M.
All-gather then passes the finished chunks on for M - 1 more steps.  Each
daemon sends every chunk but two, 2(M - 1)/M · D elements: bandwidth-optimal,
at the price of 2(M - 1) latencies.
"""

from __future__ import annotations

from gradsync.daemon.algorithms.schedule import Schedule, StepBuilder, check_args, split_bounds


def ring(rank: int, size: int, count: int) -> Schedule:
    """Daemon `rank`'s part of a ring allreduce of `count` elements over `size` daemons."""
    check_args(rank, size, count)
    if size == 1:
        return Schedule("ring", rank, size, count, ())
    bounds = split_bounds(0, count, size)
    after, before = (rank + 1) % size, (rank - 1) % size
    builder = StepBuilder(2 * (size - 1))
    for s in range(size - 1):
        out, into = (rank - s) % size, (rank - s - 1) % size
        builder.send(s, after, bounds[out], bounds[out + 1])
        builder.recv(s, before, bounds[into], bounds[into + 1], reduce=True)
    for s in range(size - 1):
        out, into = (rank + 1 - s) % size, (rank - s) % size
        step = size - 1 + s
        builder.send(step, after, bounds[out], bounds[out + 1])
        builder.recv(step, before, bounds[into], bounds[into + 1], reduce=False)
    return builder.build("ring", rank, size, count)
