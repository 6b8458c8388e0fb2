"""The `auto` policy: which allreduce algorithm a job over M daemons runs.

The α-β cost model (algorithms/cost_model.py) prices each candidate with the
formation's link figures; calibration.py lets measured timings decide close
calls.  Pure functions, remembered: a job asks the same question every step.
"""

from __future__ import annotations

import functools

from gradsync.daemon.algorithms.cost_model import choose, estimate_s

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
