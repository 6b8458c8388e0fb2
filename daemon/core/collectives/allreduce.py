"""allreduce: every rank's c elements reduced, the result in place on every rank.

On one daemon the backend reduces the slots in place (run/runs.py), so there is
no local run here; across daemons its algorithm is chosen per call (ring, tree,
rhd, star, or `auto`'s pick), and an empty one still runs (its ranks meet).
"""

from __future__ import annotations

import numpy as np

from gradsync.daemon.algorithms import ALGORITHMS
from gradsync.daemon.algorithms.cost_model import best_tree_chunks
from gradsync.daemon.algorithms.schedule import in_blocks
from gradsync.daemon.algorithms.tree import tree
from gradsync.daemon.backends.reduce import broadcast_from_first, reduce_into_first
from gradsync.daemon.core.auto import CALIBRATING, model_terms
from gradsync.daemon.core.collectives.base import (
    InPlace,
    Layout,
    Plan,
    Views,
    block_of,
    register,
)
from gradsync.daemon.core.membership import Formation
from gradsync.protocol.dtypes import ReduceOp
from gradsync.protocol.requests import ALLREDUCE


@register
class AllReduce(InPlace):
    name = ALLREDUCE
    chosen_algorithm = True
    runs_empty = True

    def run_local(self, ins: Views, outs: Views, world: int, c: int, op: ReduceOp | None,
                  root: int | None) -> None:
        raise AssertionError("a one-daemon allreduce is reduced by the backend (run/runs.py)")

    def plan(self, layout: Layout, algorithm: str | None) -> Plan:
        collective = layout.collective
        assert collective.op is not None and algorithm is not None
        slots = [view for view in layout.ins.values() if view is not None]  # in rank order
        return allreduce_plan(layout.formation, layout.me, slots, collective.chunk,
                              collective.op, layout.world, algorithm, collective.dtype,
                              block_of(collective.compression))


def allreduce_plan(
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
