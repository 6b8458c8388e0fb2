"""Work and futures of the torch.distributed backend "gradsync".

An `Operation` is one torch call: the gradsync collectives it became and the
copies that follow them.  `TorchWork` is torch's handle on it.  Futures are
completed by the group's `FutureCompleter` thread, never inline on the thread
that issues collectives, and their callbacks run on a small pool of their own.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gradsync.client.torch.completer import FutureCompleter
from gradsync.protocol.errors import (
    CollectiveTimeoutError,
    DaemonLostError,
    GradsyncError,
    InvalidArgumentError,
    PeerLostError,
    RankLostError,
)

#: Failures where the other end went away: torch's and torchft's tools look for
#: gloo's phrase, and for "aborted" in what a failed group reports afterwards.
GONE = (RankLostError, PeerLostError, DaemonLostError)


class Pending(Protocol):
    """What an Operation waits on: a gradsync Work, or a receive still finding its sender."""

    def is_completed(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...

    def exception(self) -> GradsyncError | None: ...


def torch_error(exc: GradsyncError, group: str) -> Exception:
    """What torch users catch: argument errors stay ValueErrors, the rest DistBackendError.

    gradsync's message stays whole; a lost rank, peer or daemon also says it the
    way gloo does ("Connection closed by peer"), and that the collective was
    aborted; a deadline starts with gloo's "Timed out waiting".
    """
    if isinstance(exc, InvalidArgumentError):
        return exc
    if isinstance(exc, GONE):
        text = f"{exc} (Connection closed by peer; collective aborted)"
    elif isinstance(exc, CollectiveTimeoutError):
        text = f"Timed out waiting: {exc}"
    else:
        text = str(exc)
    error = dist.DistBackendError(f"gradsync (process group {group!r}): {text}")
    error.__cause__ = exc
    return error


class Operation:
    """One torch-level call: the gradsync collectives it became and what follows them.

    `complete()` waits for all of them, then runs `finish` (copies into the
    caller's tensors) exactly once; any thread may call it, one at a time.
    """

    def __init__(
        self,
        group_name: Callable[[], str],
        what: str,
        works: Sequence[Pending | None],
        outputs: list[torch.Tensor],
        finish: Callable[[], None] | None = None,
        done: Callable[[], None] | None = None,
    ) -> None:
        self.group_name = group_name
        self.what = what
        self.works = [w for w in works if w is not None]
        self.outputs = outputs
        self.finish = finish
        #: Runs once the operation is over, successful or not.
        self.done_callback = done
        self.lock = threading.Lock()
        self.done = False
        self.error: Exception | None = None
        if not self.works and finish is None:  # over already (done on the fast page)
            self.done = True
            if done is not None:
                done()

    def poll(self) -> bool:
        if self.done:
            return True
        if not all(w.is_completed() for w in self.works):
            return False
        with contextlib.suppress(Exception):
            self.complete()
        return True

    def complete(self, timeout_s: float | None = None) -> None:
        """Wait for the result (or `timeout_s`, leaving it in flight); raise its error."""
        if self.done and self.error is None:
            return
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self.lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise dist.DistBackendError(
                f"gradsync: {self.what} timed out after {timeout_s}s here (still in flight)"
            )
        try:
            if not self.done:
                self._finish_works(deadline)
        finally:
            self.lock.release()
        if self.error is not None:
            raise self.error

    def _finish_works(self, deadline: float | None) -> None:
        """Wait for every work (all of them, even after one failed: each gives its
        scratch back when it ends), then `finish` if all succeeded."""
        first: GradsyncError | None = None
        for work in self.works:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                work.wait(left)
            except CollectiveTimeoutError as exc:
                if work.exception() is None:  # the caller's own timeout: still in flight
                    raise dist.DistBackendError(f"gradsync: {exc}") from exc
                first = first or exc
            except GradsyncError as exc:
                first = first or exc
        try:
            if first is None and self.finish is not None:
                self.finish()
        except GradsyncError as exc:
            first = exc
        if first is not None:
            self.error = torch_error(first, self.group_name())
        self.done = True
        if self.done_callback is not None:
            self.done_callback()


def future_of(operation: Operation, completer: FutureCompleter) -> torch.futures.Future[Any]:
    """A future of `operation`'s output tensors (or its error), completed by `completer`."""
    future: torch.futures.Future[Any] = torch.futures.Future()
    if operation.done:
        # Already over (a wait() came first): complete it now, as gloo does, so a
        # `then()` chained next runs at once (torchft's Manager relies on that).
        _settle(operation, future)
        return future

    def job() -> Callable[[], None]:
        with contextlib.suppress(Exception):
            operation.complete()
        return functools.partial(_settle, operation, future)

    if not completer.submit(job):
        # The group is shut down: its connection is closed, so this ends at once.
        job()()
    return future


def _settle(operation: Operation, future: torch.futures.Future[Any]) -> None:
    if operation.error is not None:
        future.set_exception(operation.error)
    else:
        future.set_result(operation.outputs)


class CompletedWork(dist.Work):
    """torch's handle on an operation over before it was handed out (one done on
    the fast page): no Operation, no future thread."""

    def __init__(self, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._outputs = outputs

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> Exception | None:
        return None

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def get_future(self) -> torch.futures.Future[Any]:
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result(self._outputs)
        return future


class TorchWork(dist.Work):
    """torch's handle on one operation: wait, is_completed, get_future (output tensors)."""

    def __init__(self, operation: Operation, completer: FutureCompleter) -> None:
        super().__init__()
        self._operation = operation
        self._completer = completer
        self._future: torch.futures.Future[Any] | None = None
        #: The sending rank of a receive (known once a receive from any source is over).
        self.source: Callable[[], int] | None = None

    def _source_rank(self) -> int:
        """The group rank a receive took its message from (torch's `recv(src=None)`)."""
        if self.source is None:
            raise ValueError(f"gradsync: {self._operation.what} is not a receive")
        self.wait()
        return self.source()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = None if timeout is None else timeout.total_seconds()
        self._operation.complete(seconds if seconds and seconds > 0 else None)
        return True

    def is_completed(self) -> bool:
        return self._operation.poll()

    def is_success(self) -> bool:
        return self._operation.poll() and self._operation.error is None

    def exception(self) -> Exception | None:
        return self._operation.error

    def result(self) -> list[torch.Tensor]:
        return self._operation.outputs

    def get_future(self) -> torch.futures.Future[Any]:
        if self._future is None:
            self._future = future_of(self._operation, self._completer)
        return self._future
