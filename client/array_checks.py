"""A collective's array, checked before anything is sent: wire dtype, op, element count.

`Client` checks every buffer of a collective here: host arrays (C-contiguous,
writeable numpy arrays, the checked (dtype, op) pairs remembered, since the
same pairs come back every step) and device arrays (described through
`gradsync.client.cuda`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from gradsync.client.cuda import DeviceArrayInfo, describe, is_device_array
from gradsync.protocol.dtypes import ReduceOp, check_op_for_dtype, dtype_name, parse_reduce_op
from gradsync.protocol.errors import InvalidArgumentError

__all__ = ["Checked", "check_array"]


class Checked(NamedTuple):
    """A collective's array, checked: wire dtype, op, element count, and for a
    device array its description (None for host arrays)."""

    dtype: str
    op: ReduceOp
    elements: int
    device: DeviceArrayInfo | None


#: (numpy dtype, op as given, elements) → the Checked of a host array already seen.
_CHECKED_HOST: dict[tuple[Any, Any, int], Checked] = {}


def check_array(array: Any, op: str | ReduceOp, cupy: Callable[[], Any]) -> Checked:
    """What a collective needs to know of `array`, after checking it.

    `cupy` gives the cupy module, asked for only when `array` is a device array.
    """
    if type(array) is np.ndarray:  # the common case first: a plain host array
        checked = _CHECKED_HOST.get((array.dtype, op, array.size))
        if checked is not None and array.flags.c_contiguous and array.flags.writeable:
            return checked
    if is_device_array(array):
        info = describe(array, cupy())
        try:
            reduce_op = parse_reduce_op(op)
            check_op_for_dtype(reduce_op, info.dtype)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        return Checked(info.dtype, reduce_op, info.count, info)
    if not isinstance(array, np.ndarray):
        raise InvalidArgumentError(
            f"expected a numpy array, a CUDA tensor or a cupy array, "
            f"got {type(array).__name__}"
        )
    if not array.flags.c_contiguous:
        raise InvalidArgumentError(
            "array must be C-contiguous; pass np.ascontiguousarray(a) and copy back"
        )
    if not array.flags.writeable:
        raise InvalidArgumentError("array is read-only; collectives write in place")
    try:
        wire_dtype = dtype_name(array.dtype)
        reduce_op = parse_reduce_op(op)
        check_op_for_dtype(reduce_op, wire_dtype)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None
    checked = Checked(wire_dtype, reduce_op, int(array.size), None)
    if len(_CHECKED_HOST) >= 256:
        _CHECKED_HOST.clear()
    _CHECKED_HOST[(array.dtype, op, array.size)] = checked
    return checked
