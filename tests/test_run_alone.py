"""The room lock that lets `alone` tests run with nothing beside them (tests/run_alone.py)."""

from __future__ import annotations

import fcntl
import threading
import time
import uuid

import pytest
from run_alone import RoomLock


def _held_by_another(lock: RoomLock, name: str) -> bool:
    try:
        fcntl.flock(lock._fd(name), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(lock._fd(name), fcntl.LOCK_UN)
    return False


def _wait_for(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_an_alone_test_waits_for_the_running_one_and_bars_new_ones() -> None:
    run = f"test-{uuid.uuid4().hex[:8]}"
    running, alone, observer = RoomLock(run), RoomLock(run), RoomLock(run)
    entered = threading.Event()
    leave = threading.Event()

    def alone_test() -> None:
        with alone.hold(True, "alone test"):
            entered.set()
            leave.wait(10)

    try:
        with running.hold(False, "ordinary test"):
            thread = threading.Thread(target=alone_test)
            thread.start()
            # It queued: it holds the turnstile, so no new ordinary test starts...
            _wait_for(lambda: _held_by_another(observer, "turnstile"), "the alone test queued")
            assert not entered.is_set()  # ...and it waits for the running one to end.
        assert entered.wait(10), "the alone test never got the room"
        with pytest.raises(BlockingIOError):  # while it runs, nobody shares the room
            fcntl.flock(observer._fd("room"), fcntl.LOCK_SH | fcntl.LOCK_NB)
        leave.set()
        thread.join(10)
        with observer.hold(False, "next ordinary test"):
            pass
    finally:
        leave.set()
        for lock in (running, alone, observer):
            lock.remove()


def test_outside_xdist_nothing_is_locked() -> None:
    lock = RoomLock(None)
    with lock.hold(True, "alone"), lock.hold(False, "ordinary"):
        assert lock._files == {}
