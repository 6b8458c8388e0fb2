"""Reduction work inline or on the daemon's thread pool, by the memory it touches.

Both the collective runs (runs.py) and the inter-daemon phase (multi_node.py) use
one `Offload`: a thread hand-off costs more than reducing a few hundred KiB on
the event loop, and large work must not stall it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable


class Offload:
    """Runs a piece of work inline when small, else on the thread pool."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 executor: concurrent.futures.ThreadPoolExecutor, inline_bytes: int) -> None:
        self.loop = loop
        self.executor = executor
        #: Work touching at most this many bytes runs on the event loop.
        self.inline_bytes = inline_bytes

    async def run(self, work: Callable[[], None], nbytes: int) -> None:
        """Run `work` inline when it touches little memory, else on the thread pool."""
        if nbytes <= self.inline_bytes:
            work()
        else:
            await self.loop.run_in_executor(self.executor, work)
