"""`GradientBucketer`: overlap gradient averaging with backward, on plain numpy arrays.

For frameworks other than PyTorch (see `gradsync.client.torch` for that one).
During backward, hand each gradient over as soon as it is ready:

    bucketer = GradientBucketer(client, bucket_cap_bytes=4 << 20)
    for step in ...:
        for name, grad in backward():          # last layer first
            bucketer.add(name, grad)           # copied into a daemon-owned bucket
        bucketer.wait()                        # grads now hold the average over ranks
        optimizer_step()

`add` copies the array into a bucket that lives in the daemon's shared memory
(`Client.empty`); a bucket whose contents reach `bucket_cap_bytes` goes to the
daemon at once (`all_reduce(async_op=True)`), so it is reduced while backward
computes the next gradients.  `wait` hands over the partly filled buckets,
waits for all of them and copies the results back into the arrays that were
added (read-only ones excepted), or, with `copy_back=False`, leaves them in
`result(name)`.  `wait` returns a `StepStats`: bytes, buckets, and how much of
the communication was hidden behind backward.

Rules, like torch DDP's:

- Every rank must add the same names, with the same shapes and dtypes, in the
  same order: the daemon matches buckets by their order of submission.  The
  first `wait` checks that all ranks built the same layout and raises
  `MismatchError` otherwise.
- The bucket layout is fixed by the first step.  Later steps must add the same
  names in the same order; anything else raises `InvalidArgumentError` at once.
- A bucket holds one dtype; arrays of different dtypes fill different buckets.
- Writing a gradient straight into `slot(name)` (a view into its bucket) and
  adding that view saves both copies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from typing import Any

import numpy as np

from gradsync.client.client import Client
from gradsync.client.work import Work
from gradsync.protocol.dtypes import ReduceOp
from gradsync.protocol.errors import InvalidArgumentError, MismatchError

DEFAULT_BUCKET_CAP_BYTES = 25 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Entry:
    """Where one named array lives in the layout."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    bucket: int
    offset: int  # in elements of the bucket's dtype

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclasses.dataclass
class _Bucket:
    dtype: np.dtype[Any]
    names: list[str]
    count: int
    buffer: np.ndarray | None = None
    filled: int = 0  # names added this step
    work: Work | None = None
    handed_over: float = 0.0  # time.monotonic() when the bucket went to the daemon


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one step synchronised, timed on CLOCK_MONOTONIC (the daemon's clock too).

    `comm_s` adds up each bucket's time from its hand-over to the daemon's
    `completed` timestamp; `hidden_s` is the part of it before `wait()` was
    called, i.e. behind backward; `exposed_s` is how long `wait()` blocked.
    """

    buckets: int
    bytes: int
    comm_s: float
    hidden_s: float
    exposed_s: float

    @property
    def hidden_share(self) -> float:
        """Fraction of the communication time hidden behind backward (0.0 if none, as
        `gradsync.client.torch.StepRecord.hidden_fraction`)."""
        return self.hidden_s / self.comm_s if self.comm_s > 0 else 0.0


class GradientBucketer:
    """Packs named numpy arrays into daemon-owned buckets and averages them across ranks."""

    def __init__(
        self,
        client: Client,
        bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
        op: str | ReduceOp = "avg",
        copy_back: bool = True,
    ) -> None:
        if bucket_cap_bytes <= 0:
            raise InvalidArgumentError(f"bucket_cap_bytes must be positive, got {bucket_cap_bytes}")
        self.client = client
        self.bucket_cap_bytes = int(bucket_cap_bytes)
        self.op = op
        self.copy_back = copy_back
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._order: list[str] = []
        self._buckets: list[_Bucket] = []
        self._fixed = False
        #: First step only: the buckets still open, by dtype, and what they hold.
        self._open: dict[np.dtype[Any], int] = {}
        self._staged: dict[str, np.ndarray] = {}
        #: This step: position in the order, the arrays to copy results into, and the
        #: buckets handed over, in order.
        self._position = 0
        self._targets: dict[str, np.ndarray] = {}
        self._submitted: list[int] = []
        self.steps = 0
        self.last_step: StepStats | None = None

    # -- layout ------------------------------------------------------------------

    @property
    def layout(self) -> list[Entry]:
        """The fixed layout, in the order arrays are added (empty before the first wait)."""
        return [self._entries[name] for name in self._order] if self._fixed else []

    @property
    def bucket_sizes(self) -> list[int]:
        """Bytes of each bucket, in order of creation (known after the first step)."""
        return [b.count * b.dtype.itemsize for b in self._buckets]

    @property
    def in_flight(self) -> int:
        """Buckets handed to the daemon so far in this step."""
        return len(self._submitted)

    def slot(self, name: str) -> np.ndarray:
        """`name`'s place in its bucket (after the first step): fill it and `add` it."""
        entry = self._entry(name)
        bucket = self._buckets[entry.bucket]
        if bucket.buffer is None:
            raise InvalidArgumentError(f"{name!r} has no bucket memory (it is empty)")
        return bucket.buffer[entry.offset : entry.offset + entry.size].reshape(entry.shape)

    def result(self, name: str) -> np.ndarray:
        """The reduced `name` after `wait()`: a view into its bucket, valid until the next add."""
        return self.slot(name)

    def _entry(self, name: str) -> Entry:
        if not self._fixed:
            raise InvalidArgumentError("the bucket layout is fixed by the first wait()")
        try:
            return self._entries[name]
        except KeyError:
            raise InvalidArgumentError(f"{name!r} is not in the bucket layout") from None

    # -- a step --------------------------------------------------------------------

    def add(self, name: str, array: np.ndarray) -> None:
        """Take `name`'s gradient; a bucket that this fills goes to the daemon at once."""
        if not isinstance(array, np.ndarray):
            raise InvalidArgumentError(f"{name!r}: expected a numpy array, got "
                                       f"{type(array).__name__}")
        with self._lock:
            if self._fixed:
                self._add_fixed(name, array)
            else:
                self._add_first(name, array)

    def _add_first(self, name: str, array: np.ndarray) -> None:
        if name in self._entries:
            raise InvalidArgumentError(f"{name!r} was added twice in one step")
        dtype = array.dtype
        self.client._check_array(np.empty(0, dtype), self.op)  # unsupported dtype/op: now
        self._order.append(name)
        self._targets[name] = array
        if array.size == 0:
            self._entries[name] = Entry(name, array.shape, dtype, -1, 0)
            return
        index = self._open.get(dtype)
        if index is None:
            index = len(self._buckets)
            self._buckets.append(_Bucket(dtype, [], 0))
            self._open[dtype] = index
        bucket = self._buckets[index]
        self._entries[name] = Entry(name, array.shape, dtype, index, bucket.count)
        bucket.names.append(name)
        bucket.count += int(array.size)
        self._staged[name] = np.array(array, copy=True)  # the caller may reuse its memory
        if bucket.count * dtype.itemsize >= self.bucket_cap_bytes:
            del self._open[dtype]
            self._submit(index)

    def _add_fixed(self, name: str, array: np.ndarray) -> None:
        if self._position >= len(self._order):
            raise InvalidArgumentError(
                f"{name!r} added after all {len(self._order)} arrays of the layout; "
                "call wait() to end the step"
            )
        expected = self._entries[self._order[self._position]]
        if name != expected.name:
            raise InvalidArgumentError(
                f"add #{self._position} of this step is {name!r}, but the layout fixed by the "
                f"first step expects {expected.name!r} there: every step (and every rank) "
                "must add the same names in the same order"
            )
        if array.shape != expected.shape or array.dtype != expected.dtype:
            raise InvalidArgumentError(
                f"{name!r} is {array.dtype}{list(array.shape)} but the layout fixed by the "
                f"first step has {expected.dtype}{list(expected.shape)}"
            )
        self._position += 1
        self._targets[name] = array
        if expected.size == 0:
            return
        bucket = self._buckets[expected.bucket]
        slot = bucket.buffer[expected.offset : expected.offset + expected.size]  # type: ignore[index]
        if not _same_memory(slot, array):
            np.copyto(slot, array.reshape(-1))
        bucket.filled += 1
        if bucket.filled == len(bucket.names):
            self._submit(expected.bucket)

    def _submit(self, index: int) -> None:
        bucket = self._buckets[index]
        if bucket.buffer is None:  # first step: the bucket's memory, filled from the copies
            bucket.buffer = self.client.empty(bucket.count, bucket.dtype)
            for name in bucket.names:
                entry = self._entries[name]
                staged = self._staged.pop(name)
                bucket.buffer[entry.offset : entry.offset + entry.size] = staged.reshape(-1)
        bucket.handed_over = time.monotonic()
        bucket.work = self.client.all_reduce(bucket.buffer, self.op, async_op=True)
        self._submitted.append(index)

    def wait(self) -> StepStats:
        """End the step: send what is left, wait for every bucket, deliver the results."""
        with self._lock:
            backward_done = time.monotonic()
            if self._fixed:
                if self._position != len(self._order):
                    missing = self._order[self._position :]
                    raise InvalidArgumentError(
                        f"wait() with {len(missing)} of the {len(self._order)} arrays of the "
                        f"layout not added yet (next: {missing[0]!r}); every step must add them all"
                    )
            else:
                for index in sorted(self._open.values()):
                    self._submit(index)
                self._open.clear()
            try:
                for index in self._submitted:
                    work = self._buckets[index].work
                    assert work is not None
                    work.wait()
            except BaseException:
                if not self._fixed:  # a failed first step fixes nothing
                    self._forget_layout()
                raise
            finally:
                finished = time.monotonic()
                submitted, self._submitted = self._submitted, []
                targets, self._targets = self._targets, {}
                self._position = 0
                for bucket in self._buckets:
                    bucket.filled = 0
            if not self._fixed:
                try:
                    self._check_same_layout()
                except BaseException:
                    self._forget_layout()
                    raise
                self._fixed = True
            if self.copy_back:
                for name, array in targets.items():
                    entry = self._entries[name]
                    if entry.size and array.flags.writeable:
                        view = self.slot(name)
                        if not _same_memory(view, array):
                            np.copyto(array, view)
            self.steps += 1
            self.last_step = self._stats(submitted, backward_done, finished)
            return self.last_step

    def _forget_layout(self) -> None:
        self._entries.clear()
        self._order.clear()
        self._buckets.clear()
        self._open.clear()
        self._staged.clear()

    def _stats(self, submitted: list[int], backward_done: float, finished: float) -> StepStats:
        comm = hidden = 0.0
        nbytes = 0
        for index in submitted:
            bucket = self._buckets[index]
            nbytes += bucket.count * bucket.dtype.itemsize
            timing = bucket.work.timing if bucket.work is not None else {}
            if "completed" in timing:
                start, end = bucket.handed_over, timing["completed"]
                comm += max(0.0, end - start)
                hidden += max(0.0, min(end, backward_done) - start)
        return StepStats(len(submitted), nbytes, comm, hidden, finished - backward_done)

    def _check_same_layout(self) -> None:
        """Every rank must have built the same layout; compare digests (one allreduce)."""
        description = repr([
            (e.name, e.shape, e.dtype.str, e.bucket, e.offset)
            for e in (self._entries[name] for name in self._order)
        ])
        digest = int.from_bytes(
            hashlib.blake2b(description.encode(), digest_size=7).digest(), "little"
        )
        both = self.client.empty(2, np.int64)
        both[...] = [digest, -digest]
        self.client.all_reduce(both, "max")
        if int(both[0]) != digest or int(both[1]) != -digest:
            raise MismatchError(
                f"rank {self.client.rank}: the ranks added different arrays to their "
                "GradientBucketer in the first step (names, shapes, dtypes or order differ); "
                "every rank must add the same names in the same order",
                {"rank": self.client.rank, "layout": description[:2000]},
            )


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """True when `b` is exactly the memory of `a` (a gradient written into its slot)."""
    return bool(
        a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.nbytes == b.nbytes
    )
