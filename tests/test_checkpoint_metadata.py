"""DCP's Metadata through gradsync's msgpack record (no pickle), without a daemon."""

from __future__ import annotations

import pickle

import pytest

torch = pytest.importorskip("torch", reason="torch is the optional extra gradsync[torch]")

from torch.distributed.checkpoint.metadata import (  # noqa: E402
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from gradsync.client.torch.checkpoint_metadata import StoredItem, decode, encode  # noqa: E402


def test_metadata_round_trips_with_sharded_chunks_and_bytes_items() -> None:
    chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 8])),
              ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 8]))]
    metadata = Metadata(
        state_dict_metadata={
            "model.w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16),
                                             torch.Size([4, 8]), chunks),
            "optim.param_groups": BytesStorageMetadata(),
        },
        planner_data={"model.w": ("model", "w"), "optim.param_groups": ("optim", "param_groups"),
                      "optim.state.0.step": ("optim", "state", 0, "step")},
        storage_data={
            MetadataIndex("model.w", torch.Size([0, 0]), 0):
                StoredItem(0, "data", 0, 32, "bfloat16", (2, 8)),
            MetadataIndex("model.w", torch.Size([2, 0]), 1):
                StoredItem(1, "data", 64, 32, "bfloat16", (2, 8)),
            MetadataIndex("optim.param_groups"): StoredItem(0, "data", 128, 300, None, None),
        },
        storage_meta=StorageMeta(checkpoint_id="7", save_id="s", modules=["m"]),
        version="1.0.0",
    )
    record = encode(metadata)
    assert b"\x80\x04" not in record[:2]  # msgpack, not a pickle stream
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(record)
    assert decode(record) == metadata
    assert decode(record).planner_data["optim.state.0.step"] == ("optim", "state", 0, "step")


def test_what_the_record_cannot_carry_is_refused_not_pickled() -> None:
    custom = Metadata(state_dict_metadata={}, planner_data={"k": object()})
    with pytest.raises(ValueError, match="only the default planner's flattening map"):
        encode(custom)
    with pytest.raises(ValueError, match="not a gradsync DCP checkpoint metadata"):
        decode(b"\x80")
