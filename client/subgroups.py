"""Sub-groups of a job (torch's `new_group`): their job names and the node's ranks.

A sub-group is an independent job in the daemons; every rank of the parent
names it the same way (the parent's job, a counter, a digest of the members),
so the daemons match its members without any further exchange.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

from gradsync.client.connection import Connection
from gradsync.protocol.codec import is_integer
from gradsync.protocol.errors import CollectiveTimeoutError, InvalidArgumentError

__all__ = ["group_job", "local_ranks"]


def group_job(
    job: str, world_size: int, created: int, ranks: Sequence[int]
) -> tuple[list[int], str]:
    """The members, checked, and the job name of the `created`-th sub-group of `job`."""
    members = list(ranks)
    if not members or len(set(members)) != len(members) or not all(
        is_integer(r) and 0 <= r < world_size for r in members
    ):
        raise InvalidArgumentError(
            f"new_group needs distinct ranks in [0, {world_size}), got {members!r}"
        )
    digest = hashlib.blake2b(",".join(map(str, members)).encode(), digest_size=6).hexdigest()
    return members, f"{job}/g{created}-{digest}"


def local_ranks(
    connection: Connection, job: str, local_world_size: int, timeout_s: float, call_timeout_s: float
) -> set[int]:
    """The job's ranks on this node, once all of them have connected to the daemon."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while True:
        reply = connection.call("group_info", timeout_s=call_timeout_s)
        if reply.get("complete"):
            return set(reply.get("members", []))
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(
                f"new_group: not all {local_world_size} local ranks of job "
                f"{job!r} connected to the daemon in time"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
