"""A state dict as one msgpack header and one flat byte payload, without pickle.

What a checkpoint transport moves: the header holds the tree (dicts, lists,
tuples, scalars, strings) with every tensor replaced by its dtype, shape and
place in the payload; the payload holds every tensor's bytes, each at a
64-byte aligned offset, so that the receiver rebuilds them as views of one
buffer.  Dict keys may be strings, ints, floats, bools or None (an optimizer's
state is keyed by parameter index); a module's OrderedDict comes back as one,
with its `_metadata` (the versions load_state_dict reads).  The header is decoded strictly: anything
malformed raises `StateCodecError` naming what is wrong where.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgpack
import torch

__all__ = ["HEADER_VERSION", "Layout", "StateCodecError", "decode", "encode", "payload_size"]

HEADER_VERSION = 1
ALIGN = 64
_SCALARS = (str, int, float, bool, bytes, type(None))
#: Every dtype a tensor leaf may have, by the name the header carries.
_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                  torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                  torch.complex64, torch.complex128)
}


class StateCodecError(ValueError):
    """A state dict that cannot be encoded, or a header that cannot be decoded."""


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


class _Encoder:
    def __init__(self) -> None:
        self.tensors: list[tuple[int, torch.Tensor]] = []  # (offset, contiguous tensor)
        self.size = 0

    def node(self, value: Any, path: str) -> list[Any]:
        if isinstance(value, torch.Tensor):
            return self.tensor(value, path)
        if isinstance(value, dict):
            items = []
            for key, item in value.items():
                if not isinstance(key, _SCALARS) or isinstance(key, bytes):
                    raise StateCodecError(f"state dict key {key!r} at {path or '/'} is a "
                                          f"{type(key).__name__}: keys are str, int, float, "
                                          "bool or None")
                items.append([key, self.node(item, f"{path}/{key}")])
            if isinstance(value, OrderedDict):  # a module's, with its version metadata
                metadata = getattr(value, "_metadata", None)
                return ["o", items, None if metadata is None
                        else self.node(dict(metadata), f"{path}/_metadata")]
            return ["d", items]
        if isinstance(value, (list, tuple)):
            tag = "l" if isinstance(value, list) else "t"
            return [tag, [self.node(item, f"{path}/{i}") for i, item in enumerate(value)]]
        if isinstance(value, _SCALARS):
            return ["v", value]
        raise StateCodecError(f"state dict leaf at {path or '/'} is a {type(value).__name__}: "
                              "only tensors, dicts, lists, tuples and scalars travel")

    def tensor(self, value: torch.Tensor, path: str) -> list[Any]:
        name = str(value.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise StateCodecError(f"tensor at {path} has dtype {value.dtype}, which does not "
                                  f"travel (dtypes: {', '.join(_DTYPES)})")
        if type(value) is not torch.Tensor:
            raise StateCodecError(f"tensor at {path} is a {type(value).__name__}: only plain "
                                  "tensors travel (gather a DTensor first)")
        flat = value.detach().cpu().contiguous()
        offset = _aligned(self.size)
        nbytes = flat.numel() * flat.element_size()
        self.tensors.append((offset, flat))
        self.size = offset + nbytes
        return ["T", name, list(flat.shape), offset, nbytes]


class Layout:
    """A state dict laid out: its header, its payload's size, and where each
    tensor's bytes go, so that the payload can be filled (and sent) in pieces."""

    def __init__(self, state: Any, step: int) -> None:
        encoder = _Encoder()
        tree = encoder.node(state, "")
        self.size = encoder.size
        self._tensors = [(offset, flat.reshape(-1).view(torch.uint8))
                         for offset, flat in encoder.tensors]
        self.header = bytes(msgpack.packb({"version": HEADER_VERSION, "step": step,
                                           "payload": encoder.size, "tree": tree},
                                          use_bin_type=True))

    def pack(self, payload: torch.Tensor, start: int = 0, end: int | None = None) -> None:
        """Copy the tensors' bytes that fall in payload[start:end] there."""
        stop = self.size if end is None else min(end, self.size)
        for offset, raw in self._tensors:
            first, last = max(start, offset), min(stop, offset + raw.numel())
            if first < last:
                payload[first:last].copy_(raw[first - offset:last - offset])


def encode(state: Any, step: int,
           allocate: Callable[[int], torch.Tensor] | None = None) -> tuple[bytes, torch.Tensor]:
    """(header, payload) of `state` at `step`; the payload is a new uint8 tensor,
    from `allocate(nbytes)` when given (daemon memory, so that sending copies nothing)."""
    layout = Layout(state, step)
    payload = (allocate or _host)(layout.size)
    layout.pack(payload)
    return layout.header, payload


def _host(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _unpack(header: bytes) -> dict[str, Any]:
    try:
        doc = msgpack.unpackb(header, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise StateCodecError(f"state header ({len(header)} bytes) is not msgpack: {exc}") \
            from exc
    if not isinstance(doc, dict) or doc.get("version") != HEADER_VERSION:
        version = doc.get("version") if isinstance(doc, dict) else None
        raise StateCodecError(f"state header version {version!r}; this gradsync reads "
                              f"version {HEADER_VERSION}")
    for key, kind in (("step", int), ("payload", int), ("tree", list)):
        if not isinstance(doc.get(key), kind) or isinstance(doc.get(key), bool):
            raise StateCodecError(f"state header's {key!r} is missing or not a {kind.__name__}")
    return doc


def payload_size(header: bytes) -> int:
    """The payload bytes the header announces, checked."""
    size: int = _unpack(header)["payload"]
    return size


def decode(header: bytes, payload: torch.Tensor) -> tuple[int, Any]:
    """(step, state) from `encode`'s output; tensors are views of `payload`."""
    doc = _unpack(header)
    if payload.dtype != torch.uint8 or payload.numel() != doc["payload"]:
        raise StateCodecError(f"state payload is {payload.numel()} {payload.dtype} elements; "
                              f"the header announces {doc['payload']} bytes")
    return doc["step"], _decode_node(doc["tree"], payload, "")


def _decode_node(node: Any, payload: torch.Tensor, path: str) -> Any:
    if not isinstance(node, list) or len(node) < 2 or not isinstance(node[0], str):
        raise StateCodecError(f"state header node at {path or '/'} is malformed: {node!r:.80}")
    tag = node[0]
    if tag == "v" and len(node) == 2 and isinstance(node[1], _SCALARS):
        return node[1]
    if tag in ("l", "t") and len(node) == 2 and isinstance(node[1], list):
        items = [_decode_node(item, payload, f"{path}/{i}") for i, item in enumerate(node[1])]
        return items if tag == "l" else tuple(items)
    if tag in ("d", "o") and len(node) == 2 + (tag == "o") and isinstance(node[1], list):
        out: dict[Any, Any] = {} if tag == "d" else OrderedDict()
        for item in node[1]:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], _SCALARS)):
                raise StateCodecError(f"state header dict item at {path or '/'} is malformed")
            out[item[0]] = _decode_node(item[1], payload, f"{path}/{item[0]!s}")
        if tag == "o" and node[2] is not None:
            metadata = _decode_node(node[2], payload, f"{path}/_metadata")
            out._metadata = metadata  # type: ignore[attr-defined]
        return out
    if tag == "T" and len(node) == 5:
        return _decode_tensor(node, payload, path)
    raise StateCodecError(f"state header node at {path or '/'} is malformed: {node!r:.80}")


def _decode_tensor(node: list[Any], payload: torch.Tensor, path: str) -> torch.Tensor:
    _, name, shape, offset, nbytes = node
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise StateCodecError(f"tensor at {path} has unknown dtype {name!r}")
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)
            and isinstance(offset, int) and isinstance(nbytes, int)):
        raise StateCodecError(f"tensor at {path}: malformed shape or place {node[2:]!r}")
    count = 1
    for n in shape:
        count *= n
    itemsize = torch.empty((), dtype=dtype).element_size()
    if (nbytes != count * itemsize or offset % ALIGN or offset < 0
            or offset + nbytes > payload.numel()):
        raise StateCodecError(f"tensor at {path}: {nbytes} bytes at {offset} do not fit "
                              f"shape {shape} of {name} in a {payload.numel()}-byte payload")
    return payload[offset:offset + nbytes].view(dtype).reshape(shape)
