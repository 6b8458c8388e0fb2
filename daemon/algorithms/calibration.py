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
at first the probes) while no group has enough bytes to show.  Only when no
group is small enough to read alpha off does it solve for both by least
squares.  Pure bookkeeping: the caller decides whose figures a job uses (see
`cost_epochs.py`).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable
from typing import NamedTuple

#: Collectives remembered per daemon count.
SAMPLES_KEPT = 512
#: Collectives a (algorithm, size) group needs before it counts.
MIN_GROUP_SAMPLES = 3
#: Per-step bytes below which groups count as equally small (float32 rounding).
MIN_STEP_BYTES = 1024.0
#: Without a group of at most this many bytes per step, alpha cannot be read off
#: directly and both figures come from a least-squares fit.
MAX_LATENCY_STEP_BYTES = 64 * 1024.0
#: A group speaks for beta when it moves this many times the smallest group's
#: bytes per step.
SEPARATION = 8.0
#: ... and when its step time exceeds alpha by at least this share of it.
BYTES_SHARE = 0.25
#: A group's time counts as latency when its bytes make up at most this share.
LATENCY_SHARE = 0.2
#: Weight of the prior figures against one (algorithm, size) group: small, so
#: that it only settles what the timings cannot tell (see `_least_squares`).
PRIOR_WEIGHT = 1e-3
#: Fitted beta never goes below this (1 TB/s): a link is never free.
MIN_BETA_S_PER_BYTE = 1e-12


class Costs(NamedTuple):
    """Model inputs: seconds per step (alpha) and per byte (beta)."""

    alpha_s: float
    beta_s_per_byte: float


class CostMeter:
    """Timings of finished collectives, per daemon count, and the figures they imply."""

    def __init__(self, kept: int = SAMPLES_KEPT) -> None:
        self._kept = kept
        self._samples: dict[int, collections.deque[tuple[Hashable, float, float, float]]] = {}

    def record(self, daemons: int, group: Hashable, a: float, b: float, seconds: float) -> None:
        """One collective over `daemons` daemons, modelled as a·alpha + b·beta, took `seconds`."""
        if a < 0 or b < 0 or not seconds > 0 or (a == 0 and b == 0):
            return
        window = self._samples.setdefault(daemons, collections.deque(maxlen=self._kept))
        window.append((group, a, b, seconds))

    def samples(self, daemons: int) -> int:
        return len(self._samples.get(daemons, ()))

    def fit(self, daemons: int, prior: Costs) -> Costs | None:
        """Alpha and beta the recorded collectives imply (`_split_fit`), `prior`
        where they cannot tell; None before any group has `MIN_GROUP_SAMPLES`."""
        points = _group_points(self._samples.get(daemons, ()))
        if not points or prior.alpha_s <= 0 or prior.beta_s_per_byte <= 0:
            return None
        return _split_fit(points, prior)


def _group_points(
    samples: Iterable[tuple[Hashable, float, float, float]],
) -> list[tuple[float, float, float]]:
    """(a, b, median seconds) per group with enough samples."""
    groups: dict[Hashable, tuple[float, float, list[float]]] = {}
    for group, a, b, seconds in samples:
        entry = groups.setdefault(group, (a, b, []))
        entry[2].append(seconds)
    points = []
    for a, b, times in groups.values():
        if len(times) >= MIN_GROUP_SAMPLES:
            times.sort()
            points.append((a, b, times[len(times) // 2]))
    return points


def _split_fit(points: list[tuple[float, float, float]], prior: Costs) -> Costs:
    """Alpha from the groups with the fewest bytes per step, beta from those with
    many times more whose bytes show; the prior's beta when none does.

    Per step, a group takes tau = t / a = alpha + s·beta for s = b / a bytes.
    Fitting alpha and beta to every group at once let the model's small errors
    set beta: ring and rhd at 4 KiB differ only in step count, rhd's steps
    measured a little dearer than ring's, and a joint fit read that as a link
    of 40 MB/s.  Only groups far apart in s can tell beta, and only where their
    bytes take a fair share of the step (else noise in tau decides it).
    """
    steps = [(t / a, b / a) for a, b, t in points if a > 0]
    floor = max(min((s for _, s in steps), default=0.0), MIN_STEP_BYTES)
    if not steps or floor > MAX_LATENCY_STEP_BYTES:
        return _least_squares(points, prior)  # no latency-sized group to read alpha off
    alpha = _median([tau for tau, s in steps if s <= 2 * floor])
    beta = prior.beta_s_per_byte
    readings = [(tau - alpha) / s for tau, s in steps
                if s >= SEPARATION * floor and tau - alpha >= BYTES_SHARE * tau]
    if readings:
        beta = max(_median(readings), MIN_BETA_S_PER_BYTE)
    # Alpha once more, from every group whose bytes are a small share of its time.
    latency = [tau - s * beta for tau, s in steps if s * beta <= LATENCY_SHARE * tau]
    if latency:
        alpha = max(0.0, _median(latency))
    return Costs(alpha, beta)


def _median(values: list[float]) -> float:
    values = sorted(values)
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def _least_squares(points: list[tuple[float, float, float]], prior: Costs) -> Costs:
    """Minimise the sum of ((a·alpha + b·beta - t) / t)² plus `PRIOR_WEIGHT` times
    each figure's squared relative distance from `prior`, alpha and beta >= 0.

    The prior term decides only what the points leave open: beta when every
    group is small (their times are all latency), alpha when every group is
    large; with a single group, the split closest to the prior that still
    prices that group as measured.
    """
    # In units of the prior (x = alpha / prior alpha, y = beta / prior beta) each
    # point is a row (p, q) that should sum to 1, and the prior adds rows (w, 0), (0, w).
    rows = [(a * prior.alpha_s / t, b * prior.beta_s_per_byte / t) for a, b, t in points]
    weight = PRIOR_WEIGHT
    spp = sum(p * p for p, _ in rows) + weight
    sqq = sum(q * q for _, q in rows) + weight
    spq = sum(p * q for p, q in rows)
    sp = sum(p for p, _ in rows) + weight
    sq = sum(q for _, q in rows) + weight
    det = spp * sqq - spq * spq  # > 0: the prior rows make the system regular
    x = (sp * sqq - sq * spq) / det
    y = (sq * spp - sp * spq) / det
    if x < 0:  # all bandwidth: fit beta alone
        x, y = 0.0, sq / sqq
    elif y < 0:  # all latency: fit alpha alone
        x, y = sp / spp, 0.0
    return Costs(x * prior.alpha_s, max(y * prior.beta_s_per_byte, MIN_BETA_S_PER_BYTE))
