"""The failure detector's decisions, from a fake clock (daemon/core/failure_detector.py).

No sockets and no sleeping: a test plays heartbeats and ticks by hand.  The
same detector on real daemons: tests/test_liveness.py (no false positives
under a CPU hog and pauses) and tests/test_torchft_lost_node.py (a vanished
node, with the default settings).
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from gradsync.daemon.core.failure_detector import (
    Action,
    Ask,
    DetectorTimings,
    FailureDetector,
    Refuted,
    Stalled,
    Verdict,
)

A, B, C = "tcp://10.0.0.1:29400", "tcp://10.0.0.2:29400", "tcp://10.0.0.3:29400"
DEFAULTS = DetectorTimings.for_timeout(10.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def detector(*peers: str, timeout_s: float = 10.0) -> tuple[FailureDetector, Clock]:
    clock = Clock()
    found = FailureDetector(DetectorTimings.for_timeout(timeout_s), clock)
    for peer in peers:
        found.watch(peer)
    return found, clock


def run(found: FailureDetector, clock: Clock, seconds: float,
        speaking: Iterable[str] = (), every_s: float = 0.1) -> list[tuple[float, Action]]:
    """Tick every `every_s` for `seconds`, the `speaking` peers heard before each
    tick; what the detector decided, with when."""
    start = clock.now
    actions: list[tuple[float, Action]] = []
    for step in range(1, round(seconds / every_s) + 1):
        clock.now = start + step * every_s
        for peer in speaking:
            found.heard(peer)
        actions += [(clock.now - start, action) for action in found.tick()]
    return actions


def verdicts(actions: list[tuple[float, Action]]) -> list[tuple[float, Verdict]]:
    return [(at, action) for at, action in actions if isinstance(action, Verdict)]


def test_the_defaults_declare_a_vanished_peer_in_two_seconds() -> None:
    assert (DEFAULTS.suspect_s, DEFAULTS.confirm_s, DEFAULTS.ping_ivl_s) == (1.5, 0.5, 0.1)
    found, clock = detector(B)
    run(found, clock, 30, speaking=[B])
    actions = run(found, clock, 5)
    asks = [(at, a) for at, a in actions if isinstance(a, Ask)]
    assert [round(at, 1) for at, _ in asks] == [1.5]
    assert asks[0][1].witnesses == () and asks[0][1].first
    ((at, verdict),) = verdicts(actions)
    assert verdict.kind == "lost" and verdict.peer == B and not verdict.bound
    assert 2.0 <= at <= 2.1 + 1e-9
    assert "silent for 2.0s" in verdict.describe(A)
    assert found.counts.lost == 1 and found.heard_age(B) is None  # no longer watched


def test_witnesses_that_do_not_hear_the_peer_either_confirm_its_loss() -> None:
    found, clock = detector(B, C)
    run(found, clock, 10, speaking=[B, C])
    actions = run(found, clock, 1.5, speaking=[C])
    ((_, ask),) = [(at, a) for at, a in actions if isinstance(a, Ask)]
    assert ask.peer == B and ask.witnesses == (C,)
    found.witness_said(B, C, 1.45)  # C has not heard B for as long
    ((at, verdict),) = verdicts(run(found, clock, 1, speaking=[C]))
    assert verdict.kind == "lost" and verdict.silent_to[0][0] == C
    assert at <= 0.5 + 1e-9
    assert f"not heard by {C} for" in verdict.describe(A)


def test_a_peer_a_witness_hears_is_declared_unreachable_later_naming_the_pair() -> None:
    found, clock = detector(B, C)
    run(found, clock, 10, speaking=[B, C])
    cut = clock.now
    declared: list[tuple[float, Verdict]] = []
    for _ in range(60):  # C keeps hearing B: it answers every question so
        for _, action in run(found, clock, 0.1, speaking=[C]):
            if isinstance(action, Ask):
                assert action.witnesses == (C,)
                found.witness_said(B, C, 0.05)
            if isinstance(action, Verdict):
                declared.append((clock.now - cut, action))
    ((at, verdict),) = declared
    assert verdict.kind == "unreachable" and verdict.vouched_by[0][0] == C
    assert 4.0 <= at <= 4.1 + 1e-9  # twice the time a dead node takes
    text = verdict.describe(A)
    assert f"between {A} and {B} is cut" in text and f"{C} heard it" in text
    assert found.counts.unreachable == 1


def test_a_one_second_pause_every_twenty_is_never_suspected() -> None:
    found, clock = detector(B)
    for _ in range(6):
        actions = run(found, clock, 19, speaking=[B])
        actions += run(found, clock, 1.0)  # B stopped: nothing heard for a second
        assert actions == []
    assert found.counts.suspected == 0


def test_a_suspect_that_speaks_is_no_longer_suspected() -> None:
    found, clock = detector(B)
    run(found, clock, 10, speaking=[B])
    actions = run(found, clock, 1.7)
    assert any(isinstance(a, Ask) for _, a in actions) and found.suspected(B)
    actions = run(found, clock, 3, speaking=[B])
    assert [a for _, a in actions if not isinstance(a, Refuted)] == []
    refuted = [a for _, a in actions if isinstance(a, Refuted)]
    assert len(refuted) == 1 and refuted[0].silent_s == pytest.approx(1.8)
    assert not found.suspected(B) and found.counts.refuted == 1


def test_irregular_arrivals_earn_a_longer_wait() -> None:
    """Phi-accrual: a peer heard in bursts with gaps up to 1.3 s (a starved CPU, a
    saturated link) is not suspected after 1.9 s of silence, a regular one is."""
    found, clock = detector(B)
    for _ in range(20):
        run(found, clock, 0.9, speaking=[B])
        run(found, clock, 1.2)
    wait = found.suspect_after_s(B)
    assert wait is not None and wait > 2.0
    run(found, clock, 0.1, speaking=[B])
    assert run(found, clock, 1.9) == []
    steady, steady_clock = detector(B)
    run(steady, steady_clock, 40, speaking=[B])
    assert steady.suspect_after_s(B) == pytest.approx(1.5)


def test_a_daemon_that_ran_late_blames_no_one_for_it() -> None:
    """Lifeguard's local health: the tick after this daemon did not run judges no
    one (the peer's messages may wait unread), and its own lateness lengthens
    every wait for a while."""
    found, clock = detector(B)
    run(found, clock, 10, speaking=[B])
    clock.now += 1.6  # this daemon did not run: B's heartbeats wait unread
    assert found.tick() == []
    assert found.local_lag_s() == pytest.approx(1.5)
    assert found.suspect_after_s(B) == pytest.approx(1.5 + 3.0)
    # B was heard in the meantime: as soon as this daemon reads, all is well.
    assert run(found, clock, 1, speaking=[B]) == []
    # ...and a silence of 4 s right after is still within the allowance.
    assert run(found, clock, 4) == []
    assert found.counts.suspected == 0


def test_a_daemon_late_at_every_tick_still_declares_a_vanished_peer() -> None:
    """A starved daemon (every tick 0.2 s late) skips no more than one tick in a
    row, and waits longer by twice its lateness."""
    found, clock = detector(B)
    run(found, clock, 10, speaking=[B], every_s=0.3)
    ((at, verdict),) = verdicts(run(found, clock, 5, every_s=0.3))
    assert verdict.kind == "lost" and 2.4 <= at <= 2.7 + 1e-9


def test_a_daemon_stopped_long_enough_to_be_declared_is_told() -> None:
    found, clock = detector(B)
    run(found, clock, 5, speaking=[B])
    clock.now += DEFAULTS.stall_s
    (stalled,) = found.tick()
    assert isinstance(stalled, Stalled) and stalled.stalled_s == pytest.approx(4.0)


def test_the_peer_timeout_bounds_every_wait() -> None:
    found, clock = detector(B, C, timeout_s=3.0)
    for _ in range(10):  # very irregular: the adaptive wait alone would be long
        run(found, clock, 0.5, speaking=[B, C])
        run(found, clock, 1.4, speaking=[C])
    wait = found.suspect_after_s(B)
    assert wait is not None and wait == pytest.approx(2.5)  # the bound less confirm_s
    declared: list[tuple[float, Verdict]] = []
    start = clock.now
    for _ in range(50):
        for _, action in run(found, clock, 0.1, speaking=[C]):
            if isinstance(action, Ask):
                found.witness_said(B, C, 0.05)
            if isinstance(action, Verdict):
                declared.append((clock.now - start, action))
    ((at, verdict),) = declared
    assert verdict.bound and verdict.kind == "unreachable" and at <= 3.0 + 1e-9


def test_short_peer_timeouts_scale_the_timings_down() -> None:
    timings = DetectorTimings.for_timeout(1.0)
    assert (timings.suspect_s, timings.confirm_s, timings.ping_ivl_s) == (0.75, 0.25, 0.1)
    assert timings.declare_s == 1.0 and timings.stall_s == 1.0
    found, clock = detector(B, timeout_s=1.0)
    run(found, clock, 5, speaking=[B])
    ((at, verdict),) = verdicts(run(found, clock, 2))
    assert verdict.kind == "lost" and 1.0 <= at <= 1.1 + 1e-9
