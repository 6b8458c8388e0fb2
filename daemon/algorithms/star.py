"""Star allreduce: every daemon sends its buffer to daemon 0, which reduces and sends back.

Two steps, but daemon 0 receives and sends (M - 1) · D elements: its link is
the bottleneck.  A baseline for tests and for two or three daemons with tiny
buffers.
"""

from __future__ import annotations

from gradsync.daemon.algorithms.schedule import Schedule, StepBuilder, check_args

ROOT = 0


def star(rank: int, size: int, count: int) -> Schedule:
    """Daemon `rank`'s part of a reduce-at-daemon-0-then-broadcast allreduce."""
    check_args(rank, size, count)
    if size == 1:
        return Schedule("star", rank, size, count, ())
    builder = StepBuilder(2)
    if rank == ROOT:
        for peer in range(size):
            if peer != ROOT:
                # Reducing receives of one range may overlap; they apply in peer order.
                builder.recv(0, peer, 0, count, reduce=True)
                builder.send(1, peer, 0, count)
    else:
        builder.send(0, ROOT, 0, count)
        builder.recv(1, ROOT, 0, count, reduce=False)
    return builder.build("star", rank, size, count)
