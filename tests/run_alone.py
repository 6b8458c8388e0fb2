"""Tests marked `alone` run with no other test beside them, under pytest-xdist too.

The suite runs on several xdist workers (pyproject's addopts).  A few tests judge
wall-clock behaviour under a load they make themselves (the failure detector's
no-false-positive soaks, the lost-node bound): another worker's test beside
them would add load they did not design for.  So every test holds the run's
room lock: shared for an ordinary test, exclusive for an `alone` one.

The lock is fair (a turnstile taken before the room): once an `alone` test is
waiting, no new ordinary test starts, so it gets the room as soon as the tests
now running on the other workers end.  Plain `flock` files in the temp folder,
named by the xdist run's id, so separate runs never wait for each other; the
kernel releases them when a worker dies.  Outside xdist there is no one to
wait for and nothing is locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator

#: xdist gives every worker of one run the same id.
RUN_ID_VARIABLE = "PYTEST_XDIST_TESTRUNUID"
#: The longest a test waits for the room: the other workers' longest test and then some.
WAIT_S = 900.0
POLL_S = 0.05


def run_file(name: str, run_id: str | None = None) -> str | None:
    """File `name` of this xdist run (or of run `run_id`) in the temp folder, the same for
    all its workers; None outside xdist."""
    run_id = run_id or os.environ.get(RUN_ID_VARIABLE)
    if run_id is None:
        return None
    return os.path.join(tempfile.gettempdir(), f"gradsync-pytest-{os.getuid()}-{run_id}.{name}")


class RoomLock:
    """The run's room: shared by ordinary tests, exclusive for `alone` ones."""

    def __init__(self, run_id: str | None) -> None:
        self.run_id = run_id
        self._files: dict[str, int] = {}

    def _fd(self, name: str) -> int:
        if name not in self._files:
            path = run_file(name, self.run_id)
            assert path is not None  # hold() locks nothing outside xdist
            self._files[name] = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        return self._files[name]

    def _take(self, name: str, mode: int, what: str) -> None:
        """flock with a deadline: poll the non-blocking form."""
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                fcntl.flock(self._fd(name), mode | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} waited {WAIT_S:.0f} s for the tests on the other "
                                       f"xdist workers to end (lock {name} of run "
                                       f"{self.run_id})") from None
                time.sleep(POLL_S)

    @contextlib.contextmanager
    def hold(self, alone: bool, what: str) -> Iterator[None]:
        if self.run_id is None:
            yield
            return
        self._take("turnstile", fcntl.LOCK_EX, what)
        try:
            self._take("room", fcntl.LOCK_EX if alone else fcntl.LOCK_SH, what)
        finally:
            fcntl.flock(self._fd("turnstile"), fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._fd("room"), fcntl.LOCK_UN)

    def remove(self) -> None:
        """The lock files of this run (called by the last worker out, or the controller)."""
        for name, fd in self._files.items():
            os.close(fd)
            path = run_file(name, self.run_id)
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        self._files.clear()


def room_lock() -> RoomLock:
    return RoomLock(os.environ.get(RUN_ID_VARIABLE))
