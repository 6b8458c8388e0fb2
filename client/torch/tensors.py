"""Tensors as gradsync buffers, for the torch.distributed backend.

What torch hands a process group (any dtype, any layout, lists of tensors)
becomes flat arrays in dtypes the daemon reduces: bool as uint8 (sum means
"any", product "all", as NCCL does), complex as its real pairs (sum and avg
only), non-contiguous tensors through a contiguous copy that is written back.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gradsync.client.torch.buckets import FLOAT_DTYPES, TorchDtypes
from gradsync.protocol.errors import InvalidArgumentError

#: torch's reduce ops → gradsync's (the ones with a meaning in a daemon reduction).
TORCH_OPS: dict[Any, str] = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.PRODUCT: "prod",
    dist.ReduceOp.BAND: "band",
    dist.ReduceOp.BOR: "bor",
    dist.ReduceOp.BXOR: "bxor",
}

#: On bool tensors (reduced as uint8 0/1), as NCCL does: sum is "any", product "all".
BOOL_OPS = {"sum": "max", "prod": "min", "max": "max", "min": "min",
             "band": "band", "bor": "bor", "bxor": "bxor"}

#: torch dtype → numpy dtype the daemon reduces: the gradient types, and integers.
NUMPY_DTYPES = TorchDtypes({**FLOAT_DTYPES.wire_names, torch.int8: "int8",
                            torch.uint8: "uint8", torch.int32: "int32", torch.int64: "int64"})


def wire_op(tensor: torch.Tensor, op: Any) -> str:
    """gradsync's name for a torch reduce op on this tensor's dtype, or a clear error."""
    kind = getattr(op, "op", op)
    name = TORCH_OPS.get(kind)
    if name is None:
        raise InvalidArgumentError(
            f"gradsync does not support reduce op {kind} (supported: "
            "SUM, AVG, MIN, MAX, PRODUCT, and BAND/BOR/BXOR on integers)"
        )
    if tensor.dtype == torch.bool:
        if name == "avg":
            raise InvalidArgumentError("reduce op AVG is not defined for bool tensors")
        return BOOL_OPS[name]
    if tensor.is_complex() and name not in ("sum", "avg"):
        raise InvalidArgumentError(f"reduce op {kind} is not defined for complex tensors")
    return name


def flat_wire_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view of a contiguous tensor in a dtype the daemon knows (no copy)."""
    flat = tensor.reshape(-1)
    if tensor.dtype == torch.bool:
        return flat.view(torch.uint8)
    if tensor.is_complex():
        return torch.view_as_real(flat).reshape(-1)
    if tensor.dtype not in NUMPY_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in [*NUMPY_DTYPES, torch.bool])
        raise InvalidArgumentError(
            f"gradsync cannot move {str(tensor.dtype).removeprefix('torch.')} tensors "
            f"(supported: {names}, complex64/complex128 for sum and avg)"
        )
    return flat


def as_buffer(wire: torch.Tensor) -> Any:
    """What the client takes: a numpy array over a CPU tensor, or the CUDA tensor.

    The array is made from the tensor's address (a ctypes buffer over it, which
    holds the tensor, so the array keeps it alive), not with `Tensor.numpy()`,
    which would mark its storage not resizable for good.  Small allreduces pay
    for this on every call: it is the cheapest way numpy takes an address.
    """
    if wire.is_cuda:
        return wire
    if wire.device.type != "cpu":
        raise InvalidArgumentError(f"gradsync moves CPU and CUDA tensors, not {wire.device}")
    memory = (ctypes.c_char * (wire.numel() * wire.element_size())).from_address(wire.data_ptr())
    memory.tensor = wire  # type: ignore[attr-defined]
    return np.frombuffer(memory, NUMPY_DTYPES[wire.dtype])  # type: ignore[call-overload]


class Staged:
    """A tensor as one flat daemon buffer; non-contiguous ones through a contiguous copy."""

    def __init__(self, tensor: torch.Tensor, copy_in: bool = True) -> None:
        self.tensor = tensor
        if tensor.is_contiguous():
            self.contiguous = tensor
        else:
            self.contiguous = tensor.contiguous() if copy_in else torch.empty_like(
                tensor, memory_format=torch.contiguous_format
            )
        self.array = as_buffer(flat_wire_tensor(self.contiguous))

    def copy_back(self) -> None:
        if self.contiguous is not self.tensor:
            self.tensor.copy_(self.contiguous)


def packed(tensors: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """One contiguous tensor holding `tensors` back to back (flattened)."""
    total = sum(t.numel() for t in tensors)
    out = torch.empty(total, dtype=like.dtype, device=like.device)
    offset = 0
    for t in tensors:
        out[offset : offset + t.numel()].copy_(t.reshape(-1))
        offset += t.numel()
    return out


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()


def check_same(what: str, tensors: Sequence[torch.Tensor], like: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != like.dtype or t.numel() != like.numel():
            raise InvalidArgumentError(
                f"{what}: every tensor must be {like.dtype} with {like.numel()} elements, "
                f"got {t.dtype} with {t.numel()}"
            )


def copy_back_all(staged: Sequence[Staged]) -> Callable[[], None] | None:
    if all(s.contiguous is s.tensor for s in staged):
        return None

    def copy_back() -> None:
        for s in staged:
            s.copy_back()

    return copy_back


def chain(
    first: Callable[[], None] | None, then: Callable[[], None]
) -> Callable[[], None]:
    def both() -> None:
        if first is not None:
            first()
        then()

    return both
