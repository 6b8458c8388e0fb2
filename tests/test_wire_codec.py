"""The wire codecs (daemon/backends/wire_codec.py) and compressed schedules, in-process.

The compiled codec must equal the numpy one bit for bit (both may meet in one
job); each rounding must stay within the bound the module states; rounding
twice must change nothing; and every daemon of a compressed run, with the
executor fed in any order, must end bit-identical, for every algorithm and
1 to 9 daemons.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest

from gradsync.daemon.algorithms import ALGORITHMS
from gradsync.daemon.algorithms.schedule import check_schedules, in_blocks
from gradsync.daemon.backends import wire_codec
from gradsync.daemon.backends.wire_codec import CODECS
from gradsync.daemon.run.executor import ScheduleRun
from gradsync.protocol.dtypes import ReduceOp
from gradsync.protocol.errors import ProtocolError


def awkward(count: int, seed: int, dtype: type = np.float32) -> np.ndarray:
    """Values over the whole float32 range, rounding ties, NaN, infinities, -0.0."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(count) * np.exp2(rng.integers(-150, 127, count))
    values = values.astype(dtype)
    for special in (np.inf, -np.inf, np.nan, -0.0):
        values[rng.integers(0, count, max(1, count // 200))] = special
    ties = rng.integers(0, count, max(1, count // 20))
    values[ties] = (1 + 2.0**-8) * np.exp2(rng.integers(-30, 30, ties.size))  # bf16 ties
    return values


@pytest.fixture(params=["compiled", "numpy"])
def implementation(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test with the C module, and with numpy alone."""
    compiled = wire_codec._wirecodec
    if request.param == "numpy":
        wire_codec._wirecodec = None
    elif compiled is None:
        pytest.fail("daemon/backends/_wirecodec.c was not built (CI has a C compiler)")
    try:
        yield request.param
    finally:
        wire_codec._wirecodec = compiled


@pytest.mark.parametrize("name", ["bf16", "fp8"])
@pytest.mark.parametrize("count", [1, 255, 256, 257, 10_007])
def test_the_c_module_encodes_and_decodes_as_numpy_does(name: str, count: int) -> None:
    codec = CODECS[name]
    compiled = wire_codec._wirecodec
    assert compiled is not None, "daemon/backends/_wirecodec.c was not built"
    for seed in range(4):
        values = awkward(count, seed)
        if seed == 1:
            values = np.where(np.isfinite(values), np.clip(values, -1e3, 1e3), values)
        ours, theirs = values.astype(np.float32), values.astype(np.float32)
        encoded = bytes(codec.encode(ours))
        try:
            wire_codec._wirecodec = None
            assert bytes(codec.encode(theirs)) == encoded
            by_numpy = [np.full(count, 1.5, np.float32) for _ in range(2)]
            codec.decode_into(encoded, by_numpy[0], add=False)
            codec.decode_into(encoded, by_numpy[1], add=True)
        finally:
            wire_codec._wirecodec = compiled
        np.testing.assert_array_equal(ours, theirs)
        for add, expected in zip((False, True), by_numpy, strict=True):
            target = np.full(count, 1.5, np.float32)
            codec.decode_into(encoded, target, add=add)
            np.testing.assert_array_equal(target, expected)
        np.testing.assert_array_equal(ours, by_numpy[0])  # rounded to what it decodes to


@pytest.mark.parametrize("name", ["bf16", "fp8"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_each_rounding_is_within_its_bound_and_idempotent(
    implementation: str, name: str, dtype: type
) -> None:
    codec = CODECS[name]
    values = awkward(4096, 7, dtype)
    if dtype is np.float64:
        values = np.where(np.abs(values) < 1e38, values, np.nan)  # inside float32's range
    original = values.copy()
    encoded = bytes(codec.encode(values))
    assert len(encoded) == codec.nbytes(values.size) and codec.count(len(encoded)) == 4096
    again = values.copy()
    codec.encode(again)
    np.testing.assert_array_equal(again, values)  # idempotent
    finite = np.isfinite(original)
    error = np.abs(values[finite].astype(np.float64) - original[finite])
    size = np.abs(original[finite].astype(np.float64))
    if name == "bf16":
        assert np.all(error <= (2.0**-8 + 2.0**-24) * size + 2.0**-134)
        assert np.array_equal(np.isnan(values), np.isnan(original))
        assert np.array_equal(np.isinf(values), np.isinf(original))
    else:
        blocks = np.where(finite, np.abs(original), 0).reshape(-1, 256).max(axis=1)
        amax = blocks.repeat(256)[finite]
        assert np.all(error <= 2.0**-4 * size + 2.0**-17 * amax)
        assert np.all(np.isnan(values[~finite]))
    zeros = original == 0
    np.testing.assert_array_equal(np.signbit(values[zeros]), np.signbit(original[zeros]))


def test_fp8_scales_values_far_beyond_its_range() -> None:
    """Each block has its own scale: 3e38, 1e30 and 1e-30 (and float32 subnormals)
    in blocks of their own all keep e4m3's 4 bits; beside 3e38, 1e30 is below the
    block's finest step and goes to zero."""
    codec = CODECS["fp8"]
    rng = np.random.default_rng(3)
    magnitudes = np.array([3e38, 1e30, 1e-30, 1e-40, 3e38], np.float64).repeat(256)
    original = (magnitudes * rng.uniform(0.5, 1.0, magnitudes.size)).astype(np.float32)
    original[-1] = 1e30
    values = original.copy()
    codec.encode(values)
    error = np.abs(values[:-1].astype(np.float64) - original[:-1])
    assert np.all(error <= 2.0**-4 * np.abs(original[:-1]) + 2.0**-149)
    assert values[-1] == 0


@pytest.mark.parametrize("nbytes", [1, 3, 4, 260 + 4, 0])
def test_a_payload_that_fits_no_count_is_a_protocol_error(nbytes: int) -> None:
    codec = CODECS["fp8" if nbytes % 2 == 0 else "bf16"]
    with pytest.raises(ProtocolError, match="slice of"):
        codec.count(nbytes)


def _run_compressed(algorithm: str, daemons: int, count: int, name: str) -> list[np.ndarray]:
    """Every daemon's buffer after a compressed allreduce, slices in a shuffled order."""
    codec = CODECS[name]

    async def main() -> list[np.ndarray]:
        queue: list[tuple[int, int, dict[str, int], bytes]] = []
        buffers = [awkward(count, 100 + d) for d in range(daemons)]
        buffers = [np.where(np.isfinite(b), np.clip(b, -1e30, 1e30), b) for b in buffers]
        units = -(-count // codec.block)
        schedules = [in_blocks(ALGORITHMS[algorithm](me, daemons, units), codec.block, count)
                     for me in range(daemons)]
        check_schedules(schedules)
        loop = asyncio.get_running_loop()

        def sender(me: int):  # type: ignore[no-untyped-def]
            def send(peer: int, header: dict[str, int], payload: object, zero: bool) -> None:
                queue.append((me, peer, header, bytes(payload)))  # type: ignore[call-overload]
            return send

        runs = [ScheduleRun(schedule, buffers[me], ReduceOp.SUM, sender(me), 3000, loop,
                            codec=codec) for me, schedule in enumerate(schedules)]
        for run in runs:
            run.start()
        shuffle = random.Random(daemons * 7 + count)
        while queue:
            source, target, header, payload = queue.pop(shuffle.randrange(len(queue)))
            runs[target].deliver(source, header["step"], header["t"], header["off"], payload)
        assert all(run.done.done() and run.done.exception() is None for run in runs)
        assert all(run.bytes_sent <= codec.nbytes(run.bytes_raw // 4) + 4 * 64 for run in runs)
        return buffers

    return asyncio.run(main())


@pytest.mark.parametrize("name", ["bf16", "fp8"])
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_daemon_ends_bit_identical(implementation: str, name: str, algorithm: str) -> None:
    for daemons in range(1, 10):
        for count in (1, 300, 2_561):
            buffers = _run_compressed(algorithm, daemons, count, name)
            for other in buffers[1:]:
                assert other.tobytes() == buffers[0].tobytes(), (daemons, count)
            if name == "bf16" and daemons > 1:  # every element crossed the wire
                finite = buffers[0][np.isfinite(buffers[0])]
                np.testing.assert_array_equal(
                    finite.astype(ml_dtypes.bfloat16).astype(np.float32), finite)
