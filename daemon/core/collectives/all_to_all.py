"""all_to_all: chunk d of rank s's W·c input into chunk s of rank d's W·c output.

Across daemons: each daemon packs what goes to each other daemon (destination rank
major, source rank minor), the daemons exchange pairwise, and unpack.
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
    register,
)
from gradsync.protocol.dtypes import ReduceOp


@register
class AllToAll(CollectiveKind):
    name = "all_to_all"

    def chunk(self, rank: int, root: int | None, count: int, out_count: int | None,
              world: int) -> int:
        self.need(out_count == count and count % world == 0, world,
                  f"input and output must hold the same multiple of world_size elements, got "
                  f"{count} and {out_count}")
        return count // world

    def run_local(self, ins: Views, outs: Views, world: int, c: int, op: ReduceOp | None,
                  root: int | None) -> None:
        for rank in range(world):
            for source in range(world):
                np.copyto(chunk_of(outs[rank], source, c), chunk_of(ins[source], rank, c))

    def plan(self, layout: Layout, algorithm: str | None) -> Plan:
        me, c, ins, outs = layout.me, layout.c, layout.ins, layout.outs
        ranks_by_daemon, local = layout.ranks_by_daemon, layout.local
        send_at: list[list[tuple[int, int]]] = [[] for _ in range(layout.size)]
        recv_at: list[list[tuple[int, int]]] = [[] for _ in range(layout.size)]
        offset = 0
        for ranges in (send_at, recv_at):
            for peer, held in enumerate(ranks_by_daemon):
                if peer != me:
                    length = len(held) * len(local) * c
                    ranges[peer] = [(offset, offset + length)] if length else []
                    offset += length
        work = np.empty(offset, layout.collective.dtype)

        def pack() -> None:
            for peer, held in enumerate(ranks_by_daemon):
                if peer == me or not send_at[peer]:
                    continue
                position = send_at[peer][0][0]
                for dest in held:
                    for source in local:
                        np.copyto(work[position : position + c], chunk_of(ins[source], dest, c))
                        position += c
            for dest in local:
                for source in local:
                    np.copyto(chunk_of(outs[dest], source, c), chunk_of(ins[source], dest, c))

        def unpack() -> None:
            for peer, held in enumerate(ranks_by_daemon):
                if peer == me or not recv_at[peer]:
                    continue
                position = recv_at[peer][0][0]
                for dest in local:
                    for source in held:
                        np.copyto(chunk_of(outs[dest], source, c), work[position : position + c])
                        position += c

        schedule = rooted.pairwise_exchange(me, send_at, recv_at, offset)
        return Plan(work, schedule, pack, unpack, "pairwise")
