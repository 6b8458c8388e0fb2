"""What the daemons say about a multi-daemon run: their link probes and `auto`'s picks.

Every daemon logs (level info), when a peer link comes up, "link to PEER: rtt
X µs, Y MB/s" (`parse_links`): the probes a job's first `auto` collectives are
priced from.  Those first figures, and later epochs' figures fitted to the
collectives the daemons ran (daemon/cost_epochs.py), and the picks made with
them, are read from each daemon's statistics (`picks_from_stats`: the figures
the job formed with, and per size how often `auto` picked each algorithm, on
which basis, and the alpha and beta it priced that size with last).  Reading
them costs the timed collectives nothing, unlike the debug log of every pick.
`crossovers` sweeps the model over sizes to find where its choice changes.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Sequence
from typing import Any

_LINK = re.compile(r"link to (?P<peer>\S+): rtt (?P<rtt>[\d.]+) µs, (?P<mbps>[\d.]+) MB/s")


@dataclasses.dataclass
class AutoPicks:
    """Per size: how often each algorithm was picked, what auto settled on, and
    the model's estimates (µs)."""

    picks: dict[int, collections.Counter[str]] = dataclasses.field(default_factory=dict)
    #: Each daemon's latest pick and its basis ("model", "explored", "measured").
    last: dict[int, set[tuple[str, str]]] = dataclasses.field(default_factory=dict)
    estimates_us: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    #: The (alpha s, beta s/byte) each size was last priced with.
    costs: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)
    #: The (alpha s, beta s/byte) the job formed with (its first epoch's figures).
    formed: tuple[float, float] | None = None
    daemons: int = 0

    def picked(self, nbytes: int) -> str | None:
        """The algorithm auto settled on at this size ("ring"), "ring/rhd" if the
        daemons' latest picks differ, None if `auto` never ran at it."""
        latest = self.last.get(nbytes)
        if not latest:
            return None
        return "/".join(sorted({name for name, _ in latest}))

    def label(self, nbytes: int) -> str | None:
        """`picked` with its basis and what else auto ran at this size, e.g.
        "star (measured; also ran tree, rhd)"."""
        picked = self.picked(nbytes)
        if picked is None:
            return None
        basis = "/".join(sorted({basis for _, basis in self.last[nbytes]}))
        others = [name for name, _ in self.picks.get(nbytes, collections.Counter()).most_common()
                  if name not in picked.split("/")]
        return f"{picked} ({basis}{'; also ran ' + ', '.join(others) if others else ''})"


@dataclasses.dataclass(frozen=True)
class LinkProbe:
    daemon: int
    peer: str
    rtt_us: float
    mb_per_s: float


def parse_links(logs: Sequence[str]) -> list[LinkProbe]:
    return [
        LinkProbe(index, m.group("peer"), float(m.group("rtt")), float(m.group("mbps")))
        for index, text in enumerate(logs)
        for m in _LINK.finditer(text)
    ]


def picks_from_stats(
    snapshots: Sequence[dict[str, Any]], job: str, daemons: int
) -> AutoPicks:
    """`auto`'s picks over the daemons' statistics snapshots, and the model's
    estimates at the figures each size was priced with (daemon 0's)."""
    result = AutoPicks(daemons=daemons)
    for snapshot in snapshots:
        job_entry = snapshot.get("jobs", {}).get(job, {})
        formed = job_entry.get("formed_costs")
        if formed and result.formed is None:
            result.formed = (formed["alpha_s"], formed["beta_s_per_byte"])
        for size, entry in (job_entry.get("auto") or {}).items():
            nbytes = int(size)
            result.picks.setdefault(nbytes, collections.Counter()).update(entry["picks"])
            if entry.get("last"):
                result.last.setdefault(nbytes, set()).add(
                    (entry["last"], entry.get("last_basis", "")))
            result.costs.setdefault(nbytes, (entry["alpha_s"], entry["beta_s_per_byte"]))
    try:
        from gradsync.daemon.algorithms.cost_model import estimate_s
        from gradsync.daemon.core.auto import auto_candidates
    except ImportError:
        return result
    for nbytes, (alpha, beta) in result.costs.items():
        result.estimates_us[nbytes] = {
            name: estimate_s(name, daemons, nbytes, alpha, beta) * 1e6
            for name in auto_candidates(daemons)
        }
    return result


def model_choice(daemons: int, nbytes: int, alpha: float, beta: float) -> str | None:
    """What the daemon's cost model picks (None if gradsync is not importable here)."""
    try:
        from gradsync.daemon.algorithms.cost_model import choose
        from gradsync.daemon.core.auto import auto_candidates
    except ImportError:
        return None
    best: str = choose(daemons, nbytes, alpha, beta, candidates=auto_candidates(daemons))[0]
    return best


def crossovers(
    daemons: int, alpha: float, beta: float, low: int = 4, high: int = 1 << 30
) -> list[tuple[int, str, str]]:
    """(first size in bytes, choice below, choice from there) wherever the model's
    choice changes between `low` and `high` (float32 sizes, found to 4 bytes)."""
    if model_choice(daemons, low, alpha, beta) is None:
        return []
    changes = []
    size = low
    current = model_choice(daemons, size, alpha, beta)
    while size < high:
        upper = min(size * 2, high)
        choice = model_choice(daemons, upper, alpha, beta)
        if choice != current:
            lo, hi = size, upper  # choice(lo) == current != choice(hi)
            while hi - lo > 4:
                mid = (lo + hi) // 2 // 4 * 4
                if mid <= lo:
                    break
                if model_choice(daemons, mid, alpha, beta) == current:
                    lo = mid
                else:
                    hi = mid
            assert current is not None and choice is not None
            changes.append((hi, current, choice))
            current = choice
        size = upper
    return changes
