"""When a silent peer daemon is declared lost, and what it is declared: the decisions.

No sockets, no event loop, time from an injected clock: `peers/health.py`
feeds it what arrives and calls `tick()` every `ping_ivl_s`; tests drive it
with a fake clock.  The rules, and where they come from:

- **Adaptive silence (phi-accrual).**  Anything from a peer counts as a
  heartbeat (its pings, the answers to ours, control, data).  Silence is
  judged against the gaps observed between those arrivals: a peer is
  suspected once it has been silent for `suspect_s` or for the gap that the
  observed mean and spread make as unlikely as `phi` says (10^-phi under a
  normal law), whichever is longer.  Irregular arrivals (a saturated link, a
  starved CPU) earn a longer wait; the floor covers short pauses.
- **Indirect probes (SWIM).**  A suspect's silence is checked with up to
  `WITNESSES` other peers: each says how long ago it last heard the suspect
  (it pings every peer anyway).  A witness that heard it well after we did
  shows the node alive and the network between it and us cut: the verdict is
  `unreachable` (given `unreachable_extra_s` more, as the peer may yet come
  back), not `lost`.
- **Refutable suspicion (Lifeguard).**  Anything from the suspect ends the
  suspicion (`refuted`); the verdict needs `confirm_s` of suspicion and the
  witnesses' answers (or `confirm_s` of waiting for them).
- **Local health (Lifeguard).**  A tick that came late (this daemon did not
  run: a starved CPU, a pause) judges no one: what arrived meanwhile is read
  first (the next tick judges, late or not).  Twice the worst lateness of the
  last `LOCAL_HISTORY_S` is added to every wait, and a daemon that did not run
  for `stall_s` is told so (`Stalled`): its peers have declared it lost
  meanwhile (they also say so, where their words get through: peers/health.py).
- **An upper bound.**  A peer silent for `upper_s` (`peer_timeout_s`) is
  declared whatever the rest says.

`--failure-detector timeout` keeps the upper bound alone (`adaptive` false):
heartbeats once a second, no suspicion, no witnesses; a silent peer is declared
at `peer_timeout_s`, not sooner.  For those who want only a fixed timeout, and
to measure what the adaptive detector costs.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from collections.abc import Callable, Collection, Iterable
from typing import Literal

#: The fastest declaration with the default settings (suspicion + confirmation).
DECLARE_S = 2.0
#: Heartbeats go this often at most (every peer, its own path: peers/health.py).
PING_IVL_S = 0.1
#: Peers asked about a suspect.
WITNESSES = 3
#: Own lateness is remembered this long.
LOCAL_HISTORY_S = 10.0
#: Gaps between arrivals shorter than this part of the ping interval tell nothing
#: about pauses (data flowing) and are not kept.
_GAP_MIN_PART = 0.5

#: Comparisons of durations allow this much (the clock's sums are not exact).
_EPS = 1e-6

#: Heartbeats of the `timeout` detector go this often at most.
TIMEOUT_PING_IVL_S = 1.0

VerdictKind = Literal["lost", "unreachable"]
#: The detectors a daemon may run (`failure_detector`, `--failure-detector`).
DetectorKind = Literal["adaptive", "timeout"]
DETECTORS: tuple[DetectorKind, ...] = ("adaptive", "timeout")


@dataclasses.dataclass(frozen=True)
class DetectorTimings:
    """The detector's settings, all in seconds (derived from `peer_timeout_s`)."""

    ping_ivl_s: float = PING_IVL_S
    suspect_s: float = 0.75 * DECLARE_S
    confirm_s: float = 0.25 * DECLARE_S
    #: `peer_timeout_s`: a peer silent this long is declared, whatever else.
    upper_s: float = 10.0
    phi: float = 8.0
    #: The least spread assumed of the gaps (a perfectly regular peer is not
    #: suspected at the first late heartbeat).
    min_std_s: float = 0.05
    #: Gaps remembered per peer.
    window: int = 600
    #: False: the upper bound alone (`timeout`), no suspicion and no witnesses.
    adaptive: bool = True

    @classmethod
    def for_timeout(cls, peer_timeout_s: float,
                    detector: DetectorKind = "adaptive") -> DetectorTimings:
        """The default timings under the upper bound `peer_timeout_s` (scaled down
        when it is below `DECLARE_S`); for `detector="timeout"`, the bound alone,
        with heartbeats once a second (four per `peer_timeout_s` at least)."""
        if detector == "timeout":
            return cls(ping_ivl_s=min(TIMEOUT_PING_IVL_S, peer_timeout_s / 4),
                       suspect_s=peer_timeout_s, confirm_s=0.0, upper_s=peer_timeout_s,
                       adaptive=False)
        declare = min(DECLARE_S, peer_timeout_s)
        return cls(ping_ivl_s=min(PING_IVL_S, declare / 10), suspect_s=0.75 * declare,
                   confirm_s=0.25 * declare, upper_s=peer_timeout_s)

    @property
    def declare_s(self) -> float:
        """The least silence after which a peer is declared lost."""
        return self.suspect_s + self.confirm_s

    @property
    def unreachable_extra_s(self) -> float:
        """More silence allowed a peer that witnesses hear: it may come back."""
        return self.declare_s

    @property
    def stall_s(self) -> float:
        """This daemon not running this long has had its peers declare it."""
        return min(2 * self.declare_s, self.upper_s)

    @property
    def z(self) -> float:
        """Standard deviations above the mean gap that `phi` stands for."""
        return statistics.NormalDist().inv_cdf(1.0 - 10.0 ** -self.phi)


@dataclasses.dataclass(frozen=True)
class Ask:
    """`peer` is suspected: ask the `witnesses` when they last heard it."""

    peer: str
    witnesses: tuple[str, ...]
    silent_s: float
    first: bool  # the suspicion just began (not a repeated question)


@dataclasses.dataclass(frozen=True)
class Refuted:
    """`peer` spoke after `silent_s` of silence while suspected."""

    peer: str
    silent_s: float


@dataclasses.dataclass(frozen=True)
class Stalled:
    """This daemon did not run for `stalled_s` (its peers may have declared it)."""

    stalled_s: float


@dataclasses.dataclass(frozen=True)
class Verdict:
    """`peer` is declared: `lost` (no one hears it) or `unreachable` (a witness does)."""

    peer: str
    kind: VerdictKind
    silent_s: float
    #: Witnesses that heard it, with how long ago (seconds).
    vouched_by: tuple[tuple[str, float], ...]
    #: Witnesses that have not heard it either, with for how long (None: never).
    silent_to: tuple[tuple[str, float | None], ...]
    #: Declared at the upper bound (`peer_timeout_s`).
    bound: bool

    def describe(self, me: str) -> str:
        """Why, as a clause naming whom (for logs and errors)."""
        if self.kind == "unreachable":
            who, age = self.vouched_by[0]
            return (f"unreachable from {me} for {self.silent_s:.1f}s, though alive: {who} "
                    f"heard it {age:.1f}s ago; the network between {me} and {self.peer} is "
                    "cut, not the node")
        text = f"silent for {self.silent_s:.1f}s"
        if self.bound:
            text += " (the peer timeout)"
        if self.silent_to:
            text += "; not heard by " + ", ".join(
                f"{who} {'ever' if age is None else f'for {age:.1f}s'}"
                for who, age in self.silent_to) + " either"
        return text


Action = Ask | Refuted | Stalled | Verdict


class _Gaps:
    """The last `window` gaps between arrivals, with their running mean and spread."""

    def __init__(self, window: int) -> None:
        self._gaps: collections.deque[float] = collections.deque()
        self._window = window
        self._sum = 0.0
        self._sum_sq = 0.0

    def __len__(self) -> int:
        return len(self._gaps)

    def add(self, gap: float) -> None:
        self._gaps.append(gap)
        self._sum += gap
        self._sum_sq += gap * gap
        if len(self._gaps) > self._window:
            old = self._gaps.popleft()
            self._sum -= old
            self._sum_sq -= old * old

    def mean_std(self) -> tuple[float, float]:
        count = len(self._gaps)
        mean = self._sum / count
        return mean, math.sqrt(max(0.0, self._sum_sq / count - mean * mean))


@dataclasses.dataclass
class _Peer:
    """What is known of one peer whose link is up."""

    last_heard: float
    gaps: _Gaps
    suspected_at: float | None = None
    asked_at: float = 0.0
    #: Per witness asked: when it last heard the peer (our clock), None: never; a
    #: witness not in here has not answered.
    answers: dict[str, float | None] = dataclasses.field(default_factory=dict)
    asked: tuple[str, ...] = ()


@dataclasses.dataclass
class DetectorCounts:
    """How often, so far."""

    suspected: int = 0
    refuted: int = 0
    lost: int = 0
    unreachable: int = 0


class FailureDetector:
    """The failure detector of one daemon: every peer whose link is up."""

    def __init__(self, timings: DetectorTimings, clock: Callable[[], float]) -> None:
        self.timings = timings
        self._clock = clock
        self._z = timings.z
        self._peers: dict[str, _Peer] = {}
        self._last_tick = clock()
        #: (when, how late) of this daemon's own ticks.
        self._lags: collections.deque[tuple[float, float]] = collections.deque()
        self._refuted: list[Refuted] = []
        #: The peers sure to hear a given peer (its ring neighbours: core/watching.py),
        #: asked about it first; None: any peer watched here is as good.
        self.watchers: Callable[[str], Collection[str]] | None = None
        #: The last tick was late and judged no one.
        self._skipped = False
        self.counts = DetectorCounts()

    # -- what the links tell ------------------------------------------------------

    def watch(self, peer: str) -> None:
        """The link to `peer` came up: watch it from now."""
        self._peers[peer] = _Peer(self._clock(), _Gaps(self.timings.window))

    def forget(self, peer: str) -> None:
        """The link to `peer` is down: nothing to watch until it comes back."""
        self._peers.pop(peer, None)

    def heard(self, peer: str) -> None:
        """Something came from `peer`."""
        state = self._peers.get(peer)
        if state is None:
            return
        now = self._clock()
        gap = now - state.last_heard
        if gap >= _GAP_MIN_PART * self.timings.ping_ivl_s:
            state.gaps.add(gap)
        state.last_heard = now
        if state.suspected_at is not None:
            self.counts.refuted += 1
            self._refuted.append(Refuted(peer, gap))
            self._clear(state)

    def witness_said(self, peer: str, witness: str, heard_s: float | None) -> None:
        """`witness` last heard `peer` `heard_s` seconds ago (None: not at all)."""
        state = self._peers.get(peer)
        if state is None or state.suspected_at is None or witness not in state.asked:
            return
        state.answers[witness] = None if heard_s is None else self._clock() - heard_s

    # -- what it tells ---------------------------------------------------------------

    def heard_age(self, peer: str) -> float | None:
        """Seconds since `peer` was last heard (None: its link is not up)."""
        state = self._peers.get(peer)
        return None if state is None else self._clock() - state.last_heard

    def suspected(self, peer: str) -> bool:
        state = self._peers.get(peer)
        return state is not None and state.suspected_at is not None

    def suspicion(self, peer: str) -> Verdict | None:
        """What the verdict on `peer` would be now, if it is suspected (for an error
        that its link gives before the verdict: a data stream that broke)."""
        state = self._peers.get(peer)
        if state is None or state.suspected_at is None:
            return None
        return self._describe(peer, state, self._clock() - state.last_heard,
                              self._vouched(state), bound=False)

    def local_lag_s(self) -> float:
        """The worst lateness of this daemon's own ticks lately."""
        horizon = self._clock() - LOCAL_HISTORY_S
        while self._lags and self._lags[0][0] < horizon:
            self._lags.popleft()
        return max((lag for _, lag in self._lags), default=0.0)

    def suspect_after_s(self, peer: str) -> float | None:
        """The silence after which `peer` is suspected now (None: not watched)."""
        state = self._peers.get(peer)
        if state is None:
            return None
        return self._suspect_after(state, self.local_lag_s())

    def _suspect_after(self, state: _Peer, lag_s: float) -> float:
        timings = self.timings
        wait = timings.suspect_s
        if len(state.gaps) >= 2:
            mean, std = state.gaps.mean_std()
            wait = max(wait, mean + self._z * max(std, timings.min_std_s))
        # Own lateness: what we could not read in time is not the peer's silence.
        return min(wait + 2 * lag_s, timings.upper_s - timings.confirm_s)

    def tick(self) -> list[Action]:
        """Judge every peer; call every `ping_ivl_s`.  What to do, in order."""
        timings = self.timings
        now = self._clock()
        since = now - self._last_tick + _EPS
        self._last_tick = now
        late = max(0.0, since - timings.ping_ivl_s - 2 * _EPS)
        if late > 0:
            self._lags.append((now, late))
        actions: list[Action] = list(self._refuted)
        self._refuted.clear()
        if since >= timings.stall_s:
            actions.append(Stalled(since))
            return actions
        if late > timings.ping_ivl_s and not self._skipped:
            # This daemon did not run: read what arrived meanwhile before judging.
            self._skipped = True
            return actions
        self._skipped = False
        lag_s = self.local_lag_s()
        for peer, state in list(self._peers.items()):
            action = self._judge(peer, state, now, lag_s)
            if action is not None:
                actions.append(action)
        return actions

    def _judge(self, peer: str, state: _Peer, now: float, lag_s: float) -> Action | None:
        timings = self.timings
        silent = now - state.last_heard + _EPS
        if not timings.adaptive:
            if silent < timings.upper_s:
                return None
            return self._verdict(peer, state, silent, (), bound=True)
        after = self._suspect_after(state, lag_s)
        if state.suspected_at is None:
            if silent < after:
                return None
            self.counts.suspected += 1
            state.suspected_at = now
            return self._ask(peer, state, now, silent, first=True)
        vouched = self._vouched(state)
        if silent >= timings.upper_s:
            return self._verdict(peer, state, silent, vouched, bound=True)
        if now - state.suspected_at < timings.confirm_s or silent < after + timings.confirm_s:
            return None
        if vouched:
            if silent >= after + timings.confirm_s + timings.unreachable_extra_s:
                return self._verdict(peer, state, silent, vouched, bound=False)
        elif len(state.answers) == len(state.asked) or now - state.asked_at >= timings.confirm_s:
            return self._verdict(peer, state, silent, vouched, bound=False)
        if now - state.asked_at >= timings.confirm_s:
            return self._ask(peer, state, now, silent, first=False)
        return None

    def _ask(self, peer: str, state: _Peer, now: float, silent: float, first: bool) -> Ask:
        """Pick the witnesses: the other peers heard most recently, not suspected,
        those sure to hear the suspect first."""
        watchers = self.watchers(peer) if self.watchers is not None else ()
        others = sorted(
            ((name in watchers, other.last_heard, name) for name, other in self._peers.items()
             if name != peer and other.suspected_at is None), reverse=True)
        state.asked = tuple(name for _, _, name in others[:WITNESSES])
        state.asked_at = now
        if first:
            state.answers = {}  # later, an answer stands until the witness answers again
        return Ask(peer, state.asked, silent, first)

    def _vouched(self, state: _Peer) -> list[tuple[str, float]]:
        """Witnesses that heard the peer well after we last did: (name, when)."""
        margin = self.timings.suspect_s / 2
        return [(who, when) for who, when in state.answers.items()
                if when is not None and when > state.last_heard + margin]

    def _verdict(self, peer: str, state: _Peer, silent: float,
                 vouched: Iterable[tuple[str, float]], bound: bool) -> Verdict:
        verdict = self._describe(peer, state, silent, vouched, bound)
        if verdict.kind == "unreachable":
            self.counts.unreachable += 1
        else:
            self.counts.lost += 1
        self.forget(peer)
        return verdict

    def _describe(self, peer: str, state: _Peer, silent: float,
                  vouched: Iterable[tuple[str, float]], bound: bool) -> Verdict:
        now = self._clock()
        vouched_by = tuple((who, max(0.0, now - when)) for who, when in vouched)
        silent_to = tuple((who, None if when is None else max(0.0, now - when))
                          for who, when in state.answers.items()
                          if who not in dict(vouched_by))
        kind: VerdictKind = "unreachable" if vouched_by else "lost"
        return Verdict(peer, kind, silent, vouched_by, silent_to, bound)

    @staticmethod
    def _clear(state: _Peer) -> None:
        state.suspected_at = None
        state.answers = {}
        state.asked = ()
