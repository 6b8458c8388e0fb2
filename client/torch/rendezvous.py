"""The process group's rendezvous through its c10d store: names only, never data.

Rank 0 writes a fresh job name, every rank writes which daemon it talks to;
from that each rank knows the job and its local rank within the group.
"""

from __future__ import annotations

import socket
import uuid
from typing import Any

import torch.distributed as dist

from gradsync.client.ping import query
from gradsync.protocol.errors import GradsyncError

__all__ = ["job_name", "node_identities"]


def job_name(store: Any, rank: int, base: str) -> str:
    """The group's gradsync job: `base` and a fresh suffix, chosen by rank 0."""
    key = "gradsync/job"
    if rank == 0:
        store.set(key, f"{base}/torch-{uuid.uuid4().hex[:12]}")
    return bytes(store.get(key)).decode()


def node_identities(store: Any, rank: int, size: int, daemon: str) -> list[str]:
    """Every rank's daemon identity, in rank order (who shares this node)."""
    try:
        welcome = query(daemon, 30.0)
    except GradsyncError as exc:
        raise dist.DistBackendError(f"gradsync: {exc}") from exc
    mine = f"{socket.gethostname()}|{daemon}|{welcome.get('pid')}"
    store.set(f"gradsync/node/{rank}", mine)
    keys = [f"gradsync/node/{r}" for r in range(size)]
    values = store.multi_get(keys) if hasattr(store, "multi_get") else [
        store.get(k) for k in keys
    ]
    return [bytes(v).decode() for v in values]
