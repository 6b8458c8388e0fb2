"""An alpha-beta(-gamma) cost model of the allreduce algorithms, to pick one per collective.

A step costs alpha (latency: one message's fixed cost) plus beta per byte on the
busiest link of that step (each daemon's NIC sends and receives at once, so a
step lasts as long as the daemon that sends or receives the most), plus gamma per
byte the busiest daemon reduces.  With M daemons, n bytes, L = ⌊log2 M⌋,
p = 2^L and C pipeline chunks per half for the tree:

* ring: 2(M-1)·alpha + 2(M-1)/M·n·beta + (M-1)/M·n·gamma
* rhd:  2L·alpha + 2(p-1)/p·n·beta + (p-1)/p·n·gamma when M = p; otherwise two
  fold steps more, where the partners take a whole buffer in and send it back:
  + 2·alpha + 2n·beta + n·gamma (so 2⌈log2 M⌉ steps in all)
* tree: (C + 2L - 1)·alpha + (C + K)·n/(2C)·(w·beta + r·gamma): C + 2L - 1 steps.  In
  steady state the busiest daemon (interior with two children in one tree, a
  leaf in the other) sends and receives w = 4 chunks of n/(2C) per step (w = M
  for M < 4) and reduces r = 2 of them (r = 1 for M = 2); the C - 1 full steps
  plus 2L - 1 fill and drain steps at about half load come to C + K full steps,
  K = max(0, L - 1.5).  Within 25 % of the lockstep cost of the schedule as
  built (exact in the limit of many chunks).  C defaults to the best count,
  √(K·n·(w·beta + r·gamma)/(2·alpha)).
* star: 2·alpha + 2(M-1)·n·beta + (M-1)·n·gamma: the root receives and reduces every
  buffer, then sends the result to everyone.

In this model `star` (two steps) wins while latency dominates, `rhd` beats ring
and tree whenever M is a power of two, and `tree` earns its place for other M,
where the fold costs rhd 2n·beta more and ring pays 2(M-1)·alpha.
`schedule_estimate_s` evaluates the same model on concrete schedules, which is
how the tests hold these formulas to the algorithms as built.

`choose` does not chase modelled gains smaller than the model's own error:
among the candidates whose estimate is within `PREFERENCE_MARGIN` (10 %) of
the lowest it takes the one that what the model leaves out favours.

* Bandwidth-bound (the lowest estimate mostly beta and gamma): the first in
  the order given (ring, rhd, tree, star).  Ring keeps one TCP connection per
  direction busy for the whole collective, while rhd and tree switch partners
  at every step, so flows from two senders meet at one receiver.  On links
  capped at 2 Gbit/s (benchmarks/RESULTS.md, shaped namespaces, M = 4) rhd
  measured 13 to 21 % slower than ring from 16 MiB although both are
  modelled equal there; on the CPU-bound runs the two measure alike.
* Latency-bound (alpha is at least `LATENCY_BOUND_SHARE` of the lowest
  estimate): the one with the fewest steps.  A step costs more than alpha
  when every daemon handles a message at once on busy cores: at M = 4 on two
  shared cores ring and rhd steps measured 0.35 to 0.6 ms at 4 and 64 KiB
  against probe round trips of 0.2 to 0.4 ms, while star (two steps) was the
  fastest algorithm there at every placement, also where the model put rhd
  within 1 % of it.

Every daemon must reach the same choice: feed `choose` the same inputs on all
of them (for example, measurements agreed when the peers connect).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gradsync.daemon.algorithms.schedule import Schedule
from gradsync.protocol.peer import ALGORITHM_NAMES

#: Estimates within this fraction of the lowest are ties for `choose`.
PREFERENCE_MARGIN = 0.10
#: A collective is latency-bound when alpha makes up this much of its lowest estimate.
LATENCY_BOUND_SHARE = 0.5
#: Upper bound on the tree's pipeline chunks per half chosen by the model.
MAX_MODEL_TREE_CHUNKS = 256


def _check(daemons: int, nbytes: float) -> None:
    if daemons < 1:
        raise ValueError(f"daemons must be at least 1, got {daemons}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be non-negative, got {nbytes}")


def ring_estimate_s(daemons: int, nbytes: float, alpha: float, beta: float, gamma: float) -> float:
    """2(M-1)·alpha + 2(M-1)/M·n·beta + (M-1)/M·n·gamma."""
    m = daemons
    return 2 * (m - 1) * alpha + (m - 1) / m * nbytes * (2 * beta + gamma)


def rhd_estimate_s(daemons: int, nbytes: float, alpha: float, beta: float, gamma: float) -> float:
    """2L·alpha + (p-1)/p·n·(2·beta + gamma); the fold adds 2·alpha + n·(2·beta + gamma)."""
    if daemons == 1:
        return 0.0
    levels = daemons.bit_length() - 1
    p = 1 << levels
    cost = 2 * levels * alpha + (p - 1) / p * nbytes * (2 * beta + gamma)
    if daemons != p:
        cost += 2 * alpha + nbytes * (2 * beta + gamma)
    return cost


def _tree_shape(daemons: int) -> tuple[int, float, int, int]:
    """L, the fill/drain excess K = max(0, L - 1.5), chunks sent w and reduced r per step."""
    levels = daemons.bit_length() - 1
    return levels, max(0.0, levels - 1.5), min(daemons, 4), min(daemons - 1, 2)


def tree_estimate_s(
    daemons: int, nbytes: float, alpha: float, beta: float, gamma: float, chunks: int
) -> float:
    """(C + 2L - 1)·alpha + (C + K)·n/(2C)·(w·beta + r·gamma), for C = `chunks` chunks per half."""
    if daemons == 1:
        return 0.0
    levels, excess, sends, reduces = _tree_shape(daemons)
    chunk = nbytes / (2 * chunks)
    steps = chunks + 2 * levels - 1
    return steps * alpha + (chunks + excess) * chunk * (sends * beta + reduces * gamma)


def best_tree_chunks(
    daemons: int,
    nbytes: float,
    alpha_s: float,
    beta_s_per_byte: float,
    gamma_s_per_byte: float = 0.0,
) -> int:
    """The chunk count minimising `tree_estimate_s`, in [1, 256].

    The real optimum is √(K·n·(w·beta + r·gamma)/(2·alpha)).
    More chunks shorten the pipeline's fill and drain but each costs one more alpha.
    Pass the result to `tree(..., chunks=...)`, the same on every daemon.
    """
    _check(daemons, nbytes)
    if daemons == 1:
        return 1
    _, excess, sends, reduces = _tree_shape(daemons)
    per_byte = sends * beta_s_per_byte + reduces * gamma_s_per_byte
    if excess == 0 or nbytes == 0 or per_byte == 0:
        return 1
    if alpha_s <= 0:
        return MAX_MODEL_TREE_CHUNKS
    ideal = math.sqrt(excess * nbytes * per_byte / (2 * alpha_s))
    # The estimate is convex in C: the best integer is next to the real optimum.
    around = {max(1, min(MAX_MODEL_TREE_CHUNKS, c)) for c in (math.floor(ideal), math.ceil(ideal))}
    return min(
        sorted(around),
        key=lambda c: tree_estimate_s(
            daemons, nbytes, alpha_s, beta_s_per_byte, gamma_s_per_byte, c
        ),
    )


def steps(algorithm: str, daemons: int, tree_chunks: int = 1) -> int:
    """How many alphas `estimate_s` charges `algorithm` (the tree cut into
    `tree_chunks` chunks per half): its steps in the model."""
    _check(daemons, 0)
    if algorithm not in ALGORITHM_NAMES:
        return _unknown(algorithm)
    if daemons == 1:
        return 0
    levels = daemons.bit_length() - 1
    return {
        "ring": 2 * (daemons - 1),
        "rhd": 2 * levels + (0 if daemons == 1 << levels else 2),
        "tree": tree_chunks + 2 * levels - 1,
        "star": 2,
    }[algorithm]


def _unknown(algorithm: str) -> int:
    raise ValueError(
        f"unknown algorithm {algorithm!r}; expected one of: {', '.join(ALGORITHM_NAMES)}"
    )


def estimate_s(
    algorithm: str,
    daemons: int,
    nbytes: float,
    alpha_s: float,
    beta_s_per_byte: float,
    gamma_s_per_byte: float = 0.0,
    *,
    chunks: int | None = None,
) -> float:
    """Modelled seconds for `algorithm` to allreduce `nbytes` over `daemons` daemons.

    `chunks` applies to "tree" only; by default the best one (`best_tree_chunks`).
    """
    _check(daemons, nbytes)
    a, b, g = alpha_s, beta_s_per_byte, gamma_s_per_byte
    if algorithm == "ring":
        return ring_estimate_s(daemons, nbytes, a, b, g)
    if algorithm == "rhd":
        return rhd_estimate_s(daemons, nbytes, a, b, g)
    if algorithm == "tree":
        if chunks is None:
            chunks = best_tree_chunks(daemons, nbytes, a, b, g)
        return tree_estimate_s(daemons, nbytes, a, b, g, chunks)
    if algorithm == "star":
        return 0.0 if daemons == 1 else 2 * a + (daemons - 1) * nbytes * (2 * b + g)
    return _unknown(algorithm)


def choose(
    daemons: int,
    nbytes: float,
    alpha_s: float,
    beta_s_per_byte: float,
    gamma_s_per_byte: float = 0.0,
    candidates: Sequence[str] = ALGORITHM_NAMES,
    margin: float = PREFERENCE_MARGIN,
) -> tuple[str, dict[str, float]]:
    """The candidate to run, and every candidate's estimate.

    Among the candidates modelled within `margin` of the lowest estimate: the
    first in `candidates` order, or, when the lowest estimate is latency-bound
    (see the module's docstring), the one with the fewest steps (the earlier
    one on equal steps).  With `margin` 0 that is the argmin; either way the
    choice is deterministic.
    """
    if not candidates:
        raise ValueError("no candidate algorithms")
    if not margin >= 0:
        raise ValueError(f"margin must be non-negative, got {margin!r}")
    estimates = {
        name: estimate_s(name, daemons, nbytes, alpha_s, beta_s_per_byte, gamma_s_per_byte)
        for name in candidates
    }
    lowest = min(estimates.values())
    near = [name for name in candidates if estimates[name] <= lowest * (1 + margin)]
    chunks = best_tree_chunks(daemons, nbytes, alpha_s, beta_s_per_byte, gamma_s_per_byte)
    fastest = min(candidates, key=estimates.__getitem__)
    if lowest > 0 and alpha_s * steps(fastest, daemons, chunks) >= LATENCY_BOUND_SHARE * lowest:
        return min(near, key=lambda name: steps(name, daemons, chunks)), estimates
    return near[0], estimates


def schedule_estimate_s(
    schedules: Sequence[Schedule],
    itemsize: int,
    alpha_s: float,
    beta_s_per_byte: float,
    gamma_s_per_byte: float = 0.0,
) -> float:
    """The same model evaluated on concrete schedules (one per daemon, in lockstep).

    Each step with any transfer costs alpha, plus beta times the most bytes any daemon
    sends or receives in it, plus gamma times the most bytes any daemon reduces.
    """
    total = 0.0
    for number in range(len(schedules[0].steps) if schedules else 0):
        link = reduced = 0
        busy = False
        for schedule in schedules:
            step = schedule.steps[number]
            busy = busy or not step.is_empty
            sent = sum(send.count for send in step.sends)
            received = sum(recv.count for recv in step.recvs)
            link = max(link, sent, received)
            reduced = max(reduced, sum(recv.count for recv in step.recvs if recv.reduce))
        if busy:
            total += alpha_s + itemsize * (link * beta_s_per_byte + reduced * gamma_s_per_byte)
    return total
