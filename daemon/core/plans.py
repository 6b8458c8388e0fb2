"""Every collective: argument rules, local execution, multi-node plans.

Every collective is described by the same few things: how big each rank's
input and output must be (in units of the per-rank chunk c, with W ranks),
what to do when all ranks are on this daemon (copies and reductions between
the shared-memory slots), and, when ranks span daemons, a `Plan`: a work
buffer, a local phase filling it, a schedule between daemons over it, and a
local phase distributing the result.  Allreduce is one of them; its plan is
the one whose algorithm is chosen per call (ring, tree, rhd, star, or `auto`'s
pick), and on one daemon its backend reduces the slots in place
(run/local.py), with no plan.

Sizes (c = chunk, W = world size of the job):

| collective     | input                | output               | root |
| -------------- | -------------------- | -------------------- | ---- |
| allreduce      | c (in place)         | -                    |      |
| broadcast      | c (in place)         | -                    | src  |
| reduce         | c (in place at dst)  | -                    | dst  |
| all_gather     | c                    | W·c                  |      |
| reduce_scatter | W·c                  | c                    |      |
| gather         | c                    | W·c at dst, else -   | dst  |
| scatter        | W·c at src, else -   | c                    | src  |
| all_to_all     | W·c                  | W·c                  |      |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from gradsync.daemon.algorithms import ALGORITHMS, rooted
from gradsync.daemon.algorithms.cost_model import best_tree_chunks
from gradsync.daemon.algorithms.schedule import Schedule, in_blocks
from gradsync.daemon.algorithms.tree import tree
from gradsync.daemon.backends.reduce import (
    broadcast_from_first,
    combine_into,
    reduce_into_first,
)
from gradsync.daemon.core.auto import CALIBRATING, model_terms
from gradsync.daemon.core.membership import Formation
from gradsync.protocol.compression import FP8_BLOCK
from gradsync.protocol.dtypes import ReduceOp
from gradsync.protocol.errors import InvalidArgumentError
from gradsync.protocol.requests import ALLREDUCE  # the collectives' names: the wire's

#: Collectives whose inter-daemon algorithm is chosen per call (requested, or
#: `auto`'s pick); every other one has the single plan below.
CHOSEN_ALGORITHM = frozenset({ALLREDUCE})

Views = dict[int, np.ndarray | None]


@dataclasses.dataclass(frozen=True)
class Collective:
    """What a matched collective is, the same on every local rank (their
    fingerprints agree): its kind, element type, per-rank chunk, and the
    reduction, root and requested algorithm where it has them."""

    kind: str
    dtype: np.dtype
    chunk: int
    op: ReduceOp | None = None
    root: int | None = None
    #: allreduce only: the algorithm asked for (None: the daemon's default).
    algorithm: str | None = None
    #: The inter-daemon wire format (protocol/compression.py; None: exact), and
    #: whether this daemon feeds its rounding residual into the next call.
    compression: str | None = None
    error_feedback: bool = False

    def moves_nothing(self) -> bool:
        """True when there is nothing to do: no element anywhere.  An empty
        allreduce still runs across daemons, as it always has (its ranks meet)."""
        return self.chunk == 0 and self.kind != ALLREDUCE


def chunk_count(
    kind: str, rank: int, root: int | None, count: int, out_count: int | None, world: int
) -> int:
    """The per-rank chunk c of a submission; raises if its buffers do not fit the rules."""
    def need(condition: bool, what: str) -> None:
        if not condition:
            raise InvalidArgumentError(f"{kind} with world_size {world}: {what}")

    if kind in (ALLREDUCE, "broadcast", "reduce"):
        need(out_count is None, "takes one buffer, in place")
        return count
    if kind == "all_gather":
        need(out_count == world * count, f"output must hold world_size x input = "
             f"{world * count} elements, got {out_count}")
        return count
    if kind == "reduce_scatter":
        need(out_count is not None and count == world * out_count,
             f"input must hold world_size x output elements, got {count} and {out_count}")
        return out_count or 0
    if kind == "gather":
        if rank == root:
            need(out_count == world * count, f"the destination's output must hold "
                 f"{world * count} elements, got {out_count}")
        else:
            need(out_count is None, "only the destination passes an output buffer")
        return count
    if kind == "scatter":
        need(out_count is not None, "every rank passes an output buffer")
        if rank == root:
            need(count == world * (out_count or 0), f"the source's input must hold "
                 f"{world * (out_count or 0)} elements, got {count}")
        else:
            need(count == 0, "only the source passes an input buffer")
        return out_count or 0
    if kind == "all_to_all":
        need(out_count == count and count % world == 0,
             f"input and output must hold the same multiple of world_size elements, got "
             f"{count} and {out_count}")
        return count // world
    raise InvalidArgumentError(f"unknown collective {kind!r}")


def _need(view: np.ndarray | None) -> np.ndarray:
    assert view is not None, "a buffer the size rules require is missing"
    return view


def _chunk(array: np.ndarray | None, index: int, c: int) -> np.ndarray:
    assert array is not None
    return array[index * c : (index + 1) * c]


def _divide(array: np.ndarray, by: int) -> None:
    with np.errstate(all="ignore"):
        np.divide(array, by, out=array)


def run_local(
    kind: str, ins: Views, outs: Views, world: int, c: int, op: ReduceOp | None, root: int | None
) -> None:
    """Execute a collective whose ranks are all on this daemon (ranks 0..world-1)."""
    if c == 0:
        return
    ranks = range(world)
    if kind == "broadcast":
        origin = ins[root or 0]
        for rank in ranks:
            if rank != root:
                np.copyto(_chunk(ins[rank], 0, c), _chunk(origin, 0, c))
    elif kind == "reduce":
        assert op is not None and root is not None
        target = _chunk(ins[root], 0, c)
        for rank in ranks:
            if rank != root:
                combine_into(target, _chunk(ins[rank], 0, c), op)
        if op is ReduceOp.AVG:
            _divide(target, world)
    elif kind == "all_gather":
        for rank in ranks:
            for source in ranks:
                np.copyto(_chunk(outs[rank], source, c), _chunk(ins[source], 0, c))
    elif kind == "reduce_scatter":
        assert op is not None
        for rank in ranks:
            target = _chunk(outs[rank], 0, c)
            np.copyto(target, _chunk(ins[0], rank, c))
            for source in ranks[1:]:
                combine_into(target, _chunk(ins[source], rank, c), op)
            if op is ReduceOp.AVG:
                _divide(target, world)
    elif kind == "gather":
        for source in ranks:
            np.copyto(_chunk(outs[root or 0], source, c), _chunk(ins[source], 0, c))
    elif kind == "scatter":
        for rank in ranks:
            np.copyto(_chunk(outs[rank], 0, c), _chunk(ins[root or 0], rank, c))
    elif kind == "all_to_all":
        for rank in ranks:
            for source in ranks:
                np.copyto(_chunk(outs[rank], source, c), _chunk(ins[source], rank, c))


@dataclasses.dataclass
class Plan:
    """A multi-node collective on this daemon: fill `work`, run `schedule`, distribute."""

    work: np.ndarray
    schedule: Schedule
    #: Work before and after the schedule; None when there is none (no thread hand-off).
    before: Callable[[], None] | None
    after: Callable[[], None] | None
    algorithm: str
    #: Swap fingerprints with every member daemon first.  Needed where data flows
    #: one way (some daemon receives nothing, so could not tell that the others
    #: disagree); an allreduce's every daemon receives, and its slices carry the
    #: fingerprint, so it skips the extra round.
    agree_first: bool = True
    #: An allreduce's (algorithm, bytes): its timing goes to `auto`'s measured
    #: times; None for the other collectives.
    timed: tuple[str, int] | None = None
    #: ... and its terms in the cost model, (alphas, bytes at beta), where its
    #: timing also calibrates `auto`'s figures (see auto.CALIBRATING).
    modelled: tuple[float, float] | None = None


def make_plan(
    collective: Collective,
    formation: Formation,
    me: int,
    ins: Views,
    outs: Views,
    world: int,
    algorithm: str | None = None,
) -> Plan:
    """Daemon `me`'s plan in `formation`; `ins`/`outs` hold the views of its
    local ranks.  `algorithm`: the one chosen, for a kind in CHOSEN_ALGORITHM."""
    kind, c, op, root, dtype = (collective.kind, collective.chunk, collective.op,
                                collective.root, collective.dtype)
    ranks_by_daemon = formation.ranks_by_daemon
    if kind == ALLREDUCE:
        assert op is not None and algorithm is not None
        slots = [view for view in ins.values() if view is not None]  # in rank order
        return _allreduce_plan(formation, me, slots, c, op, world, algorithm, dtype,
                               block_of(collective.compression))
    size = len(ranks_by_daemon)
    local = ranks_by_daemon[me]
    owner = {rank: d for d, held in enumerate(ranks_by_daemon) for rank in held}
    first = local[0]

    def ranges(rank_list: tuple[int, ...], base: int = 0) -> list[tuple[int, int]]:
        return [(base + r * c, base + (r + 1) * c) for r in rank_list]

    if kind == "broadcast":
        assert root is not None
        holder = owner[root]
        work = _chunk(ins[root if me == holder else first], 0, c)
        chunks = rooted.chain_chunks(c, dtype.itemsize)

        def spread() -> None:
            for rank in local:
                target = _chunk(ins[rank], 0, c)
                if target is not work and rank != root:
                    np.copyto(target, work)

        return Plan(work, rooted.chain_broadcast(me, size, c, holder, chunks), None,
                    spread, "chain")

    if kind == "reduce":
        assert root is not None and op is not None
        holder = owner[root]
        work = _chunk(ins[root], 0, c) if me == holder else np.empty(c, dtype)
        chunks = rooted.chain_chunks(c, dtype.itemsize)

        def combine_local() -> None:
            if me != holder:
                np.copyto(work, _chunk(ins[first], 0, c))
            for rank in local:
                if rank != (root if me == holder else first):
                    combine_into(work, _chunk(ins[rank], 0, c), op)

        def finish() -> None:
            if me == holder and op is ReduceOp.AVG:
                _divide(work, world)

        return Plan(work, rooted.chain_reduce(me, size, c, holder, chunks), combine_local,
                    finish, "chain")

    if kind == "all_gather":
        work = _need(outs[first])

        def place_local() -> None:
            for rank in local:
                np.copyto(_chunk(work, rank, c), _chunk(ins[rank], 0, c))

        def copy_out() -> None:
            for rank in local[1:]:
                np.copyto(outs[rank], work)  # type: ignore[arg-type]

        parts = [ranges(held) for held in ranks_by_daemon]
        return Plan(work, rooted.ring_all_gather(me, parts, world * c), place_local, copy_out,
                    "ring")

    if kind == "reduce_scatter":
        assert op is not None
        work = np.empty(world * c, dtype)

        def sum_local() -> None:
            np.copyto(work, ins[first])  # type: ignore[arg-type]
            for rank in local[1:]:
                combine_into(work, ins[rank], op)  # type: ignore[arg-type]

        def hand_out() -> None:
            for rank in local:
                target = _chunk(outs[rank], 0, c)
                np.copyto(target, _chunk(work, rank, c))
                if op is ReduceOp.AVG:
                    _divide(target, world)

        parts = [ranges(held) for held in ranks_by_daemon]
        return Plan(work, rooted.ring_reduce_scatter(me, parts, world * c), sum_local,
                    hand_out, "ring")

    if kind == "gather":
        assert root is not None
        holder = owner[root]
        if me == holder:
            work = _need(outs[root])

            def place_own() -> None:
                for rank in local:
                    np.copyto(_chunk(work, rank, c), _chunk(ins[rank], 0, c))

            receives = [ranges(held) for held in ranks_by_daemon]
            schedule = rooted.direct_gather(me, holder, [], receives, world * c)
            return Plan(work, schedule, place_own, None, "direct")
        work = np.empty(len(local) * c, dtype)

        def pack() -> None:
            for index, rank in enumerate(local):
                np.copyto(_chunk(work, index, c), _chunk(ins[rank], 0, c))

        sends = ranges(tuple(range(len(local))))
        schedule = rooted.direct_gather(me, holder, sends, [[] for _ in range(size)],
                                        len(local) * c)
        return Plan(work, schedule, pack, None, "direct")

    if kind == "scatter":
        assert root is not None
        holder = owner[root]
        if me == holder:
            work = _need(ins[root])

            def take_own() -> None:
                for rank in local:
                    np.copyto(_chunk(outs[rank], 0, c), _chunk(work, rank, c))

            to_each = [ranges(held) for held in ranks_by_daemon]
            schedule = rooted.direct_scatter(me, holder, to_each, [], world * c)
            return Plan(work, schedule, None, take_own, "direct")
        work = np.empty(len(local) * c, dtype)

        def unpack() -> None:
            for index, rank in enumerate(local):
                np.copyto(_chunk(outs[rank], 0, c), _chunk(work, index, c))

        into_pack = ranges(tuple(range(len(local))))
        schedule = rooted.direct_scatter(me, holder, [[] for _ in range(size)], into_pack,
                                         len(local) * c)
        return Plan(work, schedule, None, unpack, "direct")

    if kind == "all_to_all":
        return _all_to_all_plan(me, ranks_by_daemon, ins, outs, c, dtype)
    raise InvalidArgumentError(f"unknown collective {kind!r}")


def block_of(compression: str | None) -> int:
    """Elements per block of a wire format: the unit schedule ranges come in."""
    return FP8_BLOCK if compression == "fp8" else 1


def _allreduce_plan(
    formation: Formation, me: int, slots: list[np.ndarray], count: int, op: ReduceOp, world: int,
    algorithm: str, dtype: np.dtype, block: int = 1,
) -> Plan:
    """Reduce the local slots into the first, run `algorithm` over it between
    the daemons, then write the result (divided, for avg) back to every slot.
    With `block` > 1 (fp8) every range of the schedule is whole blocks."""
    nbytes = count * dtype.itemsize
    divide = world if op is ReduceOp.AVG else 1
    daemons = len(formation.daemons)
    work = slots[0] if slots else np.empty(0, dtype=np.uint8)

    def before() -> None:
        reduce_into_first(slots, 0, count, op)

    def after() -> None:
        broadcast_from_first(slots, 0, count, divide)

    if algorithm == "tree":
        # The chunk count the cost model priced; every daemon computes the same.
        chunks = best_tree_chunks(daemons, nbytes, formation.alpha_s,
                                  formation.beta_s_per_byte)
        schedule = tree(me, daemons, -(-count // block), chunks=chunks)
    else:
        schedule = ALGORITHMS[algorithm](me, daemons, -(-count // block))
    if block > 1:
        schedule = in_blocks(schedule, block, count)
    return Plan(
        work, schedule, before if len(slots) > 1 else None,
        after if len(slots) > 1 or (slots and divide != 1) else None,
        algorithm, agree_first=False, timed=(algorithm, nbytes),
        modelled=model_terms(algorithm, daemons, nbytes) if algorithm in CALIBRATING else None,
    )


def _all_to_all_plan(
    me: int,
    ranks_by_daemon: tuple[tuple[int, ...], ...],
    ins: Views,
    outs: Views,
    c: int,
    dtype: np.dtype,
) -> Plan:
    """Pack what goes to each daemon (dest rank major, source rank minor), exchange, unpack."""
    local = ranks_by_daemon[me]
    size = len(ranks_by_daemon)
    send_at: list[list[tuple[int, int]]] = [[] for _ in range(size)]
    recv_at: list[list[tuple[int, int]]] = [[] for _ in range(size)]
    offset = 0
    for peer, held in enumerate(ranks_by_daemon):
        if peer != me:
            length = len(held) * len(local) * c
            send_at[peer] = [(offset, offset + length)] if length else []
            offset += length
    for peer, held in enumerate(ranks_by_daemon):
        if peer != me:
            length = len(held) * len(local) * c
            recv_at[peer] = [(offset, offset + length)] if length else []
            offset += length
    work = np.empty(offset, dtype)

    def pack() -> None:
        for peer, held in enumerate(ranks_by_daemon):
            if peer == me or not send_at[peer]:
                continue
            position = send_at[peer][0][0]
            for dest in held:
                for source in local:
                    np.copyto(work[position : position + c], _chunk(ins[source], dest, c))
                    position += c
        for dest in local:
            for source in local:
                np.copyto(_chunk(outs[dest], source, c), _chunk(ins[source], dest, c))

    def unpack() -> None:
        for peer, held in enumerate(ranks_by_daemon):
            if peer == me or not recv_at[peer]:
                continue
            position = recv_at[peer][0][0]
            for dest in local:
                for source in held:
                    np.copyto(_chunk(outs[dest], source, c), work[position : position + c])
                    position += c

    schedule = rooted.pairwise_exchange(me, send_at, recv_at, offset)
    return Plan(work, schedule, pack, unpack, "pairwise")
