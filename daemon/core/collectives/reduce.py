"""reduce: every rank's c elements reduced into rank dst's buffer; the others keep theirs.

Across daemons: a pipelined chain towards the daemon holding dst.
"""

from __future__ import annotations

import numpy as np

from gradsync.daemon.algorithms import rooted
from gradsync.daemon.backends.reduce import combine_into
from gradsync.daemon.core.collectives.base import (
    InPlace,
    Layout,
    Plan,
    Views,
    chunk_of,
    divide,
    register,
)
from gradsync.protocol.dtypes import ReduceOp


@register
class Reduce(InPlace):
    name = "reduce"

    def run_local(self, ins: Views, outs: Views, world: int, c: int, op: ReduceOp | None,
                  root: int | None) -> None:
        assert op is not None and root is not None
        target = chunk_of(ins[root], 0, c)
        for rank in range(world):
            if rank != root:
                combine_into(target, chunk_of(ins[rank], 0, c), op)
        if op is ReduceOp.AVG:
            divide(target, world)

    def plan(self, layout: Layout, algorithm: str | None) -> Plan:
        collective, c, me, ins = layout.collective, layout.c, layout.me, layout.ins
        root, op = collective.root, collective.op
        assert root is not None and op is not None
        holder = layout.owner(root)
        first = layout.first
        work = chunk_of(ins[root], 0, c) if me == holder else np.empty(c, collective.dtype)
        chunks = rooted.chain_chunks(c, collective.dtype.itemsize)

        def combine_local() -> None:
            if me != holder:
                np.copyto(work, chunk_of(ins[first], 0, c))
            for rank in layout.local:
                if rank != (root if me == holder else first):
                    combine_into(work, chunk_of(ins[rank], 0, c), op)

        def finish() -> None:
            if me == holder and op is ReduceOp.AVG:
                divide(work, layout.world)

        return Plan(work, rooted.chain_reduce(me, layout.size, c, holder, chunks),
                    combine_local, finish, "chain")
