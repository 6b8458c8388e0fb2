"""Work and futures of the torch.distributed backend "gradsync".

An `Operation` is one torch call: the gradsync collectives it became and the
copies that follow them.  `TorchWork` is torch's handle on it.  Futures are
completed by a `Completer` thread, never inline on the thread that issues
collectives, and their callbacks run on a small pool of their own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradsync.client.work import Work as GradsyncWork
from gradsync.protocol.errors import CollectiveTimeoutError, GradsyncError, InvalidArgumentError


def torch_error(exc: GradsyncError, group: str) -> Exception:
    """What torch users catch: argument errors stay ValueErrors, the rest DistBackendError."""
    if isinstance(exc, InvalidArgumentError):
        return exc
    error = dist.DistBackendError(f"gradsync (process group {group!r}): {exc}")
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
        works: Sequence[GradsyncWork | None],
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
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self.lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise dist.DistBackendError(
                f"gradsync: {self.what} not complete after {timeout_s}s; still in flight"
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


class Completer:
    """Completes futures off the issuing thread, and runs their callbacks off its own.

    One thread waits for operations in the order futures were asked for; each
    result is handed to a small pool, because a callback may block on the next
    collective's future (PowerSGD does), which this thread must still complete.
    """

    def __init__(self, name: str) -> None:
        self._pending: queue.SimpleQueue[tuple[Operation, torch.futures.Future[Any]] | None]
        self._pending = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._callback_prefix = f"gradsync-callbacks-{name}"
        self._callbacks = concurrent.futures.ThreadPoolExecutor(
            max_workers=16, thread_name_prefix=self._callback_prefix
        )
        self._thread = threading.Thread(
            target=self._run, name=f"gradsync-futures-{name}", daemon=True
        )
        self._thread.start()

    def future_of(self, operation: Operation) -> torch.futures.Future[Any]:
        future: torch.futures.Future[Any] = torch.futures.Future()
        with self._lock:
            if not self._closed:
                self._pending.put((operation, future))
                return future
        # The group is shut down: its connection is closed, so this ends at once.
        with contextlib.suppress(Exception):
            operation.complete()
        _settle(operation, future)
        return future

    def _run(self) -> None:
        while (item := self._pending.get()) is not None:
            operation, future = item
            with contextlib.suppress(Exception):
                operation.complete()
            self._callbacks.submit(_settle, operation, future)

    def close(self) -> None:
        """Stop and join both; from a callback thread, the pool cannot wait for itself."""
        with self._lock:
            self._closed = True
            self._pending.put(None)
        current = threading.current_thread()
        if current is not self._thread:
            self._thread.join()
        self._callbacks.shutdown(wait=not current.name.startswith(self._callback_prefix))


def _settle(operation: Operation, future: torch.futures.Future[Any]) -> None:
    if operation.error is not None:
        future.set_exception(operation.error)
    else:
        future.set_result(operation.outputs)


class TorchWork(dist.Work):
    """torch's handle on one operation: wait, is_completed, get_future (output tensors)."""

    def __init__(self, operation: Operation, completer: Completer) -> None:
        super().__init__()
        self._operation = operation
        self._completer = completer
        self._future: torch.futures.Future[Any] | None = None

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
            self._future = self._completer.future_of(self._operation)
        return self._future
