"""Gradient buckets for `gradsync.client.torch`: assignment, shared memory, torch views.

Kept apart from the DDP wrapper so the layout rules (reverse registration
order, a small first bucket, one dtype per bucket) read on their own.  A bucket
is one array in daemon-owned shared memory: the gradients of its parameters,
back to back, followed by one "used" flag per parameter.  The flags ride in the
same allreduce, so finding the parameters no rank used costs no collective.
They start at a multiple of `FLAGS_ALIGN` elements (zeros before them), so that
under fp8 compression they share no scale block with a gradient: a block's
scale follows its largest value, and a huge gradient beside them could round
a flag of 1 to 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch

from gradsync.protocol.compression import FP8_BLOCK
from gradsync.protocol.dtypes import DTYPES
from gradsync.protocol.errors import InvalidArgumentError

MIB = 1024 * 1024
#: Where the flags may start: a multiple of the fp8 block (see the module docstring).
FLAGS_ALIGN = FP8_BLOCK


class TorchDtypes(Mapping[torch.dtype, np.dtype]):
    """torch dtype → the numpy dtype the daemon reduces, by wire name through
    `protocol.dtypes.DTYPES`: bfloat16's comes from ml_dtypes, whose import costs
    half a second of CPU, so it is looked up only when a bfloat16 tensor comes
    along (every process of a torch job imports this module)."""

    def __init__(self, wire_names: Mapping[torch.dtype, str]) -> None:
        self.wire_names = dict(wire_names)

    def __getitem__(self, dtype: torch.dtype) -> np.dtype:
        return DTYPES[self.wire_names[dtype]]

    def __iter__(self) -> Iterator[torch.dtype]:
        return iter(self.wire_names)

    def __len__(self) -> int:
        return len(self.wire_names)

    def __contains__(self, dtype: object) -> bool:
        return dtype in self.wire_names


#: torch dtype → numpy dtype the daemon reduces (gradsync's float wire types).
FLOAT_DTYPES = TorchDtypes({torch.float16: "float16", torch.bfloat16: "bfloat16",
                            torch.float32: "float32", torch.float64: "float64"})


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """A torch tensor over `array`'s memory (no copy), bfloat16 included."""
    # Only ml_dtypes makes an array of bfloat16: the second test imports nothing new.
    if array.dtype.name == "bfloat16" and array.dtype == DTYPES["bfloat16"]:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def as_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array over a contiguous CPU tensor's memory (no copy), bfloat16 included."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise InvalidArgumentError(
            f"expected a contiguous CPU tensor, got one on {tensor.device} "
            f"(contiguous: {tensor.is_contiguous()})"
        )
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(DTYPES["bfloat16"])
    return tensor.numpy()


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of a gradient; refuse types the daemon cannot average."""
    try:
        return FLOAT_DTYPES[dtype]
    except KeyError:
        names = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)
        raise InvalidArgumentError(
            f"gradsync averages gradients of {names}; got a parameter of {dtype}"
        ) from None


def assign_buckets(
    params: Sequence[torch.Tensor], first_cap_bytes: int, cap_bytes: int,
    order: Sequence[int] | None = None,
) -> list[list[int]]:
    """Group parameter indices into buckets, in the order gradients are expected.

    `order` is that order (every index once); by default reverse registration
    order, since backward produces gradients roughly last layer first, so the
    bucket that becomes ready first is filled first.  Each dtype
    has its own open bucket; the first one of a dtype closes at
    `first_cap_bytes` (so communication starts early), later ones at
    `cap_bytes` (a bucket closes once it holds at least its cap, as in torch's
    DDP).  Buckets come out in the order their first gradient is expected.
    """
    closed: list[list[int]] = []
    open_buckets: dict[torch.dtype, list[int]] = {}
    open_bytes: dict[torch.dtype, int] = {}
    caps_used: dict[torch.dtype, int] = {}
    walk = list(reversed(range(len(params)))) if order is None else list(order)
    if sorted(walk) != list(range(len(params))):
        raise InvalidArgumentError("a bucket order must name every parameter index once")
    position = {index: place for place, index in enumerate(walk)}
    for index in walk:
        param = params[index]
        bucket = open_buckets.setdefault(param.dtype, [])
        bucket.append(index)
        open_bytes[param.dtype] = open_bytes.get(param.dtype, 0) + param.numel() * (
            param.element_size()
        )
        cap = first_cap_bytes if caps_used.get(param.dtype, 0) == 0 else cap_bytes
        if open_bytes[param.dtype] >= cap:
            closed.append(bucket)
            caps_used[param.dtype] = caps_used.get(param.dtype, 0) + 1
            del open_buckets[param.dtype]
            open_bytes[param.dtype] = 0
    closed.extend(open_buckets.values())
    closed.sort(key=lambda bucket: position[bucket[0]])
    return closed


@dataclasses.dataclass
class Bucket:
    """One bucket: its parameters' gradient views and used flags over one shm array."""

    index: int
    param_indices: list[int]
    #: What the client all-reduces: a numpy array in shm, or a tensor in device memory.
    array: np.ndarray | torch.Tensor
    tensor: torch.Tensor
    views: list[torch.Tensor]
    flags: torch.Tensor
    #: Per-step state: how many of its parameters are ready, and the collective.
    ready: set[int] = dataclasses.field(default_factory=set)
    launched_at: float | None = None

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def is_ready(self) -> bool:
        return len(self.ready) == len(self.param_indices)


def make_bucket(
    index: int, param_indices: list[int], params: Sequence[torch.Tensor],
    array: np.ndarray | torch.Tensor,
) -> Bucket:
    """Lay the parameters' gradients out in `array` (grads first, then the flags)."""
    tensor = array if isinstance(array, torch.Tensor) else as_tensor(array)
    views = []
    offset = 0
    for i in param_indices:
        numel = params[i].numel()
        views.append(tensor[offset : offset + numel].view(params[i].shape))
        offset += numel
    start = _flags_start(offset)
    tensor[offset:start].zero_()
    flags = tensor[start : start + len(param_indices)]
    return Bucket(index, param_indices, array, tensor, views, flags)


def bucket_elements(param_indices: Sequence[int], params: Sequence[torch.Tensor]) -> int:
    """Elements of a bucket's array: every gradient plus one flag per parameter."""
    return _flags_start(sum(params[i].numel() for i in param_indices)) + len(param_indices)


def _flags_start(gradients: int) -> int:
    return -(-gradients // FLAGS_ALIGN) * FLAGS_ALIGN
