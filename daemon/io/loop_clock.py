"""The core's clock on the event loop: `time.monotonic` and `call_later`.

The core decides every deadline (core/deadlines.py) from a `Clock`; this is
the one the daemon runs on, so the loop only turns the core's timers into
callbacks.  It counts the timers armed and neither fired nor cancelled
(`armed`, the `deadline_timers` counter): a collective that failed or
matched must leave none behind.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class LoopClock:
    """CLOCK_MONOTONIC seconds, and timers on `loop`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        #: Timers armed and neither fired nor cancelled yet.
        self.armed = 0

    @staticmethod
    def now() -> float:
        return time.monotonic()

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> ArmedTimer:
        return ArmedTimer(self, delay_s, callback)


class ArmedTimer:
    """One timer of a `LoopClock`, counted there until it fires or is cancelled."""

    def __init__(self, clock: LoopClock, delay_s: float, callback: Callable[[], None]) -> None:
        self._clock = clock
        self._settled = False
        clock.armed += 1
        self._handle = clock._loop.call_later(delay_s, self._fire, callback)

    def _fire(self, callback: Callable[[], None]) -> None:
        self._settle()
        callback()

    def cancel(self) -> None:
        self._settle()
        self._handle.cancel()

    def _settle(self) -> None:
        if not self._settled:
            self._settled = True
            self._clock.armed -= 1
