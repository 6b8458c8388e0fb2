"""Deadlines and stall warnings decided by the core from a fake clock.

No daemon and no sleeping: `FakeClock` is the `Clock` the core reads and sets
timers on, and a test moves it forward by hand.  What the daemon does with the
same decisions on the event loop is tested end to end in test_failures.py.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import pytest

from gradsync.daemon.core.deadlines import FAST_FOLLOW_S, Deadlines
from gradsync.daemon.core.matching import CollectiveCall, Job, Key, Member, Submission
from gradsync.protocol.errors import CollectiveTimeoutError, GradsyncError
from gradsync.protocol.peer import Fingerprint


@dataclasses.dataclass
class FakeTimer:
    due: float
    callback: Callable[[], None]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """A clock that moves only when told to, and fires the timers that fall due."""

    def __init__(self) -> None:
        self.time = 1000.0
        self.timers: list[FakeTimer] = []

    def now(self) -> float:
        return self.time

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> FakeTimer:
        timer = FakeTimer(self.time + delay_s, callback)
        self.timers.append(timer)
        return timer

    def advance(self, seconds: float) -> None:
        end = self.time + seconds
        while True:
            due = [t for t in self.timers if not t.cancelled and t.due <= end]
            if not due:
                break
            timer = min(due, key=lambda t: t.due)
            self.timers.remove(timer)
            self.time = max(self.time, timer.due)
            timer.callback()
        self.time = end


class Harness:
    """One job of `ranks` local ranks, its deadlines, and what they failed."""

    def __init__(self, ranks: int = 2, fast: set[int] | None = None) -> None:
        self.clock = FakeClock()
        self.job = Job("train", ranks, ranks, self.clock.now)
        for rank in range(ranks):
            self.job.add_member(Member(rank, rank, 100 + rank, rank))
        self.failed: list[tuple[CollectiveCall, CollectiveTimeoutError]] = []
        self.answers: dict[int, GradsyncError | None] = {}
        #: Ranks "on the fast page" for every key (they come to the socket).
        self.fast = fast or set()
        self.deadlines = Deadlines({"train": self.job}, self.clock, self._fast_ranks,
                                   self._expired)

    def _fast_ranks(self, job_name: str, key: Key) -> set[int]:
        return set(self.fast)

    def _expired(self, pending: CollectiveCall, error: CollectiveTimeoutError) -> None:
        self.failed.append((pending, error))
        for rank, submission in pending.submissions.items():
            submission.respond(error)
            self.answers[rank] = error

    def submit(self, rank: int, key: Key, timeout_s: float, waited_s: float = 0.0
               ) -> CollectiveCall | None:
        submission = Submission(rank, Fingerprint("allreduce", "float32", 4, "sum"), None,
                                lambda error, timing=None: None, timeout_s)
        ready = self.job.submit(key, submission)
        if ready is None:
            self.deadlines.waiting(self.job, self.job.pending[key], submission, waited_s)
        else:
            self.deadlines.settled(ready)
        return ready


def test_a_key_expires_at_its_deadline_naming_the_missing_rank() -> None:
    harness = Harness()
    harness.submit(0, 7, timeout_s=30.0)
    harness.clock.advance(29.9)
    assert not harness.failed
    harness.clock.advance(0.2)
    [(pending, error)] = harness.failed
    assert pending.key == 7 and error.details["missing"] == [1]
    assert "timed out after 30s waiting for ranks [1]" in error.message
    assert 7 in harness.job.failed and 7 not in harness.job.pending


def test_a_matched_key_never_expires() -> None:
    harness = Harness()
    harness.submit(0, 1, timeout_s=5.0)
    assert harness.submit(1, 1, timeout_s=5.0) is not None
    harness.clock.advance(60.0)
    assert not harness.failed
    assert all(timer.cancelled for timer in harness.clock.timers)


def test_the_earliest_deadline_any_submitter_asks_for_wins() -> None:
    """Rank 0 asks for 60 s; rank 1, 10 s later, for 5 s: it fails at 15 s, and
    the error quotes the deadline counted from the first submission."""
    harness = Harness(ranks=3)
    harness.submit(0, "b", timeout_s=60.0)
    harness.clock.advance(10.0)
    harness.submit(1, "b", timeout_s=5.0)
    harness.clock.advance(4.9)
    assert not harness.failed
    harness.clock.advance(0.2)
    [(_, error)] = harness.failed
    assert "timed out after 15s" in error.message and error.details["missing"] == [2]


def test_a_deadline_counts_from_the_fast_path_when_the_wait_began_there() -> None:
    harness = Harness()
    harness.submit(0, 3, timeout_s=10.0, waited_s=8.0)
    harness.clock.advance(1.9)
    assert not harness.failed
    harness.clock.advance(0.2)
    assert len(harness.failed) == 1


def test_ranks_on_the_fast_page_get_a_grace_to_reach_the_socket() -> None:
    """Rank 1 published the key on the fast page: the daemon waits up to
    FAST_FOLLOW_S past the deadline for it to come, so both get one error."""
    harness = Harness(fast={1})
    harness.submit(0, 5, timeout_s=1.0)
    harness.clock.advance(1.5)
    assert not harness.failed  # polling for rank 1
    harness.clock.advance(FAST_FOLLOW_S)
    [(_, error)] = harness.failed
    assert isinstance(error, CollectiveTimeoutError)


def test_a_rank_that_follows_from_the_fast_page_in_its_grace_completes_the_key() -> None:
    harness = Harness(fast={1})
    harness.submit(0, 5, timeout_s=1.0)
    harness.clock.advance(1.5)
    assert harness.submit(1, 5, timeout_s=1.0) is not None
    harness.clock.advance(10.0)
    assert not harness.failed


def test_a_stall_is_reported_once_and_names_the_missing_rank(
    caplog: pytest.LogCaptureFixture,
) -> None:
    harness = Harness()
    harness.submit(1, 9, timeout_s=600.0)
    harness.clock.advance(30.0)
    with caplog.at_level(logging.WARNING, logger="gradsync.daemon"):
        harness.deadlines.report_stalls(60.0, [])
        assert not caplog.records
        harness.clock.advance(31.0)
        harness.deadlines.report_stalls(60.0, [])
        harness.deadlines.report_stalls(60.0, [])
    [record] = caplog.records
    assert "key 9 of job 'train' has waited 61s for ranks [0]" in record.getMessage()
