"""The two-rank jobs that carry a process group's send and recv.

Each (src, dst, tag) is its own gradsync job of two ranks (src is its rank 0),
made on first use: a send and a receive match as a broadcast, in order, per tag.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from gradsync.client.client import Client
from gradsync.protocol.errors import InvalidArgumentError

__all__ = ["Connect", "PairJobs"]

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
