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

With `local_checkpoints=NAME`, `save_local(manager)` after each committed step
keeps the Manager's state (what a healthy replica would send) as a checkpoint in
the local daemon (state_checkpoints.py; it outlives the process).  A replica
restarted on the same node then heals from it, without the state crossing the
group, when it holds exactly the quorum's step and the sender agrees: every heal
starts with the healing side's offer (has it, its step, its batches_committed)
and the sender's verdict (take yours, or here it comes).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.distributed.device_mesh import DeviceMesh
from torchft.checkpointing.transport import CheckpointTransport
from torchft.process_group import ProcessGroup

from gradsync.client.torch import backend, state_codec
from gradsync.client.torch.state_checkpoints import StateCheckpoints, StoredState
from gradsync.client.torch.torchft_group import ProcessGroupGradsync
from gradsync.protocol.errors import GradsyncError

if TYPE_CHECKING:
    from torchft.manager import Manager

__all__ = ["GradsyncTransport", "Heal"]

_LOG = logging.getLogger("gradsync.torchft")

T = TypeVar("T")
#: The tags of a checkpoint's three messages: sizes, header, payload chunks (in order).
_SIZES, _HEADER, _PAYLOAD = 101, 102, 103
#: The tags of a heal's first two: the healing side's offer, the sender's verdict.
_OFFER, _VERDICT = 104, 105
#: The end of the metadata of a replica that waits for offers.
_OFFERS = "+offer"
_CHUNK_BYTES = 16 << 20


def _metadata(version: int, offer: bool) -> str:
    """What a replica announces of its checkpoints: the codec's header version, and
    whether its heals start with the healing side's offer (it keeps local ones)."""
    return f"gradsync-state-v{version}{_OFFERS if offer else ''}"


@dataclasses.dataclass(frozen=True)
class Heal:
    """One heal: from whom, which step, how many bytes, how long, and whether the
    state came from `src_rank` over the group ("network") or from this node's
    daemon ("local": nothing of the state crossed the group)."""

    src_rank: int
    step: int
    payload_bytes: int
    seconds: float
    source: str = "network"


class GradsyncTransport(CheckpointTransport[T]):  # type: ignore[misc]
    """Moves a state dict from a live replica to a healing one over `pg`'s send/recv.

    `pg` is the Manager's process group (ProcessGroupGradsync for the daemons'
    paths; any torchft group works).  `chunk_bytes` bounds one send.  A received
    DTensor lands on the mesh of `device_meshes` that equals its sender's (device
    type, ranks, shape, dim names: pass the model's meshes); for one none equals, a
    mesh is built over the default process group once and kept.
    `local_checkpoints`: the name this rank's states are kept under in the local
    daemon by `save_local` (unique to the run, the replica group and the rank, the
    same after a restart); None keeps none and heals over the group only.
    """

    def __init__(self, pg: ProcessGroup, timeout: datetime.timedelta,
                 chunk_bytes: int = _CHUNK_BYTES,
                 device_meshes: Iterable[DeviceMesh] = (),
                 local_checkpoints: str | None = None) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
        self._pg = pg
        self._timeout = timeout
        self._chunk = chunk_bytes
        self._meshes = state_codec.Meshes(device_meshes)
        #: This rank's states kept in the local daemon (None without local_checkpoints).
        self.local = None if local_checkpoints is None else StateCheckpoints(local_checkpoints)
        self._saved_step: int | None = None
        #: The last checkpoint this replica received (None until it heals).
        self.last_heal: Heal | None = None
        #: Payload bytes this replica sent to healing ones (0: every heal was local).
        self.sent_bytes = 0

    def metadata(self) -> str:
        return _metadata(state_codec.HEADER_VERSION, self.local is not None)

    def disallow_checkpoint(self) -> None:
        """Nothing to withdraw: `send_checkpoint` returns once every send is done."""

    def shutdown(self, wait: bool = True) -> None:
        """Close the local checkpoints' session (Manager.shutdown calls this); the
        checkpoints stay in the daemon."""
        if self.local is not None:
            self.local.close()

    def save_local(self, manager: Manager) -> bool:
        """Keep the Manager's state at its current step in the local daemon (call after
        each `optimizer.step()`; a step already kept is skipped).  False, with a
        warning, when the daemon refuses it (its budget): training goes on."""
        if self.local is None:
            raise ValueError("GradsyncTransport(..., local_checkpoints=NAME) keeps local "
                             "checkpoints; this one has no name")
        step = manager.current_step()
        if step == self._saved_step:
            return True
        try:
            self.local.save(step, manager._manager_state_dict())
        except GradsyncError as exc:
            _LOG.warning("gradsync: step %d not kept in the local daemon: %s", step, exc)
            return False
        self._saved_step = step
        return True

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T,
                        timeout: datetime.timedelta) -> None:
        """Send the state to each healing replica (keeping local checkpoints: to each
        whose offer of its own this side turned down)."""
        if self.local is not None:
            dst_ranks = self._verdicts(dst_ranks, step, state_dict, timeout)
        if not dst_ranks:
            return
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
        self.sent_bytes += layout.size * len(dst_ranks)

    def _verdicts(self, dst_ranks: list[int], step: int, state_dict: Any,
                  timeout: datetime.timedelta) -> list[int]:
        """Receive each healing replica's offer, answer it; the ranks to send to.  A
        replica keeps its own state only if it holds this step with the same
        batches_committed as this one (the same history)."""
        offers = {dst: torch.zeros(3, dtype=torch.int64) for dst in dst_ranks}
        for work in [self._pg.recv([offer], dst, _OFFER) for dst, offer in offers.items()]:
            work.wait(timeout)
        ours = _progress(state_dict)
        verdicts = {dst: torch.tensor([int(
            ours == (step, int(offer[2])) and int(offer[0]) == 1 and int(offer[1]) == step)],
            dtype=torch.int64) for dst, offer in offers.items()}
        for work in [self._pg.send([v], dst, _VERDICT) for dst, v in verdicts.items()]:
            work.wait(timeout)
        return [dst for dst, verdict in verdicts.items() if not int(verdict[0])]

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: datetime.timedelta) -> T:
        readable = [_metadata(v, offer) for v in state_codec.READABLE_VERSIONS
                    for offer in (False, True)]
        if metadata not in readable:
            raise state_codec.StateCodecError(
                f"replica rank {src_rank} sends checkpoints as {metadata!r}; this one reads "
                f"{', '.join(map(repr, readable))} (give every replica the same checkpoint "
                "transport)")
        started = time.perf_counter()
        local = self._offer(src_rank, step, timeout) if metadata.endswith(_OFFERS) else None
        if local is not None:
            self._saved_step = step  # kept already
            return self._healed(Heal(src_rank, step, local.payload_bytes,
                                     time.perf_counter() - started, "local"), local.state)
        payload_bytes, state = self._receive(src_rank, step, timeout)
        return self._healed(Heal(src_rank, step, payload_bytes, time.perf_counter() - started),
                            state)

    def _offer(self, src_rank: int, step: int,
               timeout: datetime.timedelta) -> StoredState | None:
        """Offer `src_rank` this rank's local checkpoint of `step` (or say there is none);
        the checkpoint if the sender agrees, else None (it sends its state)."""
        local = self._stored(step)
        progress = _progress(local.state) if local is not None else None
        offer = torch.tensor([1, *progress] if progress else [0, -1, -1], dtype=torch.int64)
        self._pg.send([offer], src_rank, _OFFER).wait(timeout)
        verdict = torch.zeros(1, dtype=torch.int64)
        self._pg.recv([verdict], src_rank, _VERDICT).wait(timeout)
        return local if progress and int(verdict[0]) == 1 else None

    def _stored(self, step: int) -> StoredState | None:
        """This rank's local checkpoint of exactly `step`, if the daemon holds one."""
        if self.local is None:
            return None
        try:
            return self.local.load(step, self._meshes)
        except (GradsyncError, state_codec.StateCodecError) as exc:
            _LOG.info("gradsync: no local checkpoint of step %d to heal from: %s", step, exc)
            return None

    def _healed(self, heal: Heal, state: Any) -> T:
        self.last_heal = heal
        _LOG.info("gradsync: healed to step %d (%s, replica rank %d): %d bytes in %.3f s",
                  heal.step, heal.source, heal.src_rank, heal.payload_bytes, heal.seconds)
        return state  # type: ignore[no-any-return]

    def _receive(self, src_rank: int, step: int, timeout: datetime.timedelta) -> tuple[int, Any]:
        """The state `src_rank` sends: (its payload bytes, the state)."""
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
        return payload_bytes, state

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


def _progress(state: Any) -> tuple[int, int] | None:
    """(step, batches_committed) of a Manager's state dict (its "torchft" part)."""
    ours = state.get("torchft") if isinstance(state, dict) else None
    if not isinstance(ours, dict):
        return None
    step, batches = ours.get("step"), ours.get("batches_committed")
    if type(step) is not int or type(batches) is not int:
        return None
    return step, batches
