"""reduce_scatter: every rank's W·c elements reduced; rank r gets chunk r of the result.

Across daemons: the local inputs summed, then a ring reduce-scatter over the daemons.
"""

from __future__ import annotations

import numpy as np

from gradsync.daemon.algorithms import rooted
from gradsync.daemon.backends.reduce import combine_into
from gradsync.daemon.core.collectives.base import (
    CollectiveKind,
    Layout,
    Plan,
    Views,
    chunk_of,
    divide,
    register,
)
from gradsync.protocol.dtypes import ReduceOp


@register
class ReduceScatter(CollectiveKind):
    name = "reduce_scatter"

    def chunk(self, rank: int, root: int | None, count: int, out_count: int | None,
              world: int) -> int:
        self.need(out_count is not None and count == world * out_count, world,
                  f"input must hold world_size x output elements, got {count} and {out_count}")
        return out_count or 0

    def run_local(self, ins: Views, outs: Views, world: int, c: int, op: ReduceOp | None,
                  root: int | None) -> None:
        assert op is not None
        for rank in range(world):
            target = chunk_of(outs[rank], 0, c)
            np.copyto(target, chunk_of(ins[0], rank, c))
            for source in range(1, world):
                combine_into(target, chunk_of(ins[source], rank, c), op)
            if op is ReduceOp.AVG:
                divide(target, world)

    def plan(self, layout: Layout, algorithm: str | None) -> Plan:
        op, c, world = layout.collective.op, layout.c, layout.world
        assert op is not None
        local, ins, outs = layout.local, layout.ins, layout.outs
        work = np.empty(world * c, layout.collective.dtype)

        def sum_local() -> None:
            np.copyto(work, ins[layout.first])  # type: ignore[arg-type]
            for rank in local[1:]:
                combine_into(work, ins[rank], op)  # type: ignore[arg-type]

        def hand_out() -> None:
            for rank in local:
                target = chunk_of(outs[rank], 0, c)
                np.copyto(target, chunk_of(work, rank, c))
                if op is ReduceOp.AVG:
                    divide(target, world)

        parts = [layout.ranges(held) for held in layout.ranks_by_daemon]
        return Plan(work, rooted.ring_reduce_scatter(layout.me, parts, world * c), sum_local,
                    hand_out, "ring")
