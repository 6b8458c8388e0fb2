"""The state dict codec of the torchft checkpoint transport: one msgpack header,
one flat payload, no pickle; malformed input raises a clear error."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch

from gradsync.client.torch import state_codec
from gradsync.client.torch.state_codec import StateCodecError, decode, encode


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
    if isinstance(a, torch.Tensor):
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
