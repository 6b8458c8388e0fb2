"""Link costs fitted to the collectives a daemon ran, for `auto`'s cost model.

The probes taken when links come up measure one link alone, often while
every daemon is starting and probing at once: on two shared cores they read
round trips from 0.2 to 25 ms where a step of a real collective takes about
0.5 ms, and a single link's rate where every link of a step is busy at once.
The model then priced a 16 MiB allreduce over four daemons as latency-bound
and ran rhd, 12 % slower than ring (benchmarks/RESULTS.md).

Each finished allreduce gives one equation in the model's own terms: it took
`seconds` where the model charges `a` alphas and `b` bytes at beta (`a` and
`b` are the model's estimate at alpha 1, beta 0 and at alpha 0, beta 1).
`CostMeter.fit` takes one point per (algorithm, size) group, that group's
median (robust to the odd collective that waited for a late rank; a low
quantile would pick the runs where this daemon started last and found its
first slices already there, and price steps too cheap), reads alpha off the
groups with the fewest bytes per step and beta off those with many times
more (medians); beta stays at the prior (what the members agreed last,
at first the probes) while no group has enough bytes to show, and alpha
while no group is small enough to read it off.

The model cannot see everything: on links shaped by a token bucket a 64 KiB
burst is nearly free, so star beat the rhd the model chose by 1.3x; at step
boundaries rhd and tree converge two senders on one link, which ring never
does.  So `CostMeter.timings` also keeps every algorithm's median time per
size, and `measured_pick` lets those decide between the algorithms the model
prices close to its best, measuring each of them first.  Pure bookkeeping:
the caller decides whose figures and timings a job uses (see `cost_epochs.py`).
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

#: Collectives remembered per daemon count.
SAMPLES_KEPT = 512
#: Collectives a (algorithm, size) group needs before it counts.
MIN_GROUP_SAMPLES = 3
#: Per-step bytes below which groups count as equally small (float32 rounding).
MIN_STEP_BYTES = 1024.0
#: Without a group of at most this many bytes per step, alpha cannot be read off
#: and stays at the prior.
MAX_LATENCY_STEP_BYTES = 64 * 1024.0
#: A group speaks for beta when it moves this many times the smallest group's
#: bytes per step.
SEPARATION = 8.0
#: ... and when its step time exceeds alpha by at least this share of it.
BYTES_SHARE = 0.25
#: A group's time counts as latency when its bytes make up at most this share.
LATENCY_SHARE = 0.2
#: Fitted beta never goes below this (1 TB/s): a link is never free.
MIN_BETA_S_PER_BYTE = 1e-12
#: Among the algorithms `measured_pick` timed, another replaces the model's
#: choice when it measured this much faster (closer is noise: per-op spreads
#: are about 20 %, medians move less).
MEASURED_MARGIN = 0.05

#: A (algorithm, buffer bytes) group of timings.
Group = tuple[str, int]
#: A stored sample: its group, the model's (alphas, bytes at beta) or None when
#: it only times the algorithm, and the seconds it took.
_Sample = tuple[Group, tuple[float, float] | None, float]


class Costs(NamedTuple):
    """Model inputs: seconds per step (alpha) and per byte (beta)."""

    alpha_s: float
    beta_s_per_byte: float


class CostMeter:
    """Timings of finished collectives, per daemon count, and the figures they imply."""

    def __init__(self, kept: int = SAMPLES_KEPT) -> None:
        self._kept = kept
        self._samples: dict[int, collections.deque[_Sample]] = {}

    def record(
        self, daemons: int, group: Group, seconds: float,
        terms: tuple[float, float] | None = None,
    ) -> None:
        """One collective over `daemons` daemons took `seconds`; with `terms`
        (a, b) the model charges it a·alpha + b·beta and it calibrates the fit."""
        if not seconds > 0:
            return
        if terms is not None:
            a, b = terms
            if a < 0 or b < 0 or (a == 0 and b == 0):
                terms = None
        window = self._samples.setdefault(daemons, collections.deque(maxlen=self._kept))
        window.append((group, terms, seconds))

    def samples(self, daemons: int) -> int:
        return len(self._samples.get(daemons, ()))

    def fit(self, daemons: int, prior: Costs) -> Costs | None:
        """Alpha and beta the recorded collectives imply (`_split_fit`), `prior`
        where they cannot tell; None before any group has `MIN_GROUP_SAMPLES`."""
        points = _group_points(self._samples.get(daemons, ()))
        if not points or prior.beta_s_per_byte <= 0:  # no usable prior for beta
            return None
        return _split_fit(points, prior)

    def timings(self, daemons: int) -> dict[Group, float]:
        """Median seconds per group with `MIN_GROUP_SAMPLES`, every algorithm's."""
        groups: dict[Group, list[float]] = {}
        for group, _, seconds in self._samples.get(daemons, ()):
            groups.setdefault(group, []).append(seconds)
        return {group: _middle(times) for group, times in groups.items()
                if len(times) >= MIN_GROUP_SAMPLES}


def measured_pick(
    choice: str, estimates: Sequence[tuple[str, float]], nbytes: int,
    times: Mapping[Group, float], factor: float, explore: bool = True,
) -> tuple[str, str]:
    """`auto`'s pick once the members agreed on timings: (algorithm, basis).

    `choice` is the model's pick among `estimates`.  The contenders are the
    algorithms priced within `factor` of the lowest estimate (the daemon's
    `auto_explore_factor`, which the caller skips this for at 1).  With
    `explore`, while one has no agreed timing at `nbytes` it runs (the model's
    choice first, then by estimate; basis "explored").  Among the timed ones
    the model's choice stands unless another measured `MEASURED_MARGIN` faster
    ("measured"); an untimed choice stands on the model alone ("model").
    Every member computes this from the same agreed inputs, so all pick alike.
    """
    lowest = min(estimate for _, estimate in estimates)
    contenders = sorted((name != choice, estimate, name) for name, estimate in estimates
                        if estimate <= factor * lowest or name == choice)
    timed = [(times[(name, nbytes)], estimate, name) for _, estimate, name in contenders
             if (name, nbytes) in times]
    if explore and len(timed) < len(contenders):
        return next(name for _, _, name in contenders if (name, nbytes) not in times), "explored"
    if (choice, nbytes) not in times:
        return choice, "model"
    fastest_s, _, fastest = min(timed)
    if fastest_s * (1 + MEASURED_MARGIN) <= times[(choice, nbytes)]:
        return fastest, "measured"
    return choice, "measured"


def _group_points(samples: Iterable[_Sample]) -> list[tuple[float, float, float]]:
    """(a, b, median seconds) per calibrating group with enough samples."""
    groups: dict[Group, tuple[float, float, list[float]]] = {}
    for group, terms, seconds in samples:
        if terms is not None:
            entry = groups.setdefault(group, (*terms, []))
            entry[2].append(seconds)
    return [(a, b, _middle(times)) for a, b, times in groups.values()
            if len(times) >= MIN_GROUP_SAMPLES]


def _middle(values: list[float]) -> float:
    """The middle value (of an even count, the upper of the two middle ones): a
    time some collective actually took."""
    return sorted(values)[len(values) // 2]


def _split_fit(points: list[tuple[float, float, float]], prior: Costs) -> Costs:
    """Alpha from the groups with the fewest bytes per step, beta from those with
    many times more whose bytes show; the prior's beta when none does.

    Per step, a group takes tau = t / a = alpha + s·beta for s = b / a bytes.
    Fitting alpha and beta to every group at once let the model's small errors
    set beta: ring and rhd at 4 KiB differ only in step count, rhd's steps
    measured a little dearer than ring's, and a joint fit read that as a link
    of 40 MB/s.  Only groups far apart in s can tell beta, and only where their
    bytes take a fair share of the step (else noise in tau decides it).  With
    no group small enough to read alpha off, alpha stays at the prior's.
    """
    steps = [(t / a, b / a) for a, b, t in points if a > 0]
    if not steps:
        return prior
    floor = max(min(s for _, s in steps), MIN_STEP_BYTES)
    if floor <= MAX_LATENCY_STEP_BYTES:
        alpha = statistics.median([tau for tau, s in steps if s <= 2 * floor])
        separation = SEPARATION
    else:  # only large buffers ran: alpha as before, every group may speak for beta
        alpha, separation = prior.alpha_s, 1.0
    beta = prior.beta_s_per_byte
    readings = [(tau - alpha) / s for tau, s in steps
                if s >= separation * floor and tau - alpha >= BYTES_SHARE * tau]
    if readings:
        beta = max(statistics.median(readings), MIN_BETA_S_PER_BYTE)
    # Alpha once more, from every group whose bytes are a small share of its time.
    latency = [tau - s * beta for tau, s in steps if s * beta <= LATENCY_SHARE * tau]
    if latency:
        alpha = max(0.0, statistics.median(latency))
    return Costs(alpha, beta)
