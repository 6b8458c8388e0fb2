"""What every collective is made of: its matched description, its plan across
daemons, and the class each kind of collective fills in (one module per kind).

Sizes are in units of the per-rank chunk c, with W ranks; each kind's module
says its own (input, output, root) in its docstring.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from gradsync.daemon.algorithms.schedule import Schedule
from gradsync.daemon.core.membership import Formation
from gradsync.protocol.compression import FP8_BLOCK
from gradsync.protocol.dtypes import ReduceOp
from gradsync.protocol.errors import InvalidArgumentError

Views = dict[int, np.ndarray | None]


@dataclasses.dataclass(frozen=True)
class MatchedCollective:
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
        return self.chunk == 0 and not kind_of(self.kind).runs_empty


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


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a multi-node collective's ranks are, as daemon `me` of `formation` sees
    it, with the views of its local ranks' buffers."""

    collective: MatchedCollective
    formation: Formation
    me: int
    ins: Views
    outs: Views
    world: int

    @property
    def c(self) -> int:
        return self.collective.chunk

    @property
    def ranks_by_daemon(self) -> tuple[tuple[int, ...], ...]:
        return self.formation.ranks_by_daemon

    @property
    def size(self) -> int:
        """Daemons in the formation."""
        return len(self.formation.ranks_by_daemon)

    @property
    def local(self) -> tuple[int, ...]:
        """This daemon's ranks, in order."""
        return self.formation.ranks_by_daemon[self.me]

    @property
    def first(self) -> int:
        return self.local[0]

    def owner(self, rank: int) -> int:
        """The daemon (index) that holds `rank`."""
        for daemon, held in enumerate(self.formation.ranks_by_daemon):
            if rank in held:
                return daemon
        raise KeyError(rank)

    def ranges(self, ranks: tuple[int, ...]) -> list[tuple[int, int]]:
        """The element ranges of these ranks' chunks in a W·c buffer."""
        c = self.c
        return [(r * c, (r + 1) * c) for r in ranks]


#: Every kind, by wire name: filled by `register` as each kind's module is imported
#: (the package's __init__ imports them all).
KINDS: dict[str, CollectiveKind] = {}


def kind_of(name: str) -> CollectiveKind:
    """The kind of collective a wire name stands for."""
    kind = KINDS.get(name)
    if kind is None:
        raise InvalidArgumentError(f"unknown collective {name!r}")
    return kind


def register(cls: type[CollectiveKind]) -> type[CollectiveKind]:
    """Class decorator: the kind is found by its wire name from now on."""
    assert cls.name and cls.name not in KINDS, cls.name
    KINDS[cls.name] = cls()
    return cls


class CollectiveKind:
    """One kind of collective: its size rules, its run on one daemon, its plan across
    daemons.  Each lives in a module of its own; the registry (`__init__.py`) finds it
    by its wire name."""

    #: The wire name (protocol/requests.py's COLLECTIVES).
    name: str = ""
    #: Its inter-daemon algorithm is chosen per call (asked for, or `auto`'s pick).
    chosen_algorithm: bool = False
    #: It still runs across daemons with no element (its ranks meet).
    runs_empty: bool = False

    def chunk(self, rank: int, root: int | None, count: int, out_count: int | None,
              world: int) -> int:
        """The per-rank chunk c of a submission; raises if its buffers do not fit."""
        raise NotImplementedError

    def run_local(self, ins: Views, outs: Views, world: int, c: int, op: ReduceOp | None,
                  root: int | None) -> None:
        """Run it when its ranks (0..world-1) are all on this daemon; c > 0."""
        raise NotImplementedError

    def plan(self, layout: Layout, algorithm: str | None) -> Plan:
        """This daemon's part when its ranks span daemons."""
        raise NotImplementedError

    def need(self, condition: bool, world: int, what: str) -> None:
        """Refuse a submission whose buffers break this kind's size rules."""
        if not condition:
            raise InvalidArgumentError(f"{self.name} with world_size {world}: {what}")


class InPlace(CollectiveKind):
    """A kind with one buffer of c elements per rank, used in place."""

    def chunk(self, rank: int, root: int | None, count: int, out_count: int | None,
              world: int) -> int:
        self.need(out_count is None, world, "takes one buffer, in place")
        return count


def need_view(view: np.ndarray | None) -> np.ndarray:
    assert view is not None, "a buffer the size rules require is missing"
    return view


def chunk_of(array: np.ndarray | None, index: int, c: int) -> np.ndarray:
    """Chunk `index` (of c elements) of `array`."""
    assert array is not None
    return array[index * c : (index + 1) * c]


def divide(array: np.ndarray, by: int) -> None:
    with np.errstate(all="ignore"):
        np.divide(array, by, out=array)


def block_of(compression: str | None) -> int:
    """Elements per block of a wire format: the unit schedule ranges come in."""
    return FP8_BLOCK if compression == "fp8" else 1
