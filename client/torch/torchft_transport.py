"""torchft's checkpoint transport through the gradsync daemons, without pickle.

`Manager(pg=pg, checkpoint_transport=GradsyncTransport(pg, timeout), ...)` heals
a restarted replica from a live one over the quorum's own process group: the
state dict travels as one msgpack header and one flat payload (state_codec),
in a few large sends from and into daemon memory (shared memory between
replicas on one node, the daemons'
peer data streams between nodes), not as one send per tensor behind a pickled
header, as torchft's PGTransport does.  A DTensor travels as its local shard
and its mesh, placements, global shape and stride (as plain data); the healing
replica rebuilds it on its own mesh (`device_meshes`).  Imports torchft (as
torchft_group does).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Iterable
from typing import TypeVar

import torch
from torch.distributed.device_mesh import DeviceMesh
from torchft.checkpointing.transport import CheckpointTransport
from torchft.process_group import ProcessGroup

from gradsync.client.torch import backend, state_codec
from gradsync.client.torch.torchft_group import ProcessGroupGradsync

__all__ = ["GradsyncTransport", "Heal"]

_LOG = logging.getLogger("gradsync.torchft")

T = TypeVar("T")
#: The tags of a checkpoint's three messages: sizes, header, payload chunks (in order).
_SIZES, _HEADER, _PAYLOAD = 101, 102, 103
_CHUNK_BYTES = 16 << 20


def _metadata(version: int) -> str:
    """What a replica announces of its checkpoints: the codec's header version."""
    return f"gradsync-state-v{version}"


@dataclasses.dataclass(frozen=True)
class Heal:
    """One received checkpoint: from whom, which step, how many bytes, how long."""

    src_rank: int
    step: int
    payload_bytes: int
    seconds: float


class GradsyncTransport(CheckpointTransport[T]):  # type: ignore[misc]
    """Moves a state dict from a live replica to a healing one over `pg`'s send/recv.

    `pg` is the Manager's process group (ProcessGroupGradsync for the daemons'
    paths; any torchft group works).  `chunk_bytes` bounds one send.  A received
    DTensor lands on the mesh of `device_meshes` that equals its sender's (device
    type, ranks, shape, dim names: pass the model's meshes); for one none equals, a
    mesh is built over the default process group once and kept.
    """

    def __init__(self, pg: ProcessGroup, timeout: datetime.timedelta,
                 chunk_bytes: int = _CHUNK_BYTES,
                 device_meshes: Iterable[DeviceMesh] = ()) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
        self._pg = pg
        self._timeout = timeout
        self._chunk = chunk_bytes
        self._meshes = state_codec.Meshes(device_meshes)
        #: The last checkpoint this replica received (None until it heals).
        self.last_heal: Heal | None = None

    def metadata(self) -> str:
        return _metadata(state_codec.HEADER_VERSION)

    def disallow_checkpoint(self) -> None:
        """Nothing to withdraw: `send_checkpoint` returns once every send is done."""

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T,
                        timeout: datetime.timedelta) -> None:
        layout = state_codec.Layout(state_dict, step)
        sizes = torch.tensor([len(layout.header), layout.size], dtype=torch.int64)
        header = torch.frombuffer(bytearray(layout.header), dtype=torch.uint8)
        works = []
        for dst in dst_ranks:  # the receivers allocate while this side packs
            works.append(self._pg.send([sizes], dst, _SIZES))
            works.append(self._pg.send([header], dst, _HEADER))
        payload = self._allocate(layout.size)
        for start, chunk in self._chunks(payload):  # the daemon moves one while the next packs
            layout.pack(payload, start, start + chunk.numel())
            works += [self._pg.send([chunk], dst, _PAYLOAD) for dst in dst_ranks]
        for work in works:
            work.wait(timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: datetime.timedelta) -> T:
        readable = [_metadata(v) for v in state_codec.READABLE_VERSIONS]
        if metadata not in readable:
            raise state_codec.StateCodecError(
                f"replica rank {src_rank} sends checkpoints as {metadata!r}; this one reads "
                f"{', '.join(map(repr, readable))} (give every replica the same checkpoint "
                "transport)")
        started = time.perf_counter()
        sizes = torch.zeros(2, dtype=torch.int64)
        self._pg.recv([sizes], src_rank, _SIZES).wait(timeout)
        header_bytes, payload_bytes = (int(n) for n in sizes)
        if not 0 < header_bytes <= 1 << 30 or payload_bytes < 0:
            raise state_codec.StateCodecError(
                f"replica rank {src_rank} announced a {header_bytes}-byte header and a "
                f"{payload_bytes}-byte payload")
        header = torch.empty(header_bytes, dtype=torch.uint8)
        self._pg.recv([header], src_rank, _HEADER).wait(timeout)
        raw = header.numpy().tobytes()
        announced = state_codec.payload_size(raw)
        if announced != payload_bytes:
            raise state_codec.StateCodecError(
                f"replica rank {src_rank}: header announces {announced} payload bytes, the "
                f"sizes message {payload_bytes}")
        payload = self._allocate(payload_bytes)
        works = [self._pg.recv([chunk], src_rank, _PAYLOAD) for _, chunk in self._chunks(payload)]
        for work in works:
            work.wait(timeout)
        got_step, state = state_codec.decode(raw, payload, self._meshes)
        if got_step != step:
            raise state_codec.StateCodecError(
                f"replica rank {src_rank} sent the checkpoint of step {got_step}; this replica "
                f"heals to step {step}")
        self.last_heal = Heal(src_rank, step, payload_bytes, time.perf_counter() - started)
        _LOG.info("gradsync: healed to step %d from replica rank %d: %d bytes in %.3f s", step,
                  src_rank, payload_bytes, self.last_heal.seconds)
        return state  # type: ignore[no-any-return]

    def _allocate(self, nbytes: int) -> torch.Tensor:
        """A payload buffer: in daemon memory on a gradsync group (its sends and
        receives then copy nothing on this side), else ordinary memory."""
        group = (self._pg.quorum_group if isinstance(self._pg, ProcessGroupGradsync)
                 else None)
        if group is not None and nbytes:
            return backend.empty(nbytes, dtype=torch.uint8, group=group)
        return torch.empty(nbytes, dtype=torch.uint8)

    def _chunks(self, payload: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        return [(i, payload[i:i + self._chunk]) for i in range(0, payload.numel(), self._chunk)]
