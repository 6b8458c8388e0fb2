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
while no group is small enough to read it off.  Pure bookkeeping: the
caller decides whose figures a job uses (see `cost_epochs.py`).
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
        if not points or prior.beta_s_per_byte <= 0:  # no usable prior for beta
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
    bytes take a fair share of the step (else noise in tau decides it).  With
    no group small enough to read alpha off, alpha stays at the prior's.
    """
    steps = [(t / a, b / a) for a, b, t in points if a > 0]
    if not steps:
        return prior
    floor = max(min(s for _, s in steps), MIN_STEP_BYTES)
    if floor <= MAX_LATENCY_STEP_BYTES:
        alpha = _median([tau for tau, s in steps if s <= 2 * floor])
        separation = SEPARATION
    else:  # only large buffers ran: alpha as before, every group may speak for beta
        alpha, separation = prior.alpha_s, 1.0
    beta = prior.beta_s_per_byte
    readings = [(tau - alpha) / s for tau, s in steps
                if s >= separation * floor and tau - alpha >= BYTES_SHARE * tau]
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

