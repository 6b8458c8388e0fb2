"""A state dict as one msgpack header and one flat byte payload, without pickle.

What a checkpoint transport moves: the header holds the tree (dicts, lists,
tuples, scalars, strings) with every tensor replaced by its dtype, shape and
place in the payload; the payload holds every tensor's bytes, each at a
64-byte aligned offset, so that the receiver rebuilds them as views of one
buffer.  Dict keys may be strings, ints, floats, bools or None (an optimizer's
state is keyed by parameter index); a module's OrderedDict comes back as one,
with its `_metadata` (the versions load_state_dict reads).  A DTensor travels as
its local tensor (like any tensor) plus its device mesh (device type, shape,
ranks, dim names), placements (Shard(dim), Replicate(), Partial(reduce_op)) and
global shape and stride, as plain data; the receiver rebuilds it with
`DTensor.from_local` on a mesh of its own (see `Meshes`).  The header is
decoded strictly: anything malformed raises `StateCodecError` naming what is
wrong where.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import msgpack
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

__all__ = ["HEADER_VERSION", "READABLE_VERSIONS", "Layout", "MeshSpec", "Meshes",
           "StateCodecError", "decode", "encode", "payload_size"]

#: The version this gradsync writes (2: DTensor nodes); it reads every READABLE_VERSIONS.
HEADER_VERSION = 2
READABLE_VERSIONS = (1, 2)
ALIGN = 64
_SCALARS = (str, int, float, bool, bytes, type(None))
#: Every dtype a tensor leaf may have, by the name the header carries.
_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                  torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                  torch.complex64, torch.complex128)
}


#: Partial's reduce ops (torch.distributed.tensor.Partial's documented values).
_REDUCE_OPS = frozenset({"sum", "avg", "min", "max", "product", "band", "bor", "bxor"})
_DEVICE_TYPE = re.compile(r"[a-z][a-z0-9_]{0,31}")


class StateCodecError(ValueError):
    """A state dict that cannot be encoded, or a header that cannot be decoded."""


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """A device mesh as the header carries it: device type, shape, the ranks in
    row-major order, and the dim names (None when unnamed)."""

    device_type: str
    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    dim_names: tuple[str, ...] | None

    @classmethod
    def of(cls, mesh: DeviceMesh) -> MeshSpec:
        """The spec of `mesh`."""
        names = mesh.mesh_dim_names
        return cls(mesh.device_type, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()),
                   None if names is None else tuple(names))

    def build(self) -> DeviceMesh:
        """A DeviceMesh over this process's default group (which must exist)."""
        ranks = torch.tensor(self.ranks, dtype=torch.int).reshape(self.shape)
        return DeviceMesh(self.device_type, ranks, mesh_dim_names=self.dim_names)


class Meshes:
    """The receiver's device meshes: a DTensor lands on the one whose spec equals the
    sent mesh's; for a spec none matches, one mesh is built (over the default process
    group: on every rank of the receiving group alike) and kept for later heals."""

    def __init__(self, meshes: Iterable[DeviceMesh] = ()) -> None:
        self._meshes = {MeshSpec.of(mesh): mesh for mesh in meshes}
        self._lock = threading.Lock()

    def __call__(self, spec: MeshSpec) -> DeviceMesh:
        with self._lock:
            mesh = self._meshes.get(spec)
            if mesh is None:
                if not dist.is_initialized():
                    raise StateCodecError(
                        f"no device mesh here matches {spec} and there is no default process "
                        "group to build one on (init_process_group, or pass the mesh)")
                mesh = self._meshes[spec] = spec.build()
            return mesh


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


class _Encoder:
    def __init__(self) -> None:
        self.tensors: list[tuple[int, torch.Tensor]] = []  # (offset, contiguous tensor)
        self.size = 0

    def node(self, value: Any, path: str) -> list[Any]:
        if isinstance(value, DTensor):
            return self.dtensor(value, path)
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
                                  "tensors and DTensors travel")
        flat = value.detach().cpu().contiguous()
        offset = _aligned(self.size)
        nbytes = flat.numel() * flat.element_size()
        self.tensors.append((offset, flat))
        self.size = offset + nbytes
        return ["T", name, list(flat.shape), offset, nbytes]

    def dtensor(self, value: DTensor, path: str) -> list[Any]:
        """["D", local tensor, [device type, mesh shape, ranks, dim names], placements,
        global shape, global stride]."""
        placements = [_placement(p, path) for p in value.placements]
        if not DTensorSpec.is_default_device_order(value._spec.shard_order):
            raise StateCodecError(f"DTensor at {path} has shard order "
                                  f"{value._spec.shard_order}: only the default one travels")
        mesh = MeshSpec.of(value.device_mesh)
        return ["D", self.tensor(value.to_local().detach(), path),
                [mesh.device_type, list(mesh.shape), list(mesh.ranks),
                 None if mesh.dim_names is None else list(mesh.dim_names)],
                placements, list(value.shape), list(value.stride())]


def _placement(placement: Placement, path: str) -> list[Any]:
    if type(placement) is Shard:
        return ["S", placement.dim]
    if type(placement) is Replicate:
        return ["R"]
    if type(placement) is Partial and placement.reduce_op in _REDUCE_OPS:
        return ["P", placement.reduce_op]
    raise StateCodecError(f"DTensor at {path} has placement {placement!r}: only Shard(dim), "
                          "Replicate() and Partial(reduce_op) travel (redistribute it first)")


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
    version = doc.get("version") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or type(version) is not int or version not in READABLE_VERSIONS:
        raise StateCodecError(f"state header version {version!r}; this gradsync reads "
                              f"versions {', '.join(map(str, READABLE_VERSIONS))}")
    for key, kind in (("step", int), ("payload", int), ("tree", list)):
        if not isinstance(doc.get(key), kind) or isinstance(doc.get(key), bool):
            raise StateCodecError(f"state header's {key!r} is missing or not a {kind.__name__}")
    return doc


def payload_size(header: bytes) -> int:
    """The payload bytes the header announces, checked."""
    size: int = _unpack(header)["payload"]
    return size


def decode(header: bytes, payload: torch.Tensor,
           meshes: Callable[[MeshSpec], DeviceMesh] | None = None) -> tuple[int, Any]:
    """(step, state) from `encode`'s output; tensors (and DTensors' local tensors) are
    views of `payload`; a DTensor lands on `meshes(spec)` (default: a new `Meshes()`)."""
    doc = _unpack(header)
    if payload.dtype != torch.uint8 or payload.numel() != doc["payload"]:
        raise StateCodecError(f"state payload is {payload.numel()} {payload.dtype} elements; "
                              f"the header announces {doc['payload']} bytes")
    decoder = _Decoder(payload, Meshes() if meshes is None else meshes)
    return doc["step"], decoder.node(doc["tree"], "")


def _ints(value: Any, minimum: int | None = 0) -> bool:
    """Whether `value` is a list of ints (not bools), each at least `minimum`."""
    return isinstance(value, list) and all(
        type(n) is int and (minimum is None or n >= minimum) for n in value)


class _Decoder:
    def __init__(self, payload: torch.Tensor, meshes: Callable[[MeshSpec], DeviceMesh]) -> None:
        self.payload = payload
        self.meshes = meshes

    def node(self, node: Any, path: str) -> Any:
        if not isinstance(node, list) or len(node) < 2 or not isinstance(node[0], str):
            raise StateCodecError(f"state header node at {path or '/'} is malformed: "
                                  f"{node!r:.80}")
        tag = node[0]
        if tag == "v" and len(node) == 2 and isinstance(node[1], _SCALARS):
            return node[1]
        if tag in ("l", "t") and len(node) == 2 and isinstance(node[1], list):
            items = [self.node(item, f"{path}/{i}") for i, item in enumerate(node[1])]
            return items if tag == "l" else tuple(items)
        if tag in ("d", "o") and len(node) == 2 + (tag == "o") and isinstance(node[1], list):
            return self.mapping(node, path)
        if tag == "T" and len(node) == 5:
            return self.tensor(node, path)
        if tag == "D" and len(node) == 6:
            return self.dtensor(node, path)
        raise StateCodecError(f"state header node at {path or '/'} is malformed: {node!r:.80}")

    def mapping(self, node: list[Any], path: str) -> dict[Any, Any]:
        out: dict[Any, Any] = {} if node[0] == "d" else OrderedDict()
        for item in node[1]:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], _SCALARS)):
                raise StateCodecError(f"state header dict item at {path or '/'} is malformed")
            out[item[0]] = self.node(item[1], f"{path}/{item[0]!s}")
        if node[0] == "o" and node[2] is not None:
            out._metadata = self.node(node[2], f"{path}/_metadata")  # type: ignore[attr-defined]
        return out

    def tensor(self, node: list[Any], path: str) -> torch.Tensor:
        _, name, shape, offset, nbytes = node
        dtype = _DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise StateCodecError(f"tensor at {path} has unknown dtype {name!r}")
        if not (_ints(shape) and type(offset) is int and type(nbytes) is int):
            raise StateCodecError(f"tensor at {path}: malformed shape or place {node[2:]!r}")
        count = 1
        for n in shape:
            count *= n
        itemsize = torch.empty((), dtype=dtype).element_size()
        size = self.payload.numel()
        if nbytes != count * itemsize or offset % ALIGN or offset < 0 or offset + nbytes > size:
            raise StateCodecError(f"tensor at {path}: {nbytes} bytes at {offset} do not fit "
                                  f"shape {shape} of {name} in a {size}-byte payload")
        return self.payload[offset:offset + nbytes].view(dtype).reshape(shape)

    def dtensor(self, node: list[Any], path: str) -> DTensor:
        """The DTensor as it was sent: its local tensor (on the mesh's device) and spec;
        not `DTensor.from_local`, which empties the local tensor of a rank outside the mesh."""
        _, local_node, mesh_node, placement_nodes, shape, stride = node
        if not (isinstance(local_node, list) and local_node[:1] == ["T"]):
            raise StateCodecError(f"DTensor at {path}: its local tensor is not a tensor node")
        local = self.node(local_node, path)
        spec = _mesh_spec(mesh_node, path)
        if not (_ints(shape) and _ints(stride, None) and len(shape) == len(stride)):
            raise StateCodecError(f"DTensor at {path}: malformed global shape {shape!r:.40} "
                                  f"or stride {stride!r:.40}")
        if not (isinstance(placement_nodes, list) and len(placement_nodes) == len(spec.shape)):
            raise StateCodecError(f"DTensor at {path}: placements {placement_nodes!r:.80} are "
                                  f"not a list of one per mesh dim ({len(spec.shape)})")
        placements = tuple(_decode_placement(p, len(shape), path) for p in placement_nodes)
        _check_local(local, shape, placements, path)
        try:
            mesh = self.meshes(spec)
        except StateCodecError as exc:
            raise StateCodecError(f"DTensor at {path}: {exc}") from exc
        except Exception as exc:  # DeviceMesh raises several types
            raise StateCodecError(f"DTensor at {path}: cannot build its mesh {spec}: "
                                  f"{exc}") from exc
        if local.device.type != mesh.device_type:
            local = local.to(mesh.device_type)
        meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
        whole = DTensorSpec(mesh, placements, tensor_meta=meta)
        return DTensor(local, whole, requires_grad=False)  # type: ignore[no-untyped-call]


def _check_local(local: torch.Tensor, shape: list[int], placements: tuple[Placement, ...],
                 path: str) -> None:
    """A local tensor fits the global shape: as large on every dim but the sharded
    ones, no larger there; or empty of shape [0] (a rank outside the mesh)."""
    if list(local.shape) == [0]:
        return
    sharded = {p.dim for p in placements if isinstance(p, Shard)}
    if local.dim() != len(shape) or any(
            n > g if d in sharded else n != g
            for d, (n, g) in enumerate(zip(local.shape, shape, strict=True))):
        raise StateCodecError(f"DTensor at {path}: local shape {list(local.shape)} does not "
                              f"fit global shape {shape} under {list(placements)}")


def _mesh_spec(node: Any, path: str) -> MeshSpec:
    """A DTensor's mesh node ([device type, shape, ranks, dim names]), checked."""
    if not (isinstance(node, list) and len(node) == 4):
        raise StateCodecError(f"DTensor at {path}: malformed mesh {node!r:.80}")
    device_type, shape, ranks, names = node
    count = 1
    for n in shape if _ints(shape) else ():
        count *= n
    if not (isinstance(device_type, str) and _DEVICE_TYPE.fullmatch(device_type)
            and _ints(shape) and _ints(ranks) and len(ranks) == count
            and len(set(ranks)) == count):
        raise StateCodecError(f"DTensor at {path}: malformed mesh {node!r:.80} (device type, "
                              "shape, as many distinct ranks as the shape holds, dim names)")
    if names is not None and not (isinstance(names, list) and len(names) == len(shape)
                                  and all(isinstance(n, str) for n in names)
                                  and len(set(names)) == len(names)):
        raise StateCodecError(f"DTensor at {path}: mesh dim names {names!r:.80} are not "
                              f"{len(shape)} distinct strings")
    return MeshSpec(device_type, tuple(shape), tuple(ranks),
                    None if names is None else tuple(names))


def _decode_placement(node: Any, ndim: int, path: str) -> Placement:
    if node == ["R"]:
        return Replicate()
    if (isinstance(node, list) and len(node) == 2 and node[0] == "S" and type(node[1]) is int
            and 0 <= node[1] < ndim):
        return Shard(node[1])
    if (isinstance(node, list) and len(node) == 2 and node[0] == "P"
            and isinstance(node[1], str) and node[1] in _REDUCE_OPS):
        return Partial(node[1])
    raise StateCodecError(f"DTensor at {path}: malformed placement {node!r:.80} (['S', dim < "
                          f"{ndim}], ['R'] or ['P', one of {', '.join(sorted(_REDUCE_OPS))}])")
