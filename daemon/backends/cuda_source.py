"""CUDA source of the device kernels, as text: no cupy needed to build or check it.

bfloat16 has no cupy dtype: slots are uint16 bit patterns, widened to float32
(the top half of a float32 is a bfloat16) and rounded back to nearest even.
The fused allreduce reads every slot once and writes the result into all of
them in the same pass.
"""

from __future__ import annotations

from gradsync.protocol.dtypes import BITWISE_OPS, ReduceOp, check_op_for_dtype

BF16_PREAMBLE = r"""
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

#: The type a fused kernel accumulates in, per wire dtype (half types widen to float).
_ACCUMULATORS = {
    "float16": "float", "bfloat16": "float", "float32": "float", "float64": "double",
    "int8": "T", "uint8": "T", "int32": "T", "int64": "T",
}
#: NaN-propagating min and max, as numpy's minimum and maximum; the bitwise
#: ops only ever see integer accumulators (`check_op_for_dtype`).
_COMBINE = {
    ReduceOp.SUM: "{a} + {b}",
    ReduceOp.AVG: "{a} + {b}",
    ReduceOp.PROD: "{a} * {b}",
    ReduceOp.MIN: "(({a}) != ({a}) || ({a}) < ({b})) ? ({a}) : ({b})",
    ReduceOp.MAX: "(({a}) != ({a}) || ({a}) > ({b})) ? ({a}) : ({b})",
    ReduceOp.BAND: "{a} & {b}",
    ReduceOp.BOR: "{a} | {b}",
    ReduceOp.BXOR: "{a} ^ {b}",
}


def fused_source(count: int, op: ReduceOp, dtype: str) -> tuple[str, str]:
    """(parameters, body) of the one-pass kernel over `count` in-place slots.

    Every slot is read once and written once (2·count passes over the data,
    against 5·(count - 1) for pairwise combining and copying back).  A bitwise
    op on a float dtype is refused with `ValueError`: C has no `&` of floats.
    """
    check_op_for_dtype(op, dtype)
    names = [f"s{i}" for i in range(count)]
    bfloat16 = dtype == "bfloat16"
    accumulator = _ACCUMULATORS[dtype]
    params = ", ".join(f"{'uint16' if bfloat16 else 'T'} {name}" for name in names)

    def load(name: str) -> str:
        if bfloat16:
            return f"bf16_to_f32({name})"
        return name if accumulator == "T" else f"({accumulator})({name})"

    lines = [f"{accumulator} acc = {load(names[0])};"]
    for name in names[1:]:
        lines.append(f"{{ {accumulator} x = {load(name)}; "
                     f"acc = {_COMBINE[op].format(a='acc', b='x')}; }}")
    if op is ReduceOp.AVG:
        lines.append(f"acc = acc / ({accumulator}){count};")
    stored = "f32_to_bf16(acc)" if bfloat16 else ("acc" if accumulator == "T" else "(T)acc")
    lines += [f"{name} = {stored};" for name in names]
    return params, "\n".join(lines)


#: Pairwise bfloat16 combining (of floats a and b), with the same NaN rules;
#: no bitwise ops, which floats do not have.
BF16_EXPRESSIONS = {
    op: _COMBINE[op].format(a="a", b="b") for op in ReduceOp if op not in BITWISE_OPS
}
