"""The two-rank jobs that carry a process group's send and recv, and the notes
that let a receive take its message from any rank.

Each (src, dst, tag) is its own gradsync job of two ranks (src is its rank 0),
made on first use: a send and a receive match as a broadcast, in order, per tag.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from gradsync.client.client import Client
from gradsync.client.work import Work as GradsyncWork
from gradsync.protocol.errors import (
    CollectiveTimeoutError,
    DaemonUnavailableError,
    GradsyncError,
    InvalidArgumentError,
)

__all__ = ["AnySourceWork", "Connect", "EagerSends", "PairJobs", "SendNotes"]

log = logging.getLogger("gradsync.torch")

#: A send of at most this many bytes is over for its caller once its data is in a
#: daemon scratch buffer, as gloo's and MPI's small sends are, not once the
#: receiver has it ...
EAGER_SEND_BYTES = 1 << 20
#: ... while the group's sends over that way hold at most this much in all.
EAGER_OUTSTANDING_BYTES = 64 << 20

#: Connect to the daemon as (job, rank, world size, local rank, local world size).
Connect = Callable[[str, int, int, int, int], Client]


class PairJobs:
    """The clients of one group rank's point-to-point jobs, by (src, dst, tag)."""

    def __init__(self, job: str, rank: int, size: int, nodes: list[str], connect: Connect) -> None:
        self._job = job
        self._rank = rank
        self._size = size
        self._nodes = nodes
        self._connect = connect
        self._pairs: dict[tuple[int, int, int], Client] = {}
        self._lock = threading.Lock()

    def get(self, src: int, dst: int, tag: int) -> Client:
        """The two-rank job carrying src → dst messages of one tag (src is its rank 0)."""
        for peer in (src, dst):
            if not 0 <= peer < self._size:
                raise InvalidArgumentError(
                    f"point-to-point peer rank {peer} is not in [0, {self._size})"
                )
        if src == dst:
            raise InvalidArgumentError(f"rank {src} cannot send to itself")
        with self._lock:
            pair = self._pairs.get((src, dst, tag))
            if pair is None:
                same_node = self._nodes[src] == self._nodes[dst]
                me = 0 if self._rank == src else 1
                pair = self._connect(
                    f"{self._job}/p2p-{src}-{dst}-t{tag}", me, 2,
                    me if same_node else 0, 2 if same_node else 1,
                )
                self._pairs[(src, dst, tag)] = pair
            return pair

    def close(self) -> None:
        """Close every pair's client (and forget them)."""
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            pair.close()


#: How long one wait on the store lasts before the receiver looks whether its
#: group closed meanwhile (the whole wait still ends at the group's deadline).
NOTE_WAIT_SLICE_S = 1.0
#: How long closing waits for a lane's thread (a receive looking for its sender
#: ends within a wait slice; sends fail at once, their connections closed).
LANE_JOIN_S = 2 * NOTE_WAIT_SLICE_S + 1.0


class SendNotes:
    """Who sent to this rank, in order, per tag: what a receive from any source matches.

    A send leaves a note in the group's c10d store (its rank, under the next
    number for (dst, tag)) once its message is posted; a receive from any
    source reads this rank's notes in order, skips those whose message a receive
    naming that sender already took, and receives on that sender's pair job.
    One count per (src, tag) of messages taken keeps the two kinds of receive in
    step, so each message is received exactly once.  Receives from any source
    of one tag run in the order they were issued, on a thread of that tag's.
    """

    def __init__(self, store: Any, rank: int, timeout_s: float | None) -> None:
        self._store = store
        self._rank = rank
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._taken: dict[tuple[int, int], int] = {}
        self._noted: dict[tuple[int, int], int] = {}
        self._read: dict[int, int] = {}
        self._lanes: dict[int, _Lane] = {}
        self._closed = False

    def sent(self, dst: int, tag: int) -> None:
        """Leave the note of a message posted to `dst` (after the send is issued)."""
        number = self._store.add(f"p2p-notes/{dst}/t{tag}", 1)
        self._store.set(f"p2p-notes/{dst}/t{tag}/{number}", str(self._rank))

    def took(self, src: int, tag: int) -> None:
        """Count a receive that named its sender: its note must be skipped."""
        with self._lock:
            self._taken[src, tag] = self._taken.get((src, tag), 0) + 1

    def receive(self, tag: int, post: Callable[[int], GradsyncWork]) -> AnySourceWork:
        """Find the first sender not yet received from, then `post(src)` its receive."""
        with self._lock:
            if self._closed:
                raise InvalidArgumentError("this process group is shut down")
            lane = self._lanes.get(tag)
            if lane is None:
                lane = self._lanes[tag] = _Lane(f"gradsync-recv-any-t{tag}")
        work = AnySourceWork(f"recv from any rank (tag {tag})")
        lane.submit(lambda: work.run(lambda: self._next_sender(tag), post))
        return work

    def _next_sender(self, tag: int) -> int:
        deadline = None if self._timeout_s is None else time.monotonic() + self._timeout_s
        while True:
            with self._lock:
                number = self._read[tag] = self._read.get(tag, 0) + 1
            key = f"p2p-notes/{self._rank}/t{tag}/{number}"
            self._wait_for(key, tag, deadline)
            src = int(self._store.get(key))
            self._store.delete_key(key)
            with self._lock:
                noted = self._noted[src, tag] = self._noted.get((src, tag), 0) + 1
                if noted > self._taken.get((src, tag), 0):
                    self._taken[src, tag] = noted
                    return src

    def _wait_for(self, key: str, tag: int, deadline: float | None) -> None:
        while True:
            if self._closed:
                raise DaemonUnavailableError("the process group was shut down (aborted)")
            left = NOTE_WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise CollectiveTimeoutError(
                    f"rank {self._rank}: recv from any rank (tag {tag}) timed out after "
                    f"{self._timeout_s:g}s: no rank sent to it"
                )
            try:
                self._store.wait([key], datetime.timedelta(seconds=min(left, NOTE_WAIT_SLICE_S)))
                return
            except dist.DistStoreError:
                continue  # this slice ended; look at the group and the deadline again

    def close(self) -> None:
        """Fail the receives still looking for a sender (within a wait slice)."""
        with self._lock:
            self._closed = True
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.stop(LANE_JOIN_S)


class _Lane:
    """One daemon thread running jobs in the order they came."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def stop(self, join_s: float = 0.0) -> None:
        """End the thread after the jobs queued; wait up to `join_s` for it."""
        self._jobs.put(None)
        if join_s and self._thread is not threading.current_thread():
            self._thread.join(join_s)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()


class AnySourceWork:
    """A receive whose sender is known only once a note names it, seen as a gradsync
    Work (wait, is_completed, exception) with `source` set once it is posted."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._posted = threading.Event()
        self._work: GradsyncWork | None = None
        self._error: GradsyncError | None = None
        self.source = -1

    def run(self, find: Callable[[], int], post: Callable[[int], GradsyncWork]) -> None:
        """Find the sender, then post the receive from it (on the tag's lane)."""
        try:
            self.source = find()
            self._work = post(self.source)
        except GradsyncError as exc:
            self._error = exc
        finally:
            self._posted.set()

    def is_completed(self) -> bool:
        if not self._posted.is_set():
            return False
        return self._work is None or self._work.is_completed()

    def exception(self) -> GradsyncError | None:
        if self._error is not None or self._work is None:
            return self._error
        return self._work.exception()

    def wait(self, timeout: float | None = None) -> bool:
        start = time.monotonic()
        if not self._posted.wait(timeout):
            raise CollectiveTimeoutError(
                f"{self._what} timed out after {timeout}s here (still in flight)"
            )
        if self._error is not None:
            raise self._error
        assert self._work is not None
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        return self._work.wait(left)


class EagerSends:
    """Small sends handed back to their caller already, finished here in the background.

    Their gradsync Works are waited for in order on a thread of the group's, so
    each gives its scratch back once the receiver took it; one that fails is
    logged (its pair job is then broken, so the next send or receive on that
    pair raises the error).  `admit` bounds the bytes held so.
    """

    def __init__(self, name: str) -> None:
        self._lock = threading.Condition()
        self._held = 0
        self._pending = 0
        self._lane = _Lane(name)

    def admit(self, nbytes: int) -> bool:
        """Whether a send of `nbytes` may go eagerly now (it then counts as held)."""
        if nbytes > EAGER_SEND_BYTES:
            return False
        with self._lock:
            if self._held + nbytes > EAGER_OUTSTANDING_BYTES:
                return False
            self._held += nbytes
            self._pending += 1
            return True

    def finish(self, works: list[GradsyncWork], nbytes: int, what: str) -> None:
        """Wait for `works` in the background; `nbytes` are held until they end."""
        self._lane.submit(lambda: self._wait(works, nbytes, what))

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._held -= nbytes
            self._pending -= 1
            self._lock.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait (up to `timeout_s`) until every send handed back has been received
        (or failed): a sender that closes its group first would take its messages
        with it.  False if some were still out at the deadline."""
        with self._lock:
            return self._lock.wait_for(lambda: self._pending == 0, timeout_s)

    def _wait(self, works: list[GradsyncWork], nbytes: int, what: str) -> None:
        try:
            for work in works:
                work.wait()  # its collective deadline bounds it
        except GradsyncError as exc:
            log.warning("gradsync: %s failed after it was handed back: %s", what, exc)
        finally:
            self.release(nbytes)

    def close(self) -> None:
        """End the thread once what is queued is over (the group's close fails it)."""
        self._lane.stop(LANE_JOIN_S)
