"""`FutureCompleter`: the one way torch futures are completed here, off the issuing thread.

Both the process group (its `Work.get_future()`) and `comm_hook` hand their
futures to one of these: a daemon thread that runs jobs in the order they came,
each waiting for its collectives and returning the step that settles its
future.  The process group runs those steps on a small pool of callback threads,
since a future's callback may block on the next collective's future (PowerSGD
does), which the completer thread must still complete; the comm hook settles on
the completer thread itself.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable

#: A job waits for its collectives and returns what settles its future.
Job = Callable[[], Callable[[], None]]

#: Threads of a callback pool (callbacks that block each hold one).
CALLBACK_THREADS = 16


class FutureCompleter:
    """One daemon thread named `thread_name` that runs jobs in submission order.

    With `callback_prefix`, each job's settle step runs on a pool of threads of
    that name prefix; without, on the completer thread.  A job's own errors are
    its business: one that escapes ends the thread.
    """

    def __init__(self, thread_name: str, callback_prefix: str | None = None) -> None:
        self._pending: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._callback_prefix = callback_prefix
        self._callbacks = None if callback_prefix is None else (
            concurrent.futures.ThreadPoolExecutor(
                max_workers=CALLBACK_THREADS, thread_name_prefix=callback_prefix
            )
        )
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> bool:
        """Queue `job`; False once stopped (the caller then completes it itself)."""
        with self._lock:
            if self._closed:
                return False
            self._pending.put(job)
            return True

    def _run(self) -> None:
        while (job := self._pending.get()) is not None:
            settle = job()
            if self._callbacks is None:
                settle()
            else:
                self._callbacks.submit(settle)

    def stop(self) -> None:
        """End the thread after the jobs already queued; returns at once (no join)."""
        with self._lock:
            self._closed = True
            self._pending.put(None)

    def close(self) -> None:
        """Stop, then join the thread and the pool; from a callback thread, the pool
        cannot wait for itself, and the completer thread does not join itself."""
        self.stop()
        current = threading.current_thread()
        if current is not self._thread:
            self._thread.join()
        if self._callbacks is not None:
            assert self._callback_prefix is not None
            self._callbacks.shutdown(wait=not current.name.startswith(self._callback_prefix))
