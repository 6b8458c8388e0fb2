"""Every collective the daemon runs: one module per kind, found by its wire name.

A kind (`base.CollectiveKind`) says its size rules (the per-rank chunk c of a
submission), its run when all its ranks are on this daemon, and its `Plan` when
they span daemons: a work buffer, a local phase filling it, a schedule between
daemons over it, and a local phase distributing the result.  Adding a collective
is one module here (with `@register`) and its wire name in protocol/requests.py.

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

from gradsync.daemon.core.collectives import (  # noqa: F401 (each registers its kind)
    all_gather,
    all_to_all,
    allreduce,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)
from gradsync.daemon.core.collectives.base import (
    KINDS,
    CollectiveKind,
    Layout,
    MatchedCollective,
    Plan,
    Views,
    block_of,
    kind_of,
)
from gradsync.daemon.core.membership import Formation
from gradsync.protocol.dtypes import ReduceOp

__all__ = ["KINDS", "MatchedCollective", "CollectiveKind", "Plan", "Views", "block_of",
           "chooses_algorithm", "chunk_count", "kind_of", "make_plan", "run_local"]


def chooses_algorithm(kind: str) -> bool:
    """Whether `kind`'s inter-daemon algorithm is chosen per call (asked for, or auto's)."""
    return kind_of(kind).chosen_algorithm


def chunk_count(
    kind: str, rank: int, root: int | None, count: int, out_count: int | None, world: int
) -> int:
    """The per-rank chunk c of a submission; raises if its buffers do not fit the rules."""
    return kind_of(kind).chunk(rank, root, count, out_count, world)


def run_local(
    kind: str, ins: Views, outs: Views, world: int, c: int, op: ReduceOp | None, root: int | None
) -> None:
    """Execute a collective whose ranks are all on this daemon (ranks 0..world-1)."""
    if c:
        kind_of(kind).run_local(ins, outs, world, c, op, root)


def make_plan(
    collective: MatchedCollective, formation: Formation, me: int, ins: Views, outs: Views,
    world: int, algorithm: str | None = None,
) -> Plan:
    """Daemon `me`'s plan in `formation`; `ins`/`outs` hold the views of its local
    ranks.  `algorithm`: the one chosen, for a kind that `chooses_algorithm`."""
    layout = Layout(collective, formation, me, ins, outs, world)
    return kind_of(collective.kind).plan(layout, algorithm)
