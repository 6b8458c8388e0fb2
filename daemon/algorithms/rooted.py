"""Schedules for the collectives other than allreduce, between daemons.

Pure, like the allreduce schedules.  Each daemon holds some ranks of the job;
`parts[d]` lists the element ranges of the work buffer that belong to daemon
d's ranks (in rank order).  Transfers pair by order per peer and step (see
`executor.py`), so a sender may read from one place and its receiver write to
another, as gather, scatter and all-to-all need.

- `chain_broadcast`: a pipelined chain from the root: chunk k leaves the
  daemon at distance p from the root at step k + p; every link carries the
  buffer once (bandwidth-optimal), latency chunks + M - 2 steps.
- `chain_reduce`: the same chain run backwards, reducing toward the root.
- `ring_all_gather` / `ring_reduce_scatter`: the two halves of ring allreduce
  over uneven parts.
- `direct_gather` / `direct_scatter`: one step, every daemon to/from the root.
- `pairwise_exchange`: all-to-all in M - 1 steps; at step s daemon d sends to
  d + s and receives from d - s.
"""

from __future__ import annotations

from collections.abc import Sequence

from gradsync.daemon.algorithms.schedule import Schedule, StepBuilder, split_bounds

Ranges = Sequence[tuple[int, int]]

#: Pipeline chunk of the chains; a constant so that every daemon cuts alike.
CHAIN_CHUNK_BYTES = 1024 * 1024


def chain_chunks(count: int, itemsize: int) -> int:
    return max(1, min(256, -(-count * itemsize // CHAIN_CHUNK_BYTES)))


def chain_broadcast(rank: int, size: int, count: int, root: int, chunks: int) -> Schedule:
    """Daemon `rank`'s part of broadcasting [0, count) from daemon `root`."""
    if size == 1 or count == 0:
        return Schedule("chain", rank, size, count, ())
    bounds = split_bounds(0, count, chunks)
    builder = StepBuilder(chunks + size - 2)
    position = (rank - root) % size
    following = (rank + 1) % size
    preceding = (rank - 1) % size
    for chunk in range(chunks):
        if position < size - 1:
            builder.send(chunk + position, following, bounds[chunk], bounds[chunk + 1])
        if position > 0:
            builder.recv(chunk + position - 1, preceding, bounds[chunk], bounds[chunk + 1],
                         reduce=False)
    return builder.build("chain", rank, size, count)


def chain_reduce(rank: int, size: int, count: int, root: int, chunks: int) -> Schedule:
    """Daemon `rank`'s part of reducing [0, count) into daemon `root` along a chain."""
    if size == 1 or count == 0:
        return Schedule("chain", rank, size, count, ())
    bounds = split_bounds(0, count, chunks)
    builder = StepBuilder(chunks + size - 2)
    position = (rank - root) % size
    distance = size - 1 - position  # from the far end of the chain
    toward_root = (rank - 1) % size
    from_far = (rank + 1) % size
    for chunk in range(chunks):
        if position > 0:
            builder.send(chunk + distance, toward_root, bounds[chunk], bounds[chunk + 1])
        if position < size - 1:
            builder.recv(chunk + distance - 1, from_far, bounds[chunk], bounds[chunk + 1],
                         reduce=True)
    return builder.build("chain", rank, size, count)


def ring_all_gather(rank: int, parts: Sequence[Ranges], count: int) -> Schedule:
    """Every daemon ends with every part; daemon d starts with part d."""
    size = len(parts)
    builder = StepBuilder(max(0, size - 1))
    for step in range(size - 1):
        for start, stop in parts[(rank - step) % size]:
            builder.send(step, (rank + 1) % size, start, stop)
        for start, stop in parts[(rank - step - 1) % size]:
            builder.recv(step, (rank - 1) % size, start, stop, reduce=False)
    return builder.build("ring", rank, size, count)


def ring_reduce_scatter(rank: int, parts: Sequence[Ranges], count: int) -> Schedule:
    """Daemon d ends with part d reduced over all daemons."""
    size = len(parts)
    builder = StepBuilder(max(0, size - 1))
    for step in range(size - 1):
        for start, stop in parts[(rank - step - 1) % size]:
            builder.send(step, (rank + 1) % size, start, stop)
        for start, stop in parts[(rank - step - 2) % size]:
            builder.recv(step, (rank - 1) % size, start, stop, reduce=True)
    return builder.build("ring", rank, size, count)


def direct_gather(
    rank: int, root: int, sends: Ranges, receives: Sequence[Ranges], count: int
) -> Schedule:
    """Non-roots send `sends` to the root; the root receives receives[d] from each d."""
    size = len(receives)
    builder = StepBuilder(1 if size > 1 else 0)
    if size > 1:
        if rank == root:
            for peer in range(size):
                if peer != root:
                    for start, stop in receives[peer]:
                        builder.recv(0, peer, start, stop, reduce=False)
        else:
            for start, stop in sends:
                builder.send(0, root, start, stop)
    return builder.build("direct", rank, size, count)


def direct_scatter(
    rank: int, root: int, sends: Sequence[Ranges], receives: Ranges, count: int
) -> Schedule:
    """The root sends sends[d] to each daemon d; the others receive `receives`."""
    size = len(sends)
    builder = StepBuilder(1 if size > 1 else 0)
    if size > 1:
        if rank == root:
            for peer in range(size):
                if peer != root:
                    for start, stop in sends[peer]:
                        builder.send(0, peer, start, stop)
        else:
            for start, stop in receives:
                builder.recv(0, root, start, stop, reduce=False)
    return builder.build("direct", rank, size, count)


def pairwise_exchange(
    rank: int, sends: Sequence[Ranges], receives: Sequence[Ranges], count: int
) -> Schedule:
    """All-to-all: sends[d] go to daemon d, receives[d] come from daemon d."""
    size = len(sends)
    builder = StepBuilder(max(0, size - 1))
    for step in range(1, size):
        target, source = (rank + step) % size, (rank - step) % size
        for start, stop in sends[target]:
            builder.send(step - 1, target, start, stop)
        for start, stop in receives[source]:
            builder.recv(step - 1, source, start, stop, reduce=False)
    return builder.build("pairwise", rank, size, count)
