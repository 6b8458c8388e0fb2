"""A state dict kept as one checkpoint in the local daemon's memory (state_codec's format).

`StateCheckpoints(name).save(step, state)` copies the state once into a segment
the daemon owns (job `name`, one part: the header's length, the msgpack header,
the flat payload) and commits the step; `load(step)` returns that state again,
in this process's own memory, only from a complete checkpoint of exactly that
step.  The checkpoints outlive the process (and a daemon restart), so a
replica restarted on the same node finds its last steps (torchft_transport).
No pickle: state_codec's strict msgpack header.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from gradsync.client.checkpoints import DaemonCheckpoints, checkpoint_client
from gradsync.client.torch import state_codec

__all__ = ["StateCheckpoints", "StoredState"]

#: The one part of each checkpoint.
ITEM = "state"
#: The part: the header's length, the header, then (aligned) the payload.
_LENGTH = struct.Struct("<Q")


def _payload_offset(header_bytes: int) -> int:
    return -(-(_LENGTH.size + header_bytes) // state_codec.ALIGN) * state_codec.ALIGN


@dataclasses.dataclass(frozen=True)
class StoredState:
    """A state read back: its step, the state (in private memory), its payload size."""

    step: int
    state: Any
    payload_bytes: int


class StateCheckpoints:
    """The checkpoints of `name` (one writer: a replica's rank) in the local daemon
    (`daemon`, default the environment's: GRADSYNC_DAEMON)."""

    def __init__(self, name: str, daemon: str | None = None) -> None:
        if not name:
            raise ValueError("name the state's checkpoints (unique to the run and rank)")
        self.name = name
        self._daemon = daemon
        self._store: DaemonCheckpoints | None = None

    @property
    def store(self) -> DaemonCheckpoints:
        """The daemon's checkpoints of `name` (connected on first use)."""
        if self._store is None:
            self._store = DaemonCheckpoints(checkpoint_client(self.name, 0, self._daemon))
        return self._store

    def close(self) -> None:
        """End the session (the checkpoints stay in the daemon); a later call reconnects."""
        if self._store is not None:
            self._store.client.close()
            self._store = None

    def save(self, step: int, state: Any) -> int:
        """Store `state` as complete checkpoint `step`; its payload bytes.  Raises the
        daemon's error (a budget exceeded, a step already complete) unchanged."""
        layout = state_codec.Layout(state, step)
        start = _payload_offset(len(layout.header))
        mapping = self.store.put(step, ITEM, start + layout.size)
        try:
            mapping[:_LENGTH.size] = _LENGTH.pack(len(layout.header))
            mapping[_LENGTH.size:_LENGTH.size + len(layout.header)] = layout.header
            if layout.size:
                view = torch.frombuffer(mapping, dtype=torch.uint8, count=layout.size,
                                        offset=start)
                layout.pack(view)
                del view
        finally:
            mapping.close()
        self.store.commit(step, [(0, ITEM)])
        return layout.size

    def load(self, step: int,
             meshes: Callable[[state_codec.MeshSpec], DeviceMesh] | None = None) -> StoredState:
        """Complete checkpoint `step`, decoded into fresh memory (never a view of the
        daemon's segment; DTensors onto `meshes`, as `state_codec.decode`).  Raises
        the daemon's error when there is none of that step, `StateCodecError` when
        the part is not a state of that step."""
        opened = self.store.open(step)
        mappings = list(opened.parts.values())
        try:
            if opened.step != step or list(opened.parts) != [(0, ITEM)]:
                raise state_codec.StateCodecError(
                    f"checkpoint step {opened.step} of {self.name!r} holds parts "
                    f"{sorted(opened.parts)}, not one state of step {step}")
            header, payload = _read(mappings[0], self.name)
        finally:
            for mapping in mappings:
                mapping.close()
        got, state = state_codec.decode(header, payload, meshes)
        if got != step:
            raise state_codec.StateCodecError(
                f"checkpoint step {step} of {self.name!r} holds the state of step {got}")
        return StoredState(step, state, payload.numel())


def _read(mapping: mmap.mmap, name: str) -> tuple[bytes, torch.Tensor]:
    """The header and a private copy of the payload of one stored state."""
    if len(mapping) < _LENGTH.size:
        raise state_codec.StateCodecError(f"the state of {name!r} is {len(mapping)} bytes")
    (header_bytes,) = _LENGTH.unpack_from(mapping)
    start = _payload_offset(header_bytes)
    if start > len(mapping):
        raise state_codec.StateCodecError(
            f"the state of {name!r} announces a {header_bytes}-byte header in a "
            f"{len(mapping)}-byte part")
    header = bytes(mapping[_LENGTH.size:_LENGTH.size + header_bytes])
    size = state_codec.payload_size(header)
    if start + size > len(mapping):
        raise state_codec.StateCodecError(
            f"the state of {name!r} announces {size} payload bytes; its part holds "
            f"{len(mapping) - start}")
    payload = torch.empty(size, dtype=torch.uint8)
    if size:
        view = torch.frombuffer(mapping, dtype=torch.uint8, count=size, offset=start)
        payload.copy_(view)
        del view
    return header, payload
