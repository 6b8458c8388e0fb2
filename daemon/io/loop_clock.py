"""The core's clock on the event loop: `time.monotonic` and `call_later`.

The core decides every deadline (core/deadlines.py) from a `Clock`; this is
the one the daemon runs on, so the loop only turns the core's timers into
callbacks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class LoopClock:
    """CLOCK_MONOTONIC seconds, and timers on `loop`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    @staticmethod
    def now() -> float:
        return time.monotonic()

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return self._loop.call_later(delay_s, callback)
