"""Encode and decode the slices of a compressed inter-daemon collective.

A sender encodes a range of its buffer and, in the same call, rounds that
range in place to what it sent (`encode`): the value a daemon keeps is then
exactly the value every receiver decodes, which is what makes every rank end
bit-identical whatever the schedule (a final chunk's owner keeps the rounded
value it hands on; a forwarder re-encodes a decoded chunk to the same values,
since rounding is idempotent here).  A receiver decodes into its range,
adding (`decode_into(..., add=True)`, one rounding of the buffer's own
dtype) or overwriting.

Formats (protocol/compression.py names them):

* ``bf16``: bfloat16 by round to nearest even (float64 buffers round through
  float32 first).  Infinities, NaN and -0.0 survive.  Per rounding
  |q(x) - x| <= eps_bf16 * |x| + 2^-134, eps_bf16 = 2^-8 + 2^-24 (8 bits of
  precision; half bf16's subnormal step; the float32 step for float64).
* ``fp8``: blocks of FP8_BLOCK elements (counted from the slice's start), each
  ``[float32 scale 2^k] + e4m3fn codes`` with k the least integer such that
  amax <= 448 * 2^k (amax: the block's largest finite magnitude), clipped to
  [-140, 127] so that q * 2^k is exact in float32.  The scale is a power of two
  so decoding is exact and rounding idempotent.  Non-finite values become NaN
  (e4m3fn has no infinity); float64 values beyond 448 * 2^127 too.  Per
  rounding |q(x) - x| <= 2^-4 * |x| + 2^-10 * 2^k <= 2^-4 * |x| + 2^-17 * amax
  (2^k < amax / 224 where k is not clipped: e4m3's 3 mantissa bits, and half
  its subnormal step 2^-9).

The scales lead the payload (all of them, then all codes): one vectorised pass
each.  `_wirecodec` (the optional C module, daemon/backends/_wirecodec.c)
does float32 buffers in one pass per direction with the same results bit for
bit (tests/test_wire_codec.py compares them); numpy does the rest, and all of
it where the module was not built.  The module holds its kernels compiled for
several instruction sets ("avx512", "avx2", "baseline") and uses the best the
CPU runs, or the one GRADSYNC_CODEC_VARIANT names at import: `variant`,
`variants` and `set_variant` show and change it (the same tests run each one).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from gradsync.protocol.compression import FP8_BLOCK
from gradsync.protocol.errors import ProtocolError

try:
    from gradsync.daemon.backends import _wirecodec  # type: ignore[attr-defined]
except ImportError:  # not built (no C compiler at install): numpy does it all
    _wirecodec = None

#: e4m3fn's largest finite value, and the clip of a block's scale exponent.
FP8_MAX = 448.0
SCALE_EXP_MIN = -140
SCALE_EXP_MAX = 127
_BLOCK_BYTES = FP8_BLOCK + 4


class WireCodec(Protocol):
    """One wire format: sizes both ways, encode (rounding in place), decode."""

    name: str
    #: Elements that share a scale: slices start at multiples of it.
    block: int

    def nbytes(self, count: int) -> int:
        """Encoded bytes of `count` elements."""

    def count(self, nbytes: int) -> int:
        """Elements in an encoded payload of `nbytes`; ProtocolError if none fits."""

    def encode(self, values: np.ndarray) -> memoryview:
        """The encoding of `values`, which are rounded in place to what it decodes to."""

    def decode_into(self, payload: Any, target: np.ndarray, add: bool) -> None:
        """Decode `payload` (exactly `target.size` elements) into `target`,
        adding to it with `add`, else overwriting it."""


def variant() -> str | None:
    """The compiled kernels in use ("avx512", "avx2", "baseline"); None without the module."""
    return None if _wirecodec is None else str(_wirecodec.variant())


def variants() -> tuple[str, ...]:
    """The compiled kernels this CPU runs, best first; () without the module."""
    return () if _wirecodec is None else tuple(_wirecodec.variants())


def set_variant(name: str) -> None:
    """Use the compiled kernels `name` (one of `variants()`) from the next call on.

    ValueError for kernels this CPU does not run, or where the module was not built.
    """
    if _wirecodec is None:
        raise ValueError(f"codec variant {name!r}: the C module was not built")
    _wirecodec.set_variant(name)


def _bfloat16() -> np.dtype:
    import ml_dtypes  # the daemon has it loaded before its first compressed collective

    dtype: np.dtype = np.dtype(ml_dtypes.bfloat16)
    return dtype


def _float8() -> np.dtype:
    import ml_dtypes

    dtype: np.dtype = np.dtype(ml_dtypes.float8_e4m3fn)
    return dtype


def _compiled(values: np.ndarray) -> bool:
    return _wirecodec is not None and values.dtype == np.float32 and values.flags.c_contiguous


class Bf16Codec:
    """bfloat16 on the wire, round to nearest even."""

    name = "bf16"
    block = 1

    def nbytes(self, count: int) -> int:
        return 2 * count

    def count(self, nbytes: int) -> int:
        if nbytes % 2:
            raise ProtocolError(f"a bf16 slice of {nbytes} bytes (odd)")
        return nbytes // 2

    def encode(self, values: np.ndarray) -> memoryview:
        if _compiled(values):
            out = np.empty(2 * values.size, np.uint8)
            _wirecodec.encode(0, values, out)
            return out.data
        narrow = values if values.dtype == np.float32 else values.astype(np.float32)
        coded = narrow.astype(_bfloat16())
        np.copyto(values, coded, casting="unsafe")
        return coded.view(np.uint8).data

    def decode_into(self, payload: Any, target: np.ndarray, add: bool) -> None:
        if memoryview(payload).nbytes != 2 * target.size:
            raise ProtocolError(
                f"a bf16 slice of {memoryview(payload).nbytes} bytes for {target.size} elements")
        if _compiled(target):
            _wirecodec.decode(0, payload, target, add)
            return
        wide = np.frombuffer(payload, _bfloat16()).astype(target.dtype)
        if add:
            with np.errstate(all="ignore"):
                np.add(target, wide, out=target)
        else:
            np.copyto(target, wide)


class Fp8Codec:
    """float8 e4m3fn codes with one power-of-two float32 scale per block."""

    name = "fp8"
    block = FP8_BLOCK

    def nbytes(self, count: int) -> int:
        return count + 4 * -(-count // FP8_BLOCK)

    def count(self, nbytes: int) -> int:
        blocks = -(-nbytes // _BLOCK_BYTES)
        count = nbytes - 4 * blocks
        if count <= 0 or -(-count // FP8_BLOCK) != blocks:
            raise ProtocolError(f"an fp8 slice of {nbytes} bytes fits no element count")
        return count

    def encode(self, values: np.ndarray) -> memoryview:
        count = values.size
        blocks = -(-count // FP8_BLOCK)
        out = np.empty(count + 4 * blocks, np.uint8)
        if _compiled(values):
            _wirecodec.encode(1, values, out)
            return out.data
        padded = np.zeros(blocks * FP8_BLOCK, values.dtype)
        padded[:count] = values
        rows = padded.reshape(blocks, FP8_BLOCK)
        with np.errstate(all="ignore"):
            magnitude = np.abs(rows)
            finite = np.isfinite(magnitude)
            amax = np.where(finite, magnitude, 0).max(axis=1).astype(np.float64)
            mantissa, exponent = np.frexp(amax / FP8_MAX)
            exponent = np.where(mantissa == 0.5, exponent - 1, exponent)
            exponent = np.where(amax == 0, SCALE_EXP_MIN, exponent)
            exponent = np.clip(exponent, SCALE_EXP_MIN, SCALE_EXP_MAX).astype(np.int32)
            scaled = np.ldexp(rows, -exponent[:, None])
            scaled[~finite] = np.nan
            codes = scaled.astype(_float8())
        scales = np.ldexp(np.float32(1.0), exponent).astype("<f4")
        out[: 4 * blocks] = scales.view(np.uint8)
        out[4 * blocks :] = codes.reshape(-1)[:count].view(np.uint8)
        self._decoded(scales, codes.reshape(-1)[:count], values, add=False)
        return out.data

    def decode_into(self, payload: Any, target: np.ndarray, add: bool) -> None:
        raw = np.frombuffer(payload, np.uint8)
        count = target.size
        if raw.size != self.nbytes(count):
            raise ProtocolError(f"an fp8 slice of {raw.size} bytes for {count} elements")
        if _compiled(target):
            _wirecodec.decode(1, raw, target, add)
            return
        blocks = -(-count // FP8_BLOCK)
        scales = raw[: 4 * blocks].view("<f4")
        self._decoded(scales, raw[4 * blocks :].view(_float8()), target, add)

    @staticmethod
    def _decoded(scales: np.ndarray, codes: np.ndarray, target: np.ndarray, add: bool) -> None:
        count = target.size
        blocks = scales.size
        wide = np.zeros(blocks * FP8_BLOCK, target.dtype)
        wide[:count] = codes.astype(target.dtype)
        rows = wide.reshape(blocks, FP8_BLOCK)
        with np.errstate(all="ignore"):
            np.multiply(rows, scales.astype(target.dtype)[:, None], out=rows)
            if add:
                np.add(target, wide[:count], out=target)
            else:
                np.copyto(target, wide[:count])


CODECS: dict[str, WireCodec] = {"bf16": Bf16Codec(), "fp8": Fp8Codec()}
