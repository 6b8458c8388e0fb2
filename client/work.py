"""`Work`: the handle of an asynchronous collective (torch.distributed's name)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gradsync.client.connection import Connection, raise_for_error
from gradsync.protocol.codec import Message
from gradsync.protocol.errors import CollectiveTimeoutError, GradsyncError


class Work:
    """One collective in flight; `wait()` returns once the result is in place."""

    def __init__(
        self,
        connection: Connection,
        request_id: int,
        describe: Callable[[], str],
        guard_deadline: float,
        on_success: Callable[[], None] | None = None,
        on_finish: Callable[[], None] | None = None,
    ) -> None:
        self._connection = connection
        self._request_id = request_id
        self._describe = describe
        self._guard_deadline = guard_deadline
        self._on_success = on_success
        self._on_finish = on_finish
        self._lock = threading.Lock()
        self._done = False
        self._error: GradsyncError | None = None
        #: The daemon's CLOCK_MONOTONIC times (submitted, matched, completed) once done.
        self.timing: dict[str, float] = {}

    def __repr__(self) -> str:
        state = "failed" if self._error else "completed" if self._done else "in flight"
        return f"<Work {self._describe()}: {state}>"

    def is_completed(self) -> bool:
        """True once the collective finished (successfully or not); never blocks long."""
        if self._done:
            return True
        try:
            reply = self._connection.poll(self._request_id)
        except GradsyncError as exc:
            self._finish_error(exc)
            return True
        if reply is None:
            return False
        self._finish(reply)
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done; raise the collective's error, or a timeout error.

        With `timeout`, a `CollectiveTimeoutError` after that many seconds leaves
        the collective in flight: `wait()` may be called again.  Without one,
        the wait ends at the daemon's collective deadline plus a margin.
        """
        if not self._done:
            user_deadline = None if timeout is None else time.monotonic() + timeout
            deadline = self._guard_deadline if user_deadline is None else min(
                user_deadline, self._guard_deadline
            )
            try:
                reply = self._connection.wait(self._request_id, deadline)
            except GradsyncError as exc:
                self._finish_error(exc)
                raise
            if reply is None:
                if user_deadline is not None and user_deadline <= self._guard_deadline:
                    raise CollectiveTimeoutError(
                        f"{self._describe()} timed out after {timeout}s here (still in flight)"
                    )
                error = CollectiveTimeoutError(
                    f"{self._describe()}: the daemon at {self._connection.endpoint} "
                    "did not answer before the collective deadline"
                )
                self._finish_error(error)
                raise error
            self._finish(reply)
        if self._error is not None:
            raise self._error
        return True

    def exception(self) -> GradsyncError | None:
        """The error the collective ended with, if it ended with one."""
        return self._error

    def _finish(self, reply: Message) -> None:
        with self._lock:
            if self._done:
                return
            try:
                raise_for_error(reply)
                timing = reply.get("timing")
                if isinstance(timing, dict):
                    self.timing = {str(k): float(v) for k, v in timing.items()}
                if self._on_success is not None:
                    self._on_success()
            except GradsyncError as exc:
                self._error = exc
            finally:
                self._done = True
                if self._on_finish is not None:
                    self._on_finish()

    def _finish_error(self, error: GradsyncError) -> None:
        with self._lock:
            if self._done:
                return
            self._error = error
            self._done = True
            if self._on_finish is not None:
                self._on_finish()
