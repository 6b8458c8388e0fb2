"""The core's own future (daemon/core/outcome.py): settled once, read without a loop."""

from __future__ import annotations

import pytest

from gradsync.daemon.core.outcome import Outcome, UnsettledError
from gradsync.protocol.errors import PeerLostError


def test_an_outcome_is_settled_once_and_calls_back_in_order() -> None:
    outcome: Outcome[int] = Outcome()
    seen: list[str] = []
    outcome.add_done_callback(lambda done: seen.append(f"first {done.result()}"))
    assert not outcome.done()
    with pytest.raises(UnsettledError):
        outcome.result()
    outcome.set_result(7)
    outcome.add_done_callback(lambda done: seen.append(f"late {done.result()}"))
    assert outcome.done() and outcome.result() == 7 and outcome.exception() is None
    assert seen == ["first 7", "late 7"]
    with pytest.raises(UnsettledError):
        outcome.set_exception(PeerLostError("too late"))
    assert outcome.result() == 7


def test_a_failed_outcome_raises_its_error_to_every_reader() -> None:
    outcome: Outcome[int] = Outcome()
    error = PeerLostError("peer b was lost")
    outcome.set_exception(error)
    assert outcome.exception() is error
    for _ in range(2):
        with pytest.raises(PeerLostError):
            outcome.result()
