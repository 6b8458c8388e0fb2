"""Element types and reduce operations every collective understands."""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping

import numpy as np

#: The wire names, in the order whose indices the fast page stores (protocol/fast_path.py).
_WIRE_NAMES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")
#: The one dtype that is not numpy's own (ml_dtypes').
_BFLOAT16 = "bfloat16"


class _WireDtypes(Mapping[str, np.dtype]):
    """Wire name → numpy dtype; ml_dtypes, which defines bfloat16, is imported only
    when bfloat16 is asked for: importing it costs about a second here (numpy 2.4,
    ml_dtypes 0.7), which every rank process would pay on `import gradsync.client`."""

    def __init__(self) -> None:
        self._known = {name: np.dtype(name) for name in _WIRE_NAMES if name != _BFLOAT16}

    def __getitem__(self, name: str) -> np.dtype:
        if name == _BFLOAT16 and name not in self._known:
            import ml_dtypes  # deliberately late: see the class docstring

            self._known[name] = np.dtype(ml_dtypes.bfloat16)
        return self._known[name]

    def __iter__(self) -> Iterator[str]:
        return iter(_WIRE_NAMES)

    def __len__(self) -> int:
        return len(_WIRE_NAMES)

    def __contains__(self, name: object) -> bool:
        return name in _WIRE_NAMES


#: Wire name → numpy dtype.  Names are numpy's, plus ml_dtypes' bfloat16.
DTYPES: Mapping[str, np.dtype] = _WireDtypes()

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


_NAMES: dict[np.dtype, str] = {np.dtype(name): name for name in _WIRE_NAMES
                                if name != _BFLOAT16}


def dtype_name(dtype: np.dtype) -> str:
    """Wire name of a numpy dtype, or `ValueError` naming the supported ones."""
    name = _NAMES.get(dtype)
    if name is not None:
        return name
    # An array of bfloat16 means its owner has imported ml_dtypes already.
    if getattr(dtype, "name", None) == _BFLOAT16 and dtype == DTYPES[_BFLOAT16]:
        return _BFLOAT16
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
