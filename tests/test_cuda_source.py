"""The device kernels' source, checked on the CPU.

The fused allreduce kernel and the bfloat16 helpers are CUDA text that only
compiles on a GPU machine.  The same text, with the CUDA intrinsics it uses
given C definitions, is compiled here by the C compiler and run over numpy
arrays: every op, dtype and slot count must give what the host path gives
(numpy, with bfloat16 accumulated in float32 and rounded to nearest even).
float16 is left to the GPU check (C has no such type).
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest

from gradsync.daemon.backends.cuda_source import BF16_PREAMBLE, fused_source
from gradsync.protocol.dtypes import BITWISE_OPS, FLOAT_DTYPES, ReduceOp

C_TYPES = {
    "float32": "float", "float64": "double", "int8": "signed char",
    "uint8": "unsigned char", "int32": "int", "int64": "long long",
    "bfloat16": "unsigned short",
}
NP_TYPES = {
    "float32": np.float32, "float64": np.float64, "int8": np.int8, "uint8": np.uint8,
    "int32": np.int32, "int64": np.int64, "bfloat16": np.uint16,
}
COUNTS = (2, 3, 4)
SHIMS = """
#include <string.h>
#define __device__ static
static float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
"""


def cases() -> Iterator[tuple[int, ReduceOp, str]]:
    for dtype in C_TYPES:
        for op in ReduceOp:
            if (op is ReduceOp.AVG and dtype not in FLOAT_DTYPES) or (
                op in BITWISE_OPS and dtype in FLOAT_DTYPES
            ):
                continue
            for count in COUNTS:
                yield count, op, dtype


def kernel_name(count: int, op: ReduceOp, dtype: str) -> str:
    return f"k_{op.value}_{dtype}_{count}"


def c_function(count: int, op: ReduceOp, dtype: str) -> str:
    """The kernel body in a loop over elements; slot names become array elements."""
    _, body = fused_source(count, op, dtype)
    pointer = C_TYPES[dtype]
    args = ", ".join(f"{pointer} *p{i}" for i in range(count))
    defines = "\n".join(f"#define s{i} p{i}[e]" for i in range(count))
    undefines = "\n".join(f"#undef s{i}" for i in range(count))
    return (f"void {kernel_name(count, op, dtype)}({args}, long n) {{\n"
            f"  typedef {C_TYPES[dtype]} T; (void)sizeof(T);\n{defines}\n"
            f"  for (long e = 0; e < n; e++) {{ {body} }}\n{undefines}\n}}\n")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to check the kernel source with")
    folder = tmp_path_factory.mktemp("kernels")
    source = folder / "kernels.c"
    source.write_text(SHIMS + BF16_PREAMBLE + "".join(c_function(*c) for c in cases()))
    library = folder / "kernels.so"
    subprocess.run([compiler, "-O2", "-fwrapv", "-shared", "-fPIC", "-o", str(library),
                    str(source)], check=True, capture_output=True, timeout=120)
    return ctypes.CDLL(str(library))


def inputs(count: int, op: ReduceOp, dtype: str, rng: np.random.Generator) -> list[np.ndarray]:
    n = 4099
    if dtype == "bfloat16":
        values = [rng.normal(0, 3, n).astype(np.float32) for _ in range(count)]
        values[0][:3] = [np.nan, np.inf, -0.0]
        return [v.astype(ml_dtypes.bfloat16).view(np.uint16) for v in values]
    kind = np.dtype(NP_TYPES[dtype])
    if kind.kind == "f":
        arrays = [rng.normal(0, 3, n).astype(kind) for _ in range(count)]
        arrays[-1][:2] = [np.nan, -np.inf]
        arrays[0][2:4] = [np.nan, np.inf]  # NaN first and last: both must win
        return arrays
    info = np.iinfo(kind)
    if op is ReduceOp.PROD:
        return [rng.integers(-3 if info.min < 0 else 0, 4, n).astype(kind) for _ in range(count)]
    return [rng.integers(info.min, info.max, n, endpoint=True).astype(kind)
            for _ in range(count)]


def reference(arrays: list[np.ndarray], op: ReduceOp, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        wide = [a.view(ml_dtypes.bfloat16).astype(np.float32) for a in arrays]
        return reference(wide, op, "float32").astype(ml_dtypes.bfloat16).view(np.uint16)
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
             ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum, ReduceOp.BAND: np.bitwise_and,
             ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}[op]
    acc = arrays[0].copy()
    with np.errstate(all="ignore"):
        for array in arrays[1:]:
            ufunc(acc, array, out=acc)
        if op is ReduceOp.AVG:
            np.divide(acc, len(arrays), out=acc)
    return acc


@pytest.mark.parametrize(("count", "op", "dtype"), list(cases()))
def test_fused_kernel_matches_the_host_path(
    kernels: ctypes.CDLL, count: int, op: ReduceOp, dtype: str
) -> None:
    arrays = inputs(count, op, dtype, np.random.default_rng([count, len(op.value), len(dtype)]))
    expected = reference(arrays, op, dtype)
    function = getattr(kernels, kernel_name(count, op, dtype))
    function(*(a.ctypes.data_as(ctypes.c_void_p) for a in arrays), ctypes.c_long(arrays[0].size))
    for slot in arrays:  # every slot holds the result
        if dtype == "bfloat16":
            got, want = slot.view(ml_dtypes.bfloat16), expected.view(ml_dtypes.bfloat16)
            np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
        else:
            np.testing.assert_array_equal(slot, expected)


def test_each_slot_is_read_once_and_written_once() -> None:
    for count, op, dtype in cases():
        params, body = fused_source(count, op, dtype)
        assert params.count(" s") == count, params
        for i in range(count):
            assert body.count(f"s{i} =") == 1, body  # written once
            assert len(re.findall(rf"\bs{i}\b(?! =)", body)) == 1, body  # read once
        assert (f"acc / (float){count}" in body or f"acc / (double){count}" in body) == (
            op is ReduceOp.AVG
        ), body


@pytest.mark.parametrize("dtype", sorted(FLOAT_DTYPES))
def test_bitwise_ops_of_floats_are_refused_not_generated(dtype: str) -> None:
    """No kernel text with `&` of floats: the generator refuses, naming op and dtype."""
    for op in BITWISE_OPS:
        refusal = f"'{op.value}' is not defined for float dtype {dtype}"
        with pytest.raises(ValueError, match=refusal):
            fused_source(2, op, dtype)


def test_bfloat16_rounding_matches_ml_dtypes(kernels: ctypes.CDLL) -> None:
    """Every bfloat16 value, widened and rounded back through the kernels' helpers
    (a 2-slot sum with zeros), is itself; halfway float32 sums round to even."""
    every = np.arange(1 << 16, dtype=np.uint16)
    finite = every[np.isfinite(every.view(ml_dtypes.bfloat16).astype(np.float32))]
    zeros = np.zeros_like(finite)
    result = finite.copy()
    kernels.k_sum_bfloat16_2(result.ctypes.data_as(ctypes.c_void_p),
                             zeros.ctypes.data_as(ctypes.c_void_p), ctypes.c_long(finite.size))
    plus_zero = (finite.view(ml_dtypes.bfloat16).astype(np.float32) + 0.0).astype(
        ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(result, plus_zero)
