"""The `auto` policy: which allreduce algorithm a job over M daemons runs.

Read top to bottom, `AutoPolicy` (one per multi-node job) is the whole story:

1. **Inputs.**  The size of the allreduce; the link figures (alpha, beta) the
   members agreed: at first the medians of the probes they announced when the
   job formed, then per epoch of `EPOCH_KEYS` keys the medians of the figures
   each member fitted to its own timings (`offer`, cost_epochs.py); and the
   median time the members measured per (algorithm, size).
2. **Decision** (`choose`).  The α-β cost model (algorithms/cost_model.py)
   prices each candidate with the agreed figures and the cheapest wins; where
   the model prices others close to it, measured times decide, and keys in the
   first half of an epoch may time an untried one (calibration.measured_pick).
   Every member computes the same inputs, so every member picks the same.
3. **Record.**  Each pick is counted in the job's statistics (per size: the
   algorithm, its basis "model" or "measured"/"explored", the figures and
   epoch), which `gradsync stats`, Prometheus and traces show, and logged at
   debug level with the model's estimates.

The model and the fit are pure functions beside it (algorithms/); the
agreement's bookkeeping is cost_epochs.py; the runner (run/multi_node.py)
sends the offers and waits, within the collective's deadline, for an epoch's
agreement.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

from gradsync.daemon.algorithms import ALGORITHMS
from gradsync.daemon.algorithms.calibration import CostMeter, Costs, measured_pick
from gradsync.daemon.algorithms.cost_model import choose, estimate_s
from gradsync.daemon.core.cost_epochs import (
    Agreement,
    CostEpochs,
    Offer,
    epoch_of,
    epoch_to_offer,
    explores,
)

__all__ = ["AutoPolicy", "Decision", "auto_candidates", "auto_pick", "epoch_of",
           "epoch_to_offer", "model_terms", "wants_auto"]
from gradsync.daemon.core.membership import Formation
from gradsync.daemon.stats import StatsRecorder
from gradsync.protocol import peer as peer_wire
from gradsync.protocol.errors import InvalidArgumentError

log = logging.getLogger("gradsync.daemon.cluster")

#: Algorithms `auto` picks from.  Star, two steps whatever the size, wins small
#: buffers over a few daemons (measured: up to about 1 MiB at 4 daemons); its
#: root's per-message cost, which the model does not charge, rules it out beyond.
AUTO_CANDIDATES = ("ring", "rhd", "tree")
#: ... and star too, up to this many daemons.
STAR_MAX_DAEMONS = 8

#: Algorithms whose timings calibrate `auto`: those the model prices exactly as
#: built (tests/test_cost_model.py).  The model leaves out star's per-message
#: cost at the root and prices the tree within 25 %, so their timings would
#: bend the figures away from what the others cost.
CALIBRATING = frozenset({"ring", "rhd"})


def auto_candidates(daemons: int) -> tuple[str, ...]:
    """What `auto` chooses among for a job over this many daemons."""
    return AUTO_CANDIDATES + (("star",) if daemons <= STAR_MAX_DAEMONS else ())


@functools.lru_cache(maxsize=4096)
def auto_pick(
    daemons: int, nbytes: int, alpha_s: float, beta_s_per_byte: float
) -> tuple[str, tuple[tuple[str, float], ...]]:
    """`auto`'s choice and the estimates behind it; remembered, since a job asks
    the same question (its formation's figures, the same sizes) every collective."""
    best, estimates = choose(daemons, nbytes, alpha_s, beta_s_per_byte,
                             candidates=auto_candidates(daemons))
    return best, tuple(estimates.items())


@functools.lru_cache(maxsize=1024)
def model_terms(algorithm: str, daemons: int, nbytes: int) -> tuple[float, float]:
    """(alphas, bytes at beta) the cost model charges this allreduce."""
    return (estimate_s(algorithm, daemons, nbytes, 1.0, 0.0),
            estimate_s(algorithm, daemons, nbytes, 0.0, 1.0))


#: Timings (algorithm, size) a daemon offers per epoch at most: the groups of
#: its remembered collectives that first ran most recently.
MAX_TIMES_OFFERED = 64


@dataclasses.dataclass(frozen=True)
class Decision:
    """What a collective runs, and why: `basis` is "requested" (named by the
    call or the daemon's config), "model", "measured" or "explored"."""

    algorithm: str
    basis: str


def wants_auto(requested: str | None, default: str) -> bool:
    """Whether a collective asking for `requested` (None: the daemon's `default`)
    leaves the choice to `auto`."""
    return (requested or default) == "auto"


class AutoPolicy:
    """`auto` for one multi-node job: its inputs, decision and record (see above)."""

    def __init__(self) -> None:
        #: Each member's figures per (generation, epoch), and the agreements.
        self.epochs = CostEpochs()

    # -- inputs ---------------------------------------------------------------

    def offer(
        self, job_name: str, formation: Formation, epoch: int, endpoint: str,
        meter: CostMeter, explore_factor: float,
    ) -> peer_wire.Costs | None:
        """This daemon's figures for `epoch`, once per epoch (None: nothing to
        send).  They are recorded here as its own offer; the caller sends the
        message to every other member.  A daemon offers as it starts the key
        half an epoch before (`epoch_to_offer`), or when a collective of the
        epoch finds it has not."""
        daemons = formation.daemons
        if epoch < 1 or len(daemons) < 2 or not self.epochs.first_offer(formation.generation,
                                                                        epoch):
            return None
        # What the members agreed last is the best guess for what these timings
        # cannot tell (see CostMeter.fit), better than the start-up probes.
        prior = self.epochs.latest or Costs(formation.alpha_s, formation.beta_s_per_byte)
        own = meter.fit(len(daemons), prior) or prior
        times = dict(list(meter.timings(len(daemons)).items())[-MAX_TIMES_OFFERED:])
        self.epochs.add(formation.generation, epoch, endpoint,
                        Offer(own, times, explore_factor))
        self.epochs.notify(formation.generation, epoch, daemons)
        log.debug("job %r epoch %d: offering alpha %.0f us, beta %.3f ns/byte", job_name,
                  epoch, own.alpha_s * 1e6, own.beta_s_per_byte * 1e9)
        return peer_wire.Costs(job_name, formation.generation, epoch, own.alpha_s,
                               own.beta_s_per_byte, times, explore_factor)

    def heard(self, formation: Formation | None, member: str, message: peer_wire.Costs) -> None:
        """A member's offer for one epoch (before the job formed here, kept: the
        generation decides later)."""
        self.epochs.add(message.gen, message.epoch, member, Offer(
            Costs(message.alpha_s, message.beta_s_per_byte), message.times,
            message.explore_factor))
        if formation is not None:
            self.epochs.notify(message.gen, message.epoch, formation.daemons)

    def agreement(self, formation: Formation, key: int | str) -> Agreement | None:
        """The members' agreement for `key`'s epoch, if complete (None as well
        where none is needed: epoch 0, or a single daemon)."""
        epoch = epoch_of(key)
        if epoch < 1 or len(formation.daemons) < 2:
            return None
        return self.epochs.agreed(formation.generation, epoch, formation.daemons)

    @staticmethod
    def priced(formation: Formation, agreement: Agreement) -> Formation:
        """The formation re-priced with the agreed figures (made once per epoch)."""
        if agreement.priced is None:
            agreement.priced = dataclasses.replace(
                formation, alpha_s=agreement.costs.alpha_s,
                beta_s_per_byte=agreement.costs.beta_s_per_byte)
        return agreement.priced

    # -- decision and record --------------------------------------------------

    def choose(
        self, requested: str | None, default: str, formation: Formation, nbytes: int,
        key: int | str, stats: StatsRecorder | None = None, job_name: str = "",
    ) -> Decision:
        """The algorithm for an allreduce of `nbytes` with this `key`; `formation`
        carries the figures agreed for the key's epoch (see `priced`)."""
        name = requested or default
        if name != "auto":
            if name not in ALGORITHMS:
                raise InvalidArgumentError(
                    f"unknown algorithm {name!r}; expected auto or one of {', '.join(ALGORITHMS)}"
                )
            return Decision(name, "requested")
        epoch = epoch_of(key)
        agreement = self.agreement(formation, key)
        daemons = len(formation.daemons)
        best, estimates = auto_pick(daemons, nbytes, formation.alpha_s, formation.beta_s_per_byte)
        basis = "model"
        factor = agreement.explore_factor if agreement is not None else 1.0
        if agreement is not None and factor > 1:
            explore = explores(key)
            picked = agreement.picks.get((nbytes, explore))
            if picked is None:
                picked = agreement.picks[(nbytes, explore)] = measured_pick(
                    best, estimates, nbytes, agreement.times, factor, explore)
            best, basis = picked
        if stats is not None:
            stats.auto_picked(job_name, nbytes, best, basis,
                              Costs(formation.alpha_s, formation.beta_s_per_byte), epoch)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("auto picked %s (%s) for %d bytes over %d daemons; estimates %s", best,
                      basis, nbytes, daemons,
                      {k: f"{v * 1e6:.0f}us" for k, v in estimates})
        return Decision(best, basis)
