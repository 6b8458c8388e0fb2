"""Recording of collective phases for `gradsync trace` (Chrome trace format).

While a trace is active the service and the cluster add one event per phase —
waiting for the local ranks, the local reduce, each inter-daemon step, the
write-back — on one track per job (and per peer link for inter-daemon steps).
Times are CLOCK_MONOTONIC seconds; the CLI converts them to the microseconds
Perfetto and chrome://tracing expect.
"""

from __future__ import annotations

import time
from typing import Any

#: Bound on events kept per trace, so a long trace cannot exhaust memory.
MAX_EVENTS = 200_000


class TraceRecorder:
    """Collects phase events while `active`; `take()` hands them over and stops."""

    def __init__(self) -> None:
        self._until = 0.0
        self._events: list[dict[str, Any]] = []
        self.dropped = 0

    @property
    def active(self) -> bool:
        return time.monotonic() < self._until

    def start(self, seconds: float) -> None:
        self._events = []
        self.dropped = 0
        self._until = time.monotonic() + seconds

    def add(self, track: str, name: str, start: float, end: float, **args: Any) -> None:
        if not self.active:
            return
        if len(self._events) >= MAX_EVENTS:
            self.dropped += 1
            return
        self._events.append({"track": track, "name": name, "start": start,
                             "end": max(end, start), "args": args})

    def take(self) -> list[dict[str, Any]]:
        self._until = 0.0
        events, self._events = self._events, []
        return events
