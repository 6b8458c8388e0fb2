"""Rabenseifner allreduce: recursive-halving reduce-scatter, recursive-doubling all-gather.

For a power of two p daemons, reduce-scatter step k pairs daemons whose
(virtual) ranks differ in bit p / 2^(k+1): each keeps the half of its current
interval on its side of that bit, sends the other half, and reduces the half it
receives.  After log2 p steps virtual rank v holds the reduction of block v;
all-gather retraces the steps in reverse, each exchange doubling what both
partners hold.  2 log2 p steps, 2(p - 1)/p · D elements sent per daemon.

Any other M = p + r (r < p) first folds r daemons away: in pairs (2i, 2i + 1)
for i < r the even daemon sends its whole buffer to the odd one, which reduces
it and takes part as virtual rank i; daemons from 2r on are virtual rank
d - r.  A last step sends the result back to the folded daemons.  That costs
two more steps and D more elements on the partners' links.
"""

from __future__ import annotations

from gradsync.daemon.algorithms.schedule import Schedule, StepBuilder, check_args, split_bounds


def rhd(rank: int, size: int, count: int) -> Schedule:
    """Daemon `rank`'s part of a Rabenseifner allreduce; any `size`."""
    check_args(rank, size, count)
    if size == 1:
        return Schedule("rhd", rank, size, count, ())
    levels = size.bit_length() - 1
    p = 1 << levels
    extra = size - p
    fold = 1 if extra else 0
    builder = StepBuilder(2 * levels + 2 * fold)
    if rank < 2 * extra and rank % 2 == 0:
        # Folded away: contribute the whole buffer, get the result at the end.
        builder.send(0, rank + 1, 0, count)
        builder.recv(2 * levels + 1, rank + 1, 0, count, reduce=False)
        return builder.build("rhd", rank, size, count)
    if rank < 2 * extra:
        builder.recv(0, rank - 1, 0, count, reduce=True)
        builder.send(2 * levels + 1, rank - 1, 0, count)
    virtual = rank // 2 if rank < 2 * extra else rank - extra
    bounds = split_bounds(0, count, p)

    def real(v: int) -> int:
        return 2 * v + 1 if v < extra else v + extra

    lo, hi = 0, p
    for k in range(levels):
        distance = p >> (k + 1)
        partner = real(virtual ^ distance)
        mid = lo + distance
        if virtual & distance:
            keep, give = (mid, hi), (lo, mid)
        else:
            keep, give = (lo, mid), (mid, hi)
        builder.send(fold + k, partner, bounds[give[0]], bounds[give[1]])
        builder.recv(fold + k, partner, bounds[keep[0]], bounds[keep[1]], reduce=True)
        lo, hi = keep
    for k in range(levels):
        distance = 1 << k
        partner_virtual = virtual ^ distance
        own = virtual // distance * distance
        theirs = partner_virtual // distance * distance
        step = fold + levels + k
        builder.send(step, real(partner_virtual), bounds[own], bounds[own + distance])
        builder.recv(
            step, real(partner_virtual), bounds[theirs], bounds[theirs + distance], reduce=False
        )
    return builder.build("rhd", rank, size, count)
