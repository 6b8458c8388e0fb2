"""Latency and bandwidth of one link, measured when it comes up.

The alpha-beta cost model that picks an allreduce algorithm needs, per link,
the time of a small round trip (alpha) and the streaming rate (1/beta).  Both are measured
with real messages over the link itself: the median of a few small round
trips, then a few transfers of a multi-MiB payload that the peer acknowledges
once the whole message arrived.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple

#: Sends one probe (with these payload frames) and waits for the peer's answer.
RoundTrip = Callable[[Sequence[memoryview]], Awaitable[None]]

_CHUNK_BYTES = 1024 * 1024


class LinkStats(NamedTuple):
    """What was measured on a link: unpacks as `(rtt_s, bytes_per_s)`."""

    rtt_s: float
    bytes_per_s: float


def bulk_payload(nbytes: int) -> list[memoryview]:
    """`nbytes` of zeros as 1 MiB frames (one allocation, sliced without copies)."""
    data = memoryview(bytearray(nbytes))
    return [data[start : start + _CHUNK_BYTES] for start in range(0, nbytes, _CHUNK_BYTES)]


async def measure_link(
    round_trip: RoundTrip, rounds: int, payload: Sequence[memoryview]
) -> LinkStats:
    """Measure a link: the median RTT and the best streaming rate.

    One uncounted warm-up round trip, `rounds` empty ones, then two transfers
    of `payload`.  A transfer is charged its time less one RTT (the cost of
    the acknowledgement), so the rate estimates streaming, not one message's
    latency.  An empty `payload` gives a rate of 0.0.
    """
    await round_trip(())  # warm-up: first use of the connection, not counted
    rtts = []
    for _ in range(max(1, rounds)):
        start = time.perf_counter()
        await round_trip(())
        rtts.append(time.perf_counter() - start)
    rtt = statistics.median(rtts)
    nbytes = sum(view.nbytes for view in payload)
    rate = 0.0
    if nbytes:
        for _ in range(2):
            start = time.perf_counter()
            await round_trip(payload)
            elapsed = time.perf_counter() - start
            rate = max(rate, nbytes / max(elapsed - rtt, elapsed / 2, 1e-9))
    return LinkStats(rtt, rate)
