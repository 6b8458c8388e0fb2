"""broadcast: rank src's c elements into every rank's buffer, in place.

Across daemons: a pipelined chain from the daemon holding src.
"""

from __future__ import annotations

import numpy as np

from gradsync.daemon.algorithms import rooted
from gradsync.daemon.core.collectives.base import (
    InPlace,
    Layout,
    Plan,
    Views,
    chunk_of,
    register,
)
from gradsync.protocol.dtypes import ReduceOp


@register
class Broadcast(InPlace):
    name = "broadcast"

    def run_local(self, ins: Views, outs: Views, world: int, c: int, op: ReduceOp | None,
                  root: int | None) -> None:
        origin = ins[root or 0]
        for rank in range(world):
            if rank != root:
                np.copyto(chunk_of(ins[rank], 0, c), chunk_of(origin, 0, c))

    def plan(self, layout: Layout, algorithm: str | None) -> Plan:
        root, c, me, ins = layout.collective.root, layout.c, layout.me, layout.ins
        assert root is not None
        holder = layout.owner(root)
        work = chunk_of(ins[root if me == holder else layout.first], 0, c)
        chunks = rooted.chain_chunks(c, layout.collective.dtype.itemsize)

        def spread() -> None:
            for rank in layout.local:
                target = chunk_of(ins[rank], 0, c)
                if target is not work and rank != root:
                    np.copyto(target, work)

        return Plan(work, rooted.chain_broadcast(me, layout.size, c, holder, chunks), None,
                    spread, "chain")
