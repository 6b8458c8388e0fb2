"""The state dict codec of the torchft checkpoint transport: one msgpack header,
one flat payload, no pickle; malformed input raises a clear error.  DTensors
travel on a 2-rank mesh of torch's in-process "fake" group (no peers, no daemon)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from gradsync.client.torch import state_codec
from gradsync.client.torch.state_codec import Meshes, MeshSpec, StateCodecError, decode, encode


def trained_state() -> dict[str, Any]:
    """What torchft's Manager sends: the user's model and optimizer, and its own step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 5)).sum().backward()
    optimizer.step()
    return {"user": {"model": model.state_dict(), "optim": optimizer.state_dict()},
            "torchft": {"step": 7, "batches_committed": 14}}


def assert_same(a: Any, b: Any, path: str = "") -> None:
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, DTensor):
        assert a._spec == b._spec, (path, a._spec, b._spec)
        assert_same(a.to_local(), b.to_local(), f"{path}/local")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            assert_same(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, path


def test_a_model_and_optimizer_state_round_trips_exactly() -> None:
    state = trained_state()
    header, payload = encode(state, 7)
    step, back = decode(header, payload)
    assert step == 7
    assert_same(state, back)
    # The optimizer's state is keyed by parameter index (int keys survive).
    assert sorted(back["user"]["optim"]["state"]) == [0, 1, 2, 3]
    assert back["user"]["optim"]["param_groups"][0]["lr"] == 0.1
    # A module's OrderedDict keeps its version metadata (load_state_dict reads it).
    model = state["user"]["model"]
    assert back["user"]["model"]._metadata == model._metadata and model._metadata


def test_every_dtype_shape_and_layout_round_trips() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {
        "transposed": base.t(),  # not contiguous: travels as its values
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "flags": torch.tensor([True, False, True]),
        "ints": torch.tensor([-(2 ** 40), 3], dtype=torch.int64),
        "bytes": torch.tensor([0, 255], dtype=torch.uint8),
        "complex": torch.tensor([1 + 2j], dtype=torch.complex64),
        "pair": (1, "two", None, True, 3.0, b"\x00\x01"),
        1.5: "float key", None: "none key", False: ["bool", "key"],
    }
    header, payload = encode(state, 0)
    _, back = decode(header, payload)
    assert_same(state, back)
    assert back["transposed"].is_contiguous()


def test_tensors_come_back_as_aligned_views_of_the_one_payload() -> None:
    header, payload = encode({"a": torch.ones(3, dtype=torch.int8), "b": torch.ones(5)}, 1)
    _, back = decode(header, payload)
    start = payload.data_ptr()
    for tensor in back.values():
        offset = tensor.data_ptr() - start
        assert 0 <= offset < payload.numel() and offset % state_codec.ALIGN == 0
    payload[state_codec.ALIGN:].zero_()  # "b" lives in the payload itself
    assert float(back["b"].sum()) == 0.0


def test_the_header_is_plain_msgpack() -> None:
    header, _ = encode({"w": torch.zeros(2)}, 3)
    doc = msgpack.unpackb(header, raw=False, strict_map_key=True)
    assert doc["version"] == state_codec.HEADER_VERSION and doc["step"] == 3
    assert doc["tree"] == ["d", [["w", ["T", "float32", [2], 0, 8]]]]


@pytest.mark.parametrize(("state", "words"), [
    ({"model": {"w": object()}}, ["/model/w", "object"]),
    ({("a", 1): torch.zeros(1)}, ["key", "tuple"]),
    ({"x": torch.zeros(2, dtype=torch.float8_e4m3fn)}, ["/x", "dtype"]),
])
def test_what_cannot_travel_is_named_with_its_path(state: Any, words: list[str]) -> None:
    with pytest.raises(StateCodecError) as caught:
        encode(state, 0)
    for word in words:
        assert word in str(caught.value), caught.value


def header_with(tree: Any, payload: int = 8, **overrides: Any) -> bytes:
    doc = {"version": state_codec.HEADER_VERSION, "step": 1, "payload": payload, "tree": tree,
           **overrides}
    return bytes(msgpack.packb(doc, use_bin_type=True))


@pytest.mark.parametrize(("header", "words"), [
    (b"\xc1garbage", ["not msgpack"]),
    (header_with(["v", 1], version=99), ["version 99"]),
    (header_with(["v", 1], step="one"), ["'step'"]),
    (header_with(["q", 1]), ["malformed"]),
    (header_with(["d", [["k"]]]), ["dict item"]),
    (header_with(["T", "float32", [4], 0, 16]), ["16 bytes at 0", "8-byte payload"]),
    (header_with(["T", "float32", [2], 4, 8]), ["8 bytes at 4"]),
    (header_with(["T", "float32", [3], 0, 8]), ["shape [3]"]),
    (header_with(["T", "pickle", [2], 0, 8]), ["unknown dtype 'pickle'"]),
    (header_with(["T", "float32", [-2], 0, 8]), ["malformed shape"]),
])
def test_a_malformed_header_raises_a_clear_error(header: bytes, words: list[str]) -> None:
    with pytest.raises(StateCodecError) as caught:
        decode(header, torch.zeros(8, dtype=torch.uint8))
    for word in words:
        assert word in str(caught.value), caught.value


def test_a_payload_of_the_wrong_size_is_refused() -> None:
    header, payload = encode({"w": torch.zeros(4)}, 0)
    with pytest.raises(StateCodecError, match="announces 16 bytes"):
        decode(header, payload[:8])


@pytest.fixture
def world() -> Iterator[None]:
    """This process as rank 1 of a 2-rank default group (torch's fake backend)."""
    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def dtensor_state() -> dict[str, Any]:
    """Rank 1's view of DTensors on 0-, 1- and 2-dim meshes, each placement kind."""
    flat = DeviceMesh("cpu", [0, 1], mesh_dim_names=("shard",))
    grid = DeviceMesh("cpu", [[0, 1]], mesh_dim_names=("replicate", "shard"))
    rows = torch.arange(6, dtype=torch.float32).reshape(3, 2)  # rank 1's rows 4..6 of 7
    return {
        "rows": DTensor.from_local(rows, flat, [Shard(0)], shape=(7, 2), stride=(2, 1)),
        "cols": DTensor.from_local(rows.t().contiguous(), grid, [Replicate(), Shard(1)],
                                   shape=(2, 6), stride=(6, 1)),
        "bias": DTensor.from_local(torch.ones(4, dtype=torch.bfloat16), flat, [Replicate()]),
        "grad": DTensor.from_local(torch.full((2,), 3.0), flat, [Partial("avg")]),
        "alone": distribute_tensor(torch.tensor([5, 6, 7]), DeviceMesh("cpu", 1), []),
        # Rank 1 outside the mesh: as torchft's transport test sends it, and as
        # from_local leaves it (empty); both come back as they were.
        "elsewhere": distribute_tensor(torch.tensor([5, 6, 7]), DeviceMesh("cpu", 0), []),
        "absent": DTensor.from_local(torch.ones(2, 2), DeviceMesh("cpu", [0]), [Shard(0)],
                                     shape=(2, 2), stride=(2, 1)),
        "plain": torch.zeros(3),
    }


def test_dtensors_round_trip_on_meshes_built_by_the_receiver(world: None) -> None:
    state = dtensor_state()
    header, payload = encode(state, 4)
    step, back = decode(header, payload)
    assert step == 4
    assert_same(state, back)  # spec: mesh, placements, global shape, stride, dtype
    assert back["elsewhere"].to_local().tolist() == [5, 6, 7]
    assert back["absent"].to_local().shape == (0,)
    assert back["rows"].device_mesh is not state["rows"].device_mesh
    assert tuple(back["rows"].device_mesh.get_coordinate() or ()) == (1,)
    start = payload.data_ptr()  # local tensors are views of the payload, as tensors are
    assert start <= back["rows"].to_local().data_ptr() < start + payload.numel()


def test_dtensors_land_on_the_receivers_own_meshes_and_built_ones_are_kept(world: None) -> None:
    state = dtensor_state()
    own = DeviceMesh("cpu", [0, 1], mesh_dim_names=("shard",))
    meshes = Meshes([own])
    header, payload = encode(state, 0)
    _, first = decode(header, payload, meshes)
    _, second = decode(header, payload, meshes)
    assert first["rows"].device_mesh is own and first["grad"].device_mesh is own
    assert first["cols"].device_mesh is second["cols"].device_mesh  # built once
    assert MeshSpec.of(own) == MeshSpec("cpu", (2,), (0, 1), ("shard",))


def test_the_dtensor_header_is_plain_data(world: None) -> None:
    header, _ = encode({"w": dtensor_state()["rows"]}, 1)
    doc = msgpack.unpackb(header, raw=False, strict_map_key=True)
    assert doc["tree"] == ["d", [["w", ["D", ["T", "float32", [3, 2], 0, 24],
                                        ["cpu", [2], [0, 1], ["shard"]], [["S", 0]],
                                        [7, 2], [2, 1]]]]]


def test_a_dtensor_without_a_mesh_to_land_on_is_refused_with_its_path(world: None) -> None:
    header, payload = encode({"m": {"w": dtensor_state()["rows"]}}, 0)
    dist.destroy_process_group()
    try:
        with pytest.raises(StateCodecError, match="DTensor at /m/w: no device mesh here"):
            decode(header, payload)
    finally:
        dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())


def test_a_placement_that_does_not_travel_is_named(world: None) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    strided = DTensor.from_local(torch.ones(2), mesh, [_StridedShard(0, split_factor=2)],
                                 shape=(4,), stride=(1,))
    with pytest.raises(StateCodecError, match=r"DTensor at /s has placement _StridedShard"):
        encode({"s": strided}, 0)


def dtensor_header(local: Any = None, mesh: Any = None, placements: Any = None,
                   shape: Any = None, stride: Any = None) -> bytes:
    """A header holding one DTensor at /w (a float32 [2] shard of [4] on a 2-rank mesh),
    with any of its parts replaced."""
    node = ["D", ["T", "float32", [2], 0, 8] if local is None else local,
            ["cpu", [2], [0, 1], None] if mesh is None else mesh,
            [["S", 0]] if placements is None else placements,
            [4] if shape is None else shape, [1] if stride is None else stride]
    return header_with(["d", [["w", node]]])


@pytest.mark.parametrize(("header", "words"), [
    (dtensor_header(local=["v", 1]), ["/w", "local tensor is not a tensor node"]),
    (dtensor_header(mesh=["cpu", [2], [0]]), ["/w", "malformed mesh"]),
    (dtensor_header(mesh=["cpu", [2], [0, 0], None]), ["/w", "distinct ranks"]),
    (dtensor_header(mesh=["c p u", [2], [0, 1], None]), ["/w", "malformed mesh"]),
    (dtensor_header(mesh=["cpu", [2], [0, 1], ["a", 1]]), ["/w", "dim names"]),
    (dtensor_header(placements=[["S", 1]]), ["/w", "malformed placement", "dim < 1"]),
    (dtensor_header(placements=[["P", "pickle"]]), ["/w", "malformed placement"]),
    (dtensor_header(placements=[["R"], ["R"]]), ["/w", "one per mesh dim (1)"]),
    (dtensor_header(placements=[["X"]]), ["/w", "malformed placement"]),
    (dtensor_header(shape=[4, 1], stride=[1, 1]),
     ["/w", "local shape [2] does not fit global shape [4, 1]"]),
    (dtensor_header(shape=[4], stride=[1, 1]), ["/w", "malformed global shape"]),
    (dtensor_header(stride=[True]), ["/w", "malformed global shape"]),
    (dtensor_header(shape=[1]), ["/w", "local shape [2] does not fit global shape [1]"]),
    (dtensor_header(placements=[["R"]], shape=[3]), ["/w", "local shape [2]"]),
])
def test_a_malformed_dtensor_raises_a_clear_error_naming_its_path(
        world: None, header: bytes, words: list[str]) -> None:
    with pytest.raises(StateCodecError) as caught:
        decode(header, torch.zeros(8, dtype=torch.uint8))
    for word in words:
        assert word in str(caught.value), caught.value


def test_a_version_1_header_still_decodes() -> None:
    header = header_with(["d", [["w", ["T", "float32", [2], 0, 8]]]], version=1)
    assert decode(header, torch.zeros(8, dtype=torch.uint8))[1]["w"].tolist() == [0.0, 0.0]
