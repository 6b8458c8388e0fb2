"""scatter: chunk r of rank src's W·c input into rank r's c-element output.

Across daemons: the daemon holding src sends each daemon its ranks' chunks directly.
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
class Scatter(CollectiveKind):
    name = "scatter"

    def chunk(self, rank: int, root: int | None, count: int, out_count: int | None,
              world: int) -> int:
        self.need(out_count is not None, world, "every rank passes an output buffer")
        if rank == root:
            self.need(count == world * (out_count or 0), world, f"the source's input must "
                      f"hold {world * (out_count or 0)} elements, got {count}")
        else:
            self.need(count == 0, world, "only the source passes an input buffer")
        return out_count or 0

    def run_local(self, ins: Views, outs: Views, world: int, c: int, op: ReduceOp | None,
                  root: int | None) -> None:
        for rank in range(world):
            np.copyto(chunk_of(outs[rank], 0, c), chunk_of(ins[root or 0], rank, c))

    def plan(self, layout: Layout, algorithm: str | None) -> Plan:
        root, c, me, local = layout.collective.root, layout.c, layout.me, layout.local
        assert root is not None
        holder = layout.owner(root)
        if me == holder:
            work = need_view(layout.ins[root])

            def take_own() -> None:
                for rank in local:
                    np.copyto(chunk_of(layout.outs[rank], 0, c), chunk_of(work, rank, c))

            to_each = [layout.ranges(held) for held in layout.ranks_by_daemon]
            schedule = rooted.direct_scatter(me, holder, to_each, [], layout.world * c)
            return Plan(work, schedule, None, take_own, "direct")
        work = np.empty(len(local) * c, layout.collective.dtype)

        def unpack() -> None:
            for index, rank in enumerate(local):
                np.copyto(chunk_of(layout.outs[rank], 0, c), chunk_of(work, index, c))

        into_pack = layout.ranges(tuple(range(len(local))))
        schedule = rooted.direct_scatter(me, holder, [[] for _ in range(layout.size)],
                                         into_pack, len(local) * c)
        return Plan(work, schedule, None, unpack, "direct")
