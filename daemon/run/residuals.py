"""Error feedback: each daemon's rounding residuals, per job and buffer.

With `error_feedback` a compressed collective's sends record, per element,
what rounding took away (`value - rounded`, finite only) in a residual array
kept for that buffer; the next collective on the same buffer adds it to the
node's sum before its inter-daemon phase.  Over many calls the results then
sum to the exact sums up to the residual still held (bounded), as in
error-feedback SGD.  A buffer is the job's lowest local rank's slot (its
segment, address and size: a DDP bucket from step to step); a residual is
dropped once that segment is freed, and the bytes held are in the statistics.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

#: (job, segment, address in the daemon, element count, dtype, format).
ResidualKey = tuple[str, int, int, int, str, str]


class Residuals:
    """Residual arrays by buffer; `alive(segment)` says whether a segment still exists."""

    def __init__(self, alive: Callable[[int], bool]) -> None:
        self._alive = alive
        self._held: dict[ResidualKey, np.ndarray] = {}

    def take(self, key: ResidualKey, dtype: np.dtype) -> np.ndarray:
        """The residual of `key`'s buffer (zeros the first time)."""
        self.prune()
        residual = self._held.get(key)
        if residual is None:
            residual = self._held[key] = np.zeros(key[3], dtype)
        return residual

    def prune(self) -> None:
        """Drop the residuals of freed segments."""
        for key in [key for key in self._held if not self._alive(key[1])]:
            del self._held[key]

    def forget_job(self, job: str) -> None:
        for key in [key for key in self._held if key[0] == job]:
            del self._held[key]

    def snapshot(self) -> dict[str, int]:
        """Buffers with a residual, and the bytes held for them."""
        self.prune()
        return {"buffers": len(self._held),
                "bytes_held": sum(array.nbytes for array in self._held.values())}


def fold_in(work: np.ndarray, residual: np.ndarray) -> None:
    """Add the residual to the node's sum and start it afresh."""
    with np.errstate(all="ignore"):
        np.add(work, residual, out=work)
    residual.fill(0)


def record(residual: np.ndarray, before: np.ndarray, after: np.ndarray) -> None:
    """Add what rounding `before` to `after` took away; non-finite differences count 0."""
    with np.errstate(all="ignore"):
        taken = before - after
    taken[~np.isfinite(taken)] = 0
    residual += taken
