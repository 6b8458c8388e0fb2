"""Agreeing on `auto`'s link costs while a job runs, epoch by epoch.

Every member daemon must pick the same algorithm for a collective (its slices
carry the algorithm in their fingerprint), so the figures `auto` feeds the cost
model must be the same on all of them.  A job starts with the figures agreed
when it formed: the medians of the probe results each member announced.

From then on its numbered keys are cut into epochs of `EPOCH_KEYS` keys.  For
epoch e ≥ 1 each member sends its own figures (fitted to the collectives it
ran, see `algorithms/calibration.py`) as it starts the collective half an
epoch before e, and an `auto` collective of epoch e uses the medians of every
member's figures for e.  They normally arrived half an epoch earlier; if not,
the collective waits for them within its own deadline.  Named (string) keys
have no order across daemons and keep the formation's figures.

A member's offer also carries its median time per (algorithm, size) it has
timed; the agreed time of a group is the median over the members that sent
one; `auto` lets those decide between the algorithms the model prices close
together (`calibration.measured_pick`).  The offer also carries the member's
`auto_explore_factor`, and the smallest one holds for all: members
configured differently still pick alike.

Pure bookkeeping: `ClusterJobs` sends and receives the messages.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import OrderedDict
from collections.abc import Mapping
from typing import NamedTuple

from gradsync.daemon.algorithms.calibration import Costs, Group
from gradsync.daemon.core.membership import Formation
from gradsync.daemon.core.outcome import Outcome
from gradsync.protocol.errors import GradsyncError

#: Keys per epoch: how often the members re-agree on `auto`'s figures.
EPOCH_KEYS = 32
#: (generation, epoch) tables a job keeps; older ones are dropped unless awaited.
TABLES_KEPT = 16

Epoch = tuple[int, int]  # (generation, epoch)


class Offer(NamedTuple):
    """One member's figures for an epoch, its median time per group, and its
    `auto_explore_factor`."""

    costs: Costs
    times: Mapping[Group, float]
    explore_factor: float = 1.0


@dataclasses.dataclass
class Agreement:
    """What every member uses for an epoch: median figures and median times,
    plus what this daemon derived from them once (so the epoch's later
    collectives reuse it)."""

    costs: Costs
    times: Mapping[Group, float]
    #: The smallest member's `auto_explore_factor`: all must use the same one.
    explore_factor: float = 1.0
    #: The job's formation re-priced with `costs`.
    priced: Formation | None = dataclasses.field(default=None, compare=False)
    #: `auto`'s picks made from this agreement, by (bytes, explore).
    picks: dict[tuple[int, bool], tuple[str, str]] = dataclasses.field(
        default_factory=dict, compare=False)


def epoch_of(key: int | str) -> int:
    """The epoch whose figures an `auto` collective with this key uses."""
    if isinstance(key, str) or key < 0:
        return 0
    return key // EPOCH_KEYS


def explores(key: int | str) -> bool:
    """True for keys in the first half of their epoch: `auto` may time an
    untried algorithm there.  Only those timings reach the offers sent at the
    half-way key (`epoch_to_offer`); later ones would wait an epoch more."""
    return not isinstance(key, str) and key >= 0 and key % EPOCH_KEYS < EPOCH_KEYS // 2


def epoch_to_offer(key: int | str) -> int:
    """The epoch whose figures a daemon sends as it starts this key (0: none)."""
    if isinstance(key, str) or key < 0:
        return 0
    return (key + EPOCH_KEYS // 2) // EPOCH_KEYS


class CostEpochs:
    """Each member's figures per (generation, epoch) of one job, and who waits for them."""

    def __init__(self) -> None:
        self._tables: OrderedDict[Epoch, dict[str, Offer]] = OrderedDict()
        self._offered: OrderedDict[Epoch, None] = OrderedDict()
        self._waiters: dict[Epoch, Outcome[Agreement]] = {}
        self._agreed: OrderedDict[Epoch, Agreement] = OrderedDict()
        #: The figures agreed for the newest epoch so far (None before the first).
        self.latest: Costs | None = None
        self._latest_epoch: Epoch = (-1, -1)

    def first_offer(self, generation: int, epoch: int) -> bool:
        """True once per (generation, epoch): this daemon should send its figures now."""
        if (generation, epoch) in self._offered:
            return False
        self._offered[(generation, epoch)] = None
        while len(self._offered) > TABLES_KEPT:
            self._offered.popitem(last=False)
        return True

    def add(self, generation: int, epoch: int, daemon: str, offer: Offer) -> bool:
        """Record a member's offer; the first for (generation, epoch) stands.

        Returns False for a repeat (ignored)."""
        table = self._tables.setdefault((generation, epoch), {})
        self._tables.move_to_end((generation, epoch))
        if daemon in table:
            return False
        table[daemon] = offer
        for old in list(self._tables)[: max(0, len(self._tables) - TABLES_KEPT)]:
            if old not in self._waiters:
                del self._tables[old]
        return True

    def agreed(
        self, generation: int, epoch: int, daemons: tuple[str, ...]
    ) -> Agreement | None:
        """The medians over `daemons`, once every one of them sent an offer."""
        agreement = self._agreed.get((generation, epoch))
        if agreement is not None:
            return agreement
        table = self._tables.get((generation, epoch), {})
        if any(daemon not in table for daemon in daemons):
            return None
        offers = [table[d] for d in daemons]
        costs = Costs(
            statistics.median(offer.costs.alpha_s for offer in offers),
            statistics.median(offer.costs.beta_s_per_byte for offer in offers),
        )
        timed: dict[Group, list[float]] = {}
        for offer in offers:
            for group, seconds in offer.times.items():
                timed.setdefault(group, []).append(seconds)
        agreement = Agreement(
            costs, {group: statistics.median(values) for group, values in timed.items()},
            min(offer.explore_factor for offer in offers))
        self._agreed[(generation, epoch)] = agreement
        while len(self._agreed) > TABLES_KEPT:
            self._agreed.popitem(last=False)
        if (generation, epoch) >= self._latest_epoch:
            self.latest, self._latest_epoch = costs, (generation, epoch)
        return agreement

    def missing(self, generation: int, epoch: int, daemons: tuple[str, ...]) -> list[str]:
        table = self._tables.get((generation, epoch), {})
        return [daemon for daemon in daemons if daemon not in table]

    def waiter(self, generation: int, epoch: int) -> Outcome[Agreement]:
        """The agreed figures, once in: `notify` settles it, `fail` fails it."""
        outcome = self._waiters.get((generation, epoch))
        if outcome is None:
            outcome = self._waiters[(generation, epoch)] = Outcome()
        return outcome

    def notify(self, generation: int, epoch: int, daemons: tuple[str, ...]) -> None:
        future = self._waiters.get((generation, epoch))
        if future is None:
            return
        agreement = self.agreed(generation, epoch, daemons)
        if agreement is not None:
            del self._waiters[(generation, epoch)]
            if not future.done():
                future.set_result(agreement)

    def forget_waiter(self, generation: int, epoch: int) -> None:
        """Nobody waits any more (a deadline passed)."""
        self._waiters.pop((generation, epoch), None)

    def fail(self, error: GradsyncError) -> None:
        """The job broke: nobody will send the missing figures."""
        for outcome in self._waiters.values():
            if not outcome.done():
                outcome.set_exception(error)
        self._waiters.clear()
