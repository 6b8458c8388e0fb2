"""The process group's rendezvous through its c10d store: names only, never data.

First the ranks agree on a fresh round (`fresh_round`): a random token that
names the group's gradsync job and prefixes every other key it writes.  A
store can outlive the processes that wrote to it: torchrun's restarts
(`--max-restarts`) hand the new workers the same store, still holding the
dead attempt's keys, so a key read without a fresh round could be a dead
rank's (gloo then dials a dead address and times out).  Then every rank
writes which daemon it talks to; from that each rank knows the job and its
local rank within the group.  Last, `all_joined` holds every rank until all
have joined the job, as gloo's constructor returns only once all are
connected: a rank that shuts its group down at once cannot close the job to
a rank that has not joined yet.
"""

from __future__ import annotations

import socket
import time
import uuid
from typing import Any

import torch.distributed as dist

from gradsync.client.ping import query
from gradsync.protocol.errors import GradsyncError

__all__ = ["all_joined", "fresh_round", "node_identities", "values"]

_POLL_S = (0.002, 0.05)


def values(store: Any, keys: list[str]) -> list[str]:
    """The store's values for `keys`, waiting (up to the store's timeout) for each."""
    found = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
    return [bytes(value).decode() for value in found]


def fresh_round(store: Any, rank: int, size: int, timeout_s: float) -> str:
    """A token every rank of this group formation agrees on, and no earlier one used.

    Each rank writes a fresh nonce.  Rank 0 reads them all (some may be stale,
    from a dead attempt) and proposes a token with the nonces it read; a rank
    acknowledges a proposal that carries its own nonce, and rank 0 confirms the
    first one all ranks acknowledged, else proposes again with what it reads
    then.  Keys named by a token are never stale.
    """
    token = uuid.uuid4().hex
    if size == 1:
        return token
    store.set(f"gradsync/nonce/{rank}", token)
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        return _propose(store, size, deadline, timeout_s)
    acked: str | None = None
    delay = _POLL_S[0]
    while True:
        proposal, _, nonces = values(store, ["gradsync/round"])[0].partition(" ")
        if proposal != acked and nonces.split(",")[rank:rank + 1] == [token]:
            store.add(f"gradsync/acks/{proposal}", 1)
            acked = proposal
        if acked is not None and store.check([f"gradsync/confirmed/{acked}"]):
            return acked
        _wait(deadline, timeout_s, rank)
        time.sleep(delay)
        delay = min(delay * 2, _POLL_S[1])


def _propose(store: Any, size: int, deadline: float, timeout_s: float) -> str:
    patience = 1.0  # a proposal with a stale nonce gets no acknowledgement from that rank
    while True:
        nonces = values(store, [f"gradsync/nonce/{r}" for r in range(size)])
        proposal = uuid.uuid4().hex
        store.set("gradsync/round", f"{proposal} {','.join(nonces)}")
        given_up = time.monotonic() + patience
        delay = _POLL_S[0]
        while store.add(f"gradsync/acks/{proposal}", 0) < size - 1:
            _wait(deadline, timeout_s, 0)
            if time.monotonic() > given_up:
                break
            time.sleep(delay)
            delay = min(delay * 2, _POLL_S[1])
        else:
            store.set(f"gradsync/confirmed/{proposal}", "1")
            return proposal
        patience = min(patience * 2, 10.0)


def _wait(deadline: float, timeout_s: float, rank: int) -> None:
    if time.monotonic() > deadline:
        raise dist.DistBackendError(
            f"gradsync: rank {rank} could not agree on a fresh rendezvous round with the "
            f"group's other ranks through the store within {timeout_s:g}s (the process "
            f"group's timeout): some rank never reached init_process_group/new_group")


def node_identities(store: Any, rank: int, size: int, daemon: str) -> list[str]:
    """Every rank's daemon identity, in rank order (who shares this node)."""
    try:
        welcome = query(daemon, 30.0)
    except GradsyncError as exc:
        raise dist.DistBackendError(f"gradsync: {exc}") from exc
    mine = f"{socket.gethostname()}|{daemon}|{welcome.get('pid')}"
    store.set(f"gradsync/node/{rank}", mine)
    return values(store, [f"gradsync/node/{r}" for r in range(size)])


def all_joined(store: Any, size: int) -> None:
    """Return once every rank of the group has called this (after joining its job).

    One counter and one key, so O(size) store traffic in all; waits up to the
    store's timeout (the process group's).
    """
    if size == 1:
        return
    if store.add("gradsync/joined", 1) == size:
        store.set("gradsync/all-joined", "1")
    try:
        values(store, ["gradsync/all-joined"])
    except dist.DistStoreError as exc:
        joined = store.add("gradsync/joined", 0)
        raise dist.DistBackendError(
            f"gradsync: only {joined} of the group's {size} ranks joined its job within the "
            f"store's timeout: some rank never finished init_process_group/new_group"
        ) from exc
