"""Checkpoints kept in the daemon's memory, for any framework (torch DCP: see
`gradsync.client.torch.checkpoint`).

A checkpoint is (job, step): each rank puts its parts into segments the
daemon creates and owns (they outlive this process), writes them through its
own mapping, and one rank commits the step once every rank's parts are in.
Only committed checkpoints can be opened; the daemon keeps each job's newest
few (`--checkpoints-kept`).  Only sessions of the job itself may use them:
a `Client` of the checkpoints' job, or one from `checkpoint_client(job, rank)`.
"""

from __future__ import annotations

import dataclasses
import mmap
from typing import Any

from gradsync.client.client import Client
from gradsync.protocol.requests import checkpoint_session_job, parse_checkpoint_session_job
from gradsync.protocol.shm import map_segment


def checkpoint_client(job: str, rank: int, daemon: str | None = None) -> Client:
    """A client that stores rank `rank`'s checkpoints of `job`: a session of its own
    (job `checkpoint:JOB#RANK`, world size 1), so that no rank lost elsewhere ends it."""
    return Client(daemon=daemon, job=checkpoint_session_job(job, rank), rank=0, world_size=1,
                  local_rank=0, local_world_size=1)


@dataclasses.dataclass
class OpenedCheckpoint:
    """A complete checkpoint, mapped: its parts by (rank, item)."""

    step: int
    parts: dict[tuple[int, str], mmap.mmap]


class DaemonCheckpoints:
    """Put, commit, list and open the checkpoints of `client`'s job on its daemon."""

    def __init__(self, client: Client, job: str | None = None) -> None:
        self.client = client
        scope = parse_checkpoint_session_job(client.job)
        #: The checkpoints' job (by default the client's), and the rank whose parts
        #: this client puts.  The daemon refuses a job that is not the client's.
        self.job, self.rank = scope if scope is not None else (client.job, client.rank)
        self.job = job or self.job

    def put(self, step: int, item: str, nbytes: int) -> mmap.mmap:
        """A daemon-owned segment of at least `nbytes` for this rank's `item` of `step`,
        mapped here to be written.  Over the daemon's budget: `ShmExhaustedError`."""
        reply = self.client.call("ckpt_put", job=self.job, step=step, item=item,
                                 nbytes=max(1, nbytes))
        return map_segment(reply["name"], reply["nbytes"])

    def commit(self, step: int, parts: list[tuple[int, str]]) -> dict[str, Any]:
        """Mark `step` complete: every (rank, item) in `parts` was put and written."""
        return self.client.call("ckpt_commit", job=self.job, step=step,
                                parts=[[rank, item] for rank, item in parts])

    def list(self) -> list[dict[str, Any]]:
        """The complete checkpoints (step, bytes, age_s, ranks), newest first."""
        return list(self.client.call("ckpt_list", job=self.job)["checkpoints"])

    def open(self, step: int | None = None) -> OpenedCheckpoint:
        """Map complete checkpoint `step` (None: the newest) for reading.  The mappings
        stay valid even if the daemon drops the checkpoint meanwhile."""
        reply = self.client.call("ckpt_open", job=self.job, step=step)
        parts = {(rank, item): map_segment(name, nbytes)
                 for rank, item, name, nbytes in reply["parts"]}
        return OpenedCheckpoint(int(reply["step"]), parts)
