"""A result the core settles once and `run/` awaits: the core's own future.

The core has no event loop (DESIGN.md): what it decides later (a job's
formation across daemons, an epoch's agreed link costs) it settles on an
`Outcome`, from whatever call brought the news.  `run/outcomes.py` turns one
into something a coroutine can await; core tests read it directly, with no loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Outcome", "UnsettledError"]

T = TypeVar("T")


class UnsettledError(RuntimeError):
    """The outcome was read before it was settled, or settled twice."""


class Outcome(Generic[T]):
    """Settled once, with a value or an error; callbacks run when it is."""

    __slots__ = ("_callbacks", "_error", "_settled", "_value")

    def __init__(self) -> None:
        self._settled = False
        self._value: T | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Outcome[T]], None]] = []

    def done(self) -> bool:
        return self._settled

    def set_result(self, value: T) -> None:
        self._settle(value, None)

    def set_exception(self, error: BaseException) -> None:
        self._settle(None, error)

    def result(self) -> T:
        """The value; raises the error it was settled with."""
        if not self._settled:
            raise UnsettledError("the outcome is not settled yet")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def exception(self) -> BaseException | None:
        if not self._settled:
            raise UnsettledError("the outcome is not settled yet")
        return self._error

    def add_done_callback(self, callback: Callable[[Outcome[T]], None]) -> None:
        """Call `callback(self)` once settled (at once if it is)."""
        if self._settled:
            callback(self)
        else:
            self._callbacks.append(callback)

    def _settle(self, value: T | None, error: BaseException | None) -> None:
        if self._settled:
            raise UnsettledError("the outcome is settled already")
        self._settled, self._value, self._error = True, value, error
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)
