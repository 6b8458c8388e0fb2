"""Device reductions with cupy, including bfloat16, which cupy has no dtype for.

bfloat16 slots are viewed as uint16 bit patterns; the kernels widen each
element to float32 (the top half of a float32 is a bfloat16), combine, and
round back to nearest even, as torch does.  Every other dtype uses cupy's
own ufuncs.  Imported only by the CUDA backend.
"""

from __future__ import annotations

from typing import Any

import cupy

from gradsync.protocol.dtypes import ReduceOp

_UFUNCS = {
    ReduceOp.SUM: cupy.add,
    ReduceOp.AVG: cupy.add,
    ReduceOp.MIN: cupy.minimum,
    ReduceOp.MAX: cupy.maximum,
    ReduceOp.PROD: cupy.multiply,
}

_BF16_PREAMBLE = r"""
__device__ float bf16_to_f32(unsigned short bits) {
    return __uint_as_float(((unsigned int)bits) << 16);
}
__device__ unsigned short f32_to_bf16(float value) {
    unsigned int bits = __float_as_uint(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (unsigned short)(bits >> 16);
}
"""

_BF16_EXPRESSIONS = {
    ReduceOp.SUM: "a + b",
    ReduceOp.AVG: "a + b",
    ReduceOp.MIN: "fminf(a, b)",
    ReduceOp.MAX: "fmaxf(a, b)",
    ReduceOp.PROD: "a * b",
}


def _bf16_kernel(expression: str, name: str) -> Any:
    return cupy.ElementwiseKernel(
        "uint16 x, uint16 y", "uint16 z",
        f"float a = bf16_to_f32(x); float b = bf16_to_f32(y); z = f32_to_bf16({expression});",
        name, preamble=_BF16_PREAMBLE,
    )


_BF16_COMBINE = {
    op: _bf16_kernel(expression, f"gradsync_bf16_{op.value}")
    for op, expression in _BF16_EXPRESSIONS.items()
}
_BF16_DIVIDE = cupy.ElementwiseKernel(
    "uint16 x, float32 d", "uint16 z", "z = f32_to_bf16(bf16_to_f32(x) / d);",
    "gradsync_bf16_divide", preamble=_BF16_PREAMBLE,
)


def combine(target: Any, source: Any, op: ReduceOp, dtype: str) -> None:
    """target ← target op source on the current stream (avg combines as sum)."""
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
