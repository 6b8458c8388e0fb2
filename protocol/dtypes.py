"""Element types and reduce operations every collective understands."""

from __future__ import annotations

import enum

import ml_dtypes
import numpy as np

#: Wire name → numpy dtype.  Names are numpy's, plus ml_dtypes' bfloat16.
DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
}

FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


class ReduceOp(enum.StrEnum):
    """Reduction applied elementwise across ranks (torch.distributed's names)."""

    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PROD = "prod"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"


#: The ops that combine bit patterns, defined for integer dtypes only.
BITWISE_OPS = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})


_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: np.dtype) -> str:
    """Wire name of a numpy dtype, or `ValueError` naming the supported ones."""
    name = _NAMES.get(dtype)
    if name is not None:
        return name
    raise ValueError(f"unsupported dtype {dtype}; supported: {', '.join(DTYPES)}")


def parse_reduce_op(op: str | ReduceOp) -> ReduceOp:
    """Accept a `ReduceOp` or its string name (case-insensitive)."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp(op.lower())
        except ValueError:
            pass
    names = ", ".join(member.value for member in ReduceOp)
    shown = repr(op) if len(repr(op)) <= 80 else repr(op)[:79] + "…"
    raise ValueError(f"unknown reduce op {shown}; expected one of: {names}")


def check_op_for_dtype(op: ReduceOp, dtype: str) -> None:
    """Refuse combinations with no sensible meaning (avg of integers, bits of floats)."""
    if op is ReduceOp.AVG and dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"reduce op 'avg' is not defined for integer dtype {dtype}: "
            "use 'sum' and divide yourself, or a float dtype"
        )
    if op in BITWISE_OPS and dtype in FLOAT_DTYPES:
        raise ValueError(
            f"reduce op '{op.value}' is not defined for float dtype {dtype}: "
            "bitwise ops take int8, uint8, int32 or int64"
        )
