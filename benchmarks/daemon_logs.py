"""What the daemons' logs say about a multi-daemon run: the link probes and `auto`'s picks.

Every daemon logs (level info), when a peer link comes up, "link to PEER: rtt
X µs, Y MB/s": the inputs of the cost model that `auto` uses.  Each daemon
announces the median over its links (alpha = rtt / 2, beta = 1 / rate;
`LinksTransport.link_costs`) and a job takes the median over its daemons
(`membership.form`), so the picks follow from the logs (`infer_picks`), with
the daemon's own cost model and candidates (star too, up to 8 daemons).

At `--log-level debug` a daemon also logs, per collective that asked for
`auto`, "auto picked ALGO for N bytes over M daemons; estimates {...}"
(`parse_picks`).  That costs about 0.1 ms per collective here (Python logging
in the daemon's event loop), enough to make `auto` look 10 % slower than the
algorithm it picked at small sizes, so the timed daemons run at info level and
a separate, untimed cluster at debug level checks that the inference matches
what daemons log.  `crossovers` sweeps the model over sizes to find where its
choice changes.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import statistics
from collections.abc import Iterable, Sequence

_PICK = re.compile(
    r"auto picked (?P<algo>\w+) for (?P<nbytes>\d+) bytes over (?P<daemons>\d+) daemons; "
    r"estimates (?P<estimates>\{.*\})"
)
_ESTIMATE = re.compile(r"'(\w+)': '(\d+)us'")
_LINK = re.compile(r"link to (?P<peer>\S+): rtt (?P<rtt>[\d.]+) µs, (?P<mbps>[\d.]+) MB/s")
#: What `auto` always chooses among (gradsync.daemon.cluster.AUTO_CANDIDATES).
AUTO_CANDIDATES = ("ring", "rhd", "tree")
#: Up to this many daemons star is a candidate too (gradsync.daemon.cluster).
STAR_MAX_DAEMONS = 8


def auto_candidates(daemons: int) -> tuple[str, ...]:
    """What `auto` chooses among for a job over this many daemons."""
    return AUTO_CANDIDATES + (("star",) if daemons <= STAR_MAX_DAEMONS else ())


@dataclasses.dataclass
class AutoPicks:
    """Per size: how often each algorithm was picked, and the logged estimates (µs)."""

    picks: dict[int, collections.Counter[str]] = dataclasses.field(default_factory=dict)
    estimates_us: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    daemons: int = 0

    def picked(self, nbytes: int) -> str | None:
        """The algorithm picked at this size ("ring"), "ring/rhd" if daemons or ops
        disagreed, None if `auto` never ran at it."""
        counter = self.picks.get(nbytes)
        if not counter:
            return None
        return "/".join(name for name, _ in counter.most_common())


@dataclasses.dataclass(frozen=True)
class LinkProbe:
    daemon: int
    peer: str
    rtt_us: float
    mb_per_s: float


def parse_picks(logs: Iterable[str]) -> AutoPicks:
    result = AutoPicks()
    for text in logs:
        for match in _PICK.finditer(text):
            nbytes = int(match.group("nbytes"))
            result.daemons = int(match.group("daemons"))
            result.picks.setdefault(nbytes, collections.Counter())[match.group("algo")] += 1
            result.estimates_us.setdefault(nbytes, {
                name: float(us) for name, us in _ESTIMATE.findall(match.group("estimates"))
            })
    return result


def parse_links(logs: Sequence[str]) -> list[LinkProbe]:
    return [
        LinkProbe(index, m.group("peer"), float(m.group("rtt")), float(m.group("mbps")))
        for index, text in enumerate(logs)
        for m in _LINK.finditer(text)
    ]


def link_costs(links: Sequence[LinkProbe]) -> tuple[float, float] | None:
    """(alpha s, beta s/byte) of a job over these daemons, as the daemons derive them:
    each daemon's median over its links, then the median over daemons.

    Assumes every daemon had measured all its links when its ranks joined
    (else it announced defaults, 50 µs and 1 GB/s).
    """
    if not links:
        return None
    by_daemon: dict[int, list[LinkProbe]] = collections.defaultdict(list)
    for link in links:
        by_daemon[link.daemon].append(link)
    alphas = [statistics.median(p.rtt_us for p in probes) * 1e-6 / 2
              for probes in by_daemon.values()]
    betas = [statistics.median(1.0 / max(p.mb_per_s * 1e6, 1.0) for p in probes)
             for probes in by_daemon.values()]
    return statistics.median(alphas), statistics.median(betas)


def infer_picks(daemons: int, sizes: Iterable[int], links: Sequence[LinkProbe]) -> AutoPicks:
    """What `auto` picks at each size, from the link probes and the daemon's cost model."""
    result = AutoPicks(daemons=daemons)
    costs = link_costs(links)
    if costs is None:
        return result
    try:
        from gradsync.daemon.algorithms.cost_model import choose
    except ImportError:
        return result
    for nbytes in sizes:
        best, estimates = choose(daemons, nbytes, costs[0], costs[1],
                                 candidates=auto_candidates(daemons))
        result.picks[nbytes] = collections.Counter({best: 1})
        result.estimates_us[nbytes] = {name: value * 1e6 for name, value in estimates.items()}
    return result


def solve_alpha_beta(picks: AutoPicks) -> tuple[float, float] | None:
    """(alpha s, beta s/byte) the daemons used, from the logged ring estimates.

    ring = 2(M-1)·alpha + 2(M-1)/M·n·beta (gamma is 0 in the daemon); least
    squares over every logged size, so the µs rounding of the log hardly matters.
    """
    m = picks.daemons
    points = [(n, est["ring"] * 1e-6) for n, est in picks.estimates_us.items() if "ring" in est]
    if m < 2 or len({n for n, _ in points}) < 2:
        return None
    xs = [2 * (m - 1) / m * n for n, _ in points]
    ys = [y for _, y in points]
    count = len(points)
    mean_x, mean_y = sum(xs) / count, sum(ys) / count
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        return None
    beta = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    alpha = (mean_y - beta * mean_x) / (2 * (m - 1))
    return max(alpha, 0.0), max(beta, 0.0)


def model_choice(daemons: int, nbytes: int, alpha: float, beta: float) -> str | None:
    """What the daemon's cost model picks (None if gradsync is not importable here)."""
    try:
        from gradsync.daemon.algorithms.cost_model import choose
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
