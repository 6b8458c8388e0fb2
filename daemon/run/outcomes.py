"""Awaiting a core `Outcome` on the event loop (the core itself has no loop)."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from gradsync.daemon.core.outcome import Outcome

__all__ = ["settled"]

T = TypeVar("T")


async def settled(outcome: Outcome[T], timeout_s: float) -> T:
    """The outcome's value once it is settled (its error raised), within `timeout_s`
    (`TimeoutError` after).  Giving up, by timeout or cancellation, leaves the outcome
    as it is, for others to await: the core settles it, never a waiter."""
    if outcome.done():
        return outcome.result()
    future: asyncio.Future[T] = asyncio.get_running_loop().create_future()

    def copy(done: Outcome[T]) -> None:
        if future.done():  # the waiter gave up already
            return
        error = done.exception()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(done.result())

    outcome.add_done_callback(copy)
    return await asyncio.wait_for(future, max(0.0, timeout_s))
