"""Device reductions with cupy, including bfloat16, which cupy has no dtype for.

Slots on one device are reduced by one fused kernel per (slot count, op,
dtype), compiled on first use (source: cuda_source.py).  Pairwise combining
(slots staged from other devices, the collectives other than allreduce) uses
cupy's ufuncs, and kernels of our own for bfloat16 (uint16 bit patterns
widened to float32).  Imported only by the CUDA backend.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy

from gradsync.daemon.backends.cuda_source import (
    BF16_EXPRESSIONS,
    BF16_PREAMBLE,
    fused_source,
)
from gradsync.protocol.dtypes import ReduceOp, check_op_for_dtype

_UFUNCS = {
    ReduceOp.SUM: cupy.add,
    ReduceOp.AVG: cupy.add,
    ReduceOp.MIN: cupy.minimum,
    ReduceOp.MAX: cupy.maximum,
    ReduceOp.PROD: cupy.multiply,
    ReduceOp.BAND: cupy.bitwise_and,
    ReduceOp.BOR: cupy.bitwise_or,
    ReduceOp.BXOR: cupy.bitwise_xor,
}

def _bf16_kernel(expression: str, name: str) -> Any:
    return cupy.ElementwiseKernel(
        "uint16 x, uint16 y", "uint16 z",
        f"float a = bf16_to_f32(x); float b = bf16_to_f32(y); z = f32_to_bf16({expression});",
        name, preamble=BF16_PREAMBLE,
    )


_BF16_COMBINE = {
    op: _bf16_kernel(expression, f"gradsync_bf16_{op.value}")
    for op, expression in BF16_EXPRESSIONS.items()
}
_BF16_DIVIDE = cupy.ElementwiseKernel(
    "uint16 x, float32 d", "uint16 z", "z = f32_to_bf16(bf16_to_f32(x) / d);",
    "gradsync_bf16_divide", preamble=BF16_PREAMBLE,
)


@functools.cache
def _fused_kernel(count: int, op: ReduceOp, dtype: str) -> Any:
    params, body = fused_source(count, op, dtype)
    return cupy.ElementwiseKernel(
        "", params, body, f"gradsync_allreduce_{op.value}_{dtype}_{count}",
        preamble=BF16_PREAMBLE if dtype == "bfloat16" else "",
    )


def allreduce_in_place(slots: list[Any], op: ReduceOp, dtype: str) -> None:
    """Every slot ← the reduction of all, in one kernel (slots on one device)."""
    _fused_kernel(len(slots), op, dtype)(*slots)


def combine(target: Any, source: Any, op: ReduceOp, dtype: str) -> None:
    """target ← target op source on the current stream (avg combines as sum).

    A bitwise op on a float dtype is refused with `ValueError`, as in `fused_source`.
    """
    check_op_for_dtype(op, dtype)
    if dtype == "bfloat16":
        _BF16_COMBINE[op](target, source, target)
    else:
        _UFUNCS[op](target, source, out=target)


def divide(target: Any, by: int, dtype: str) -> None:
    """target ← target / by, for avg."""
    if dtype == "bfloat16":
        _BF16_DIVIDE(target, cupy.float32(by), target)
    else:
        cupy.divide(target, by, out=target, casting="unsafe")
