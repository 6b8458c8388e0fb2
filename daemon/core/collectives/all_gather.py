"""all_gather: every rank's c elements, in rank order, into every rank's W·c output.

Across daemons: a ring over the daemons' parts of the output.
"""

from __future__ import annotations

import numpy as np

from gradsync.daemon.algorithms import rooted
from gradsync.daemon.core.collectives.base import (
    CollectiveKind,
    Layout,
    Plan,
    Views,
    chunk_of,
    need_view,
    register,
)
from gradsync.protocol.dtypes import ReduceOp


@register
class AllGather(CollectiveKind):
    name = "all_gather"

    def chunk(self, rank: int, root: int | None, count: int, out_count: int | None,
              world: int) -> int:
        self.need(out_count == world * count, world, f"output must hold world_size x input = "
                  f"{world * count} elements, got {out_count}")
        return count

    def run_local(self, ins: Views, outs: Views, world: int, c: int, op: ReduceOp | None,
                  root: int | None) -> None:
        for rank in range(world):
            for source in range(world):
                np.copyto(chunk_of(outs[rank], source, c), chunk_of(ins[source], 0, c))

    def plan(self, layout: Layout, algorithm: str | None) -> Plan:
        c, local, ins, outs = layout.c, layout.local, layout.ins, layout.outs
        work = need_view(outs[layout.first])

        def place_local() -> None:
            for rank in local:
                np.copyto(chunk_of(work, rank, c), chunk_of(ins[rank], 0, c))

        def copy_out() -> None:
            for rank in local[1:]:
                np.copyto(outs[rank], work)  # type: ignore[arg-type]

        parts = [layout.ranges(held) for held in layout.ranks_by_daemon]
        return Plan(work, rooted.ring_all_gather(layout.me, parts, layout.world * c),
                    place_local, copy_out, "ring")
