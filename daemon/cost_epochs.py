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

Pure bookkeeping: `ClusterJobs` sends and receives the messages.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import OrderedDict

from gradsync.daemon.algorithms.calibration import Costs
from gradsync.daemon.membership import Formation
from gradsync.protocol.errors import GradsyncError

#: Keys per epoch: how often the members re-agree on `auto`'s figures.
EPOCH_KEYS = 32
#: (generation, epoch) tables a job keeps; older ones are dropped unless awaited.
TABLES_KEPT = 16

Epoch = tuple[int, int]  # (generation, epoch)


def epoch_of(key: int | str) -> int:
    """The epoch whose figures an `auto` collective with this key uses."""
    if isinstance(key, str) or key < 0:
        return 0
    return key // EPOCH_KEYS


def epoch_to_offer(key: int | str) -> int:
    """The epoch whose figures a daemon sends as it starts this key (0: none)."""
    if isinstance(key, str) or key < 0:
        return 0
    return (key + EPOCH_KEYS // 2) // EPOCH_KEYS


class CostEpochs:
    """Each member's figures per (generation, epoch) of one job, and who waits for them."""

    def __init__(self) -> None:
        self._tables: OrderedDict[Epoch, dict[str, Costs]] = OrderedDict()
        self._offered: OrderedDict[Epoch, None] = OrderedDict()
        self._waiters: dict[Epoch, asyncio.Future[Costs]] = {}
        self._agreed: OrderedDict[Epoch, Costs] = OrderedDict()
        #: The figures agreed for the newest epoch so far (None before the first).
        self.latest: Costs | None = None
        self._latest_epoch: Epoch = (-1, -1)
        #: The job's formation re-priced with the figures last agreed (a cache).
        self.priced: Formation | None = None

    def first_offer(self, generation: int, epoch: int) -> bool:
        """True once per (generation, epoch): this daemon should send its figures now."""
        if (generation, epoch) in self._offered:
            return False
        self._offered[(generation, epoch)] = None
        while len(self._offered) > TABLES_KEPT:
            self._offered.popitem(last=False)
        return True

    def add(self, generation: int, epoch: int, daemon: str, costs: Costs) -> bool:
        """Record a member's figures; the first for (generation, epoch) stands.

        Returns False for a repeat (ignored)."""
        table = self._tables.setdefault((generation, epoch), {})
        self._tables.move_to_end((generation, epoch))
        if daemon in table:
            return False
        table[daemon] = costs
        for old in list(self._tables)[: max(0, len(self._tables) - TABLES_KEPT)]:
            if old not in self._waiters:
                del self._tables[old]
        return True

    def agreed(self, generation: int, epoch: int, daemons: tuple[str, ...]) -> Costs | None:
        """The medians over `daemons`, once every one of them sent figures."""
        costs = self._agreed.get((generation, epoch))
        if costs is not None:
            return costs
        table = self._tables.get((generation, epoch), {})
        if any(daemon not in table for daemon in daemons):
            return None
        costs = Costs(
            statistics.median(table[d].alpha_s for d in daemons),
            statistics.median(table[d].beta_s_per_byte for d in daemons),
        )
        self._agreed[(generation, epoch)] = costs
        while len(self._agreed) > TABLES_KEPT:
            self._agreed.popitem(last=False)
        if (generation, epoch) >= self._latest_epoch:
            self.latest, self._latest_epoch = costs, (generation, epoch)
        return costs

    def missing(self, generation: int, epoch: int, daemons: tuple[str, ...]) -> list[str]:
        table = self._tables.get((generation, epoch), {})
        return [daemon for daemon in daemons if daemon not in table]

    def waiter(self, generation: int, epoch: int) -> asyncio.Future[Costs]:
        """A future for the agreed figures; `notify` resolves it, `fail` fails it."""
        future = self._waiters.get((generation, epoch))
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._waiters[(generation, epoch)] = future
        return future

    def notify(self, generation: int, epoch: int, daemons: tuple[str, ...]) -> None:
        future = self._waiters.get((generation, epoch))
        if future is None:
            return
        costs = self.agreed(generation, epoch, daemons)
        if costs is not None:
            del self._waiters[(generation, epoch)]
            if not future.done():
                future.set_result(costs)

    def forget_waiter(self, generation: int, epoch: int) -> None:
        """Nobody waits any more (a deadline passed)."""
        self._waiters.pop((generation, epoch), None)

    def fail(self, error: GradsyncError) -> None:
        """The job broke: nobody will send the missing figures."""
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: the waiter may have gone
        self._waiters.clear()
