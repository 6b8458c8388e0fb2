"""gather: every rank's c elements, in rank order, into rank dst's W·c output.

Across daemons: each daemon packs its ranks' chunks and sends them straight to the
daemon holding dst.
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
class Gather(CollectiveKind):
    name = "gather"

    def chunk(self, rank: int, root: int | None, count: int, out_count: int | None,
              world: int) -> int:
        if rank == root:
            self.need(out_count == world * count, world, f"the destination's output must "
                      f"hold {world * count} elements, got {out_count}")
        else:
            self.need(out_count is None, world, "only the destination passes an output buffer")
        return count

    def run_local(self, ins: Views, outs: Views, world: int, c: int, op: ReduceOp | None,
                  root: int | None) -> None:
        for source in range(world):
            np.copyto(chunk_of(outs[root or 0], source, c), chunk_of(ins[source], 0, c))

    def plan(self, layout: Layout, algorithm: str | None) -> Plan:
        root, c, me, local = layout.collective.root, layout.c, layout.me, layout.local
        assert root is not None
        holder = layout.owner(root)
        if me == holder:
            work = need_view(layout.outs[root])

            def place_own() -> None:
                for rank in local:
                    np.copyto(chunk_of(work, rank, c), chunk_of(layout.ins[rank], 0, c))

            receives = [layout.ranges(held) for held in layout.ranks_by_daemon]
            schedule = rooted.direct_gather(me, holder, [], receives, layout.world * c)
            return Plan(work, schedule, place_own, None, "direct")
        work = np.empty(len(local) * c, layout.collective.dtype)

        def pack() -> None:
            for index, rank in enumerate(local):
                np.copyto(chunk_of(work, index, c), chunk_of(layout.ins[rank], 0, c))

        sends = layout.ranges(tuple(range(len(local))))
        schedule = rooted.direct_gather(me, holder, sends, [[] for _ in range(layout.size)],
                                        len(local) * c)
        return Plan(work, schedule, pack, None, "direct")
