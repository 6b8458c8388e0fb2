"""torch DCP's checkpoint `Metadata`, encoded as msgpack without pickle.

DCP's own file system writer pickles its `Metadata` object; a checkpoint in
daemon memory stores plain data instead: per state-dict key either "bytes" or
a tensor's dtype, global size and chunks; the default planner's flattening map
(key -> path of str/int); where each stored item lies (`StoredItem`); and the
storage meta.  Anything else (a custom planner's `planner_data`) is refused
with an error that says so, rather than pickled.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgpack
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

FORMAT = "gradsync-dcp-1"


class StoredItem(NamedTuple):
    """Where one written item lies: `nbytes` at `offset` of part (`rank`, `item`);
    a tensor's dtype and shape (None for DCP's bytes items)."""

    rank: int
    item: str
    offset: int
    nbytes: int
    dtype: str | None
    shape: tuple[int, ...] | None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"checkpoint metadata names an unknown dtype {name!r}")
    return dtype


def _path(path: Any, key: str) -> list[str | int]:
    if not isinstance(path, tuple | list) or not all(
            isinstance(p, str | int) and not isinstance(p, bool) for p in path):
        raise ValueError(f"cannot store DCP planner data for {key!r} ({type(path).__name__}): "
                         "only the default planner's flattening map (str/int paths) is kept")
    return list(path)


def encode(metadata: Metadata) -> bytes:
    """`metadata` as msgpack bytes; raises ValueError for what it cannot carry."""
    state: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            state[key] = None
        else:
            state[key] = [dtype_name(entry.properties.dtype), list(entry.size),
                          [[list(c.offsets), list(c.sizes)] for c in entry.chunks]]
    planner = metadata.planner_data
    if planner is not None and not isinstance(planner, dict):
        raise ValueError(f"cannot store DCP planner data of type {type(planner).__name__}")
    storage = [
        [index.fqn, None if index.offset is None else list(index.offset), index.index,
         list(StoredItem(*where))]
        for index, where in (metadata.storage_data or {}).items()
    ]
    meta = metadata.storage_meta
    return msgpack.packb({
        "format": FORMAT,
        "version": metadata.version,
        "state": state,
        "planner": None if planner is None else {k: _path(v, k) for k, v in planner.items()},
        "storage": storage,
        "meta": None if meta is None else [
            None if meta.checkpoint_id is None else str(meta.checkpoint_id), meta.save_id,
            meta.load_id, list(meta.modules)],
    }, use_bin_type=True)


def decode(data: bytes) -> Metadata:
    """The `Metadata` that `encode` wrote."""
    body = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ValueError("not a gradsync DCP checkpoint metadata record")
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for key, entry in body["state"].items():
        if entry is None:
            state[key] = BytesStorageMetadata()
            continue
        dtype, size, chunks = entry
        state[key] = TensorStorageMetadata(
            TensorProperties(dtype=parse_dtype(dtype)), torch.Size(size),
            [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
    storage = {}
    for fqn, offset, index, where in body["storage"]:
        rank, item, at, nbytes, dtype, shape = where
        storage[MetadataIndex(fqn, None if offset is None else torch.Size(offset), index)] = (
            StoredItem(rank, item, at, nbytes, dtype, None if shape is None else tuple(shape)))
    planner = body["planner"]
    meta = body["meta"]
    return Metadata(
        state_dict_metadata=state,
        planner_data=None if planner is None else {k: tuple(v) for k, v in planner.items()},
        storage_data=storage,
        storage_meta=None if meta is None else StorageMeta(meta[0], meta[1], meta[2], meta[3]),
        version=body["version"],
    )
