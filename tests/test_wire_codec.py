"""The wire codecs (daemon/backends/wire_codec.py) and compressed schedules, in-process.

The compiled codec must equal the numpy one bit for bit (both may meet in one
job), in every variant of its kernels this CPU runs (avx512, avx2, baseline);
each rounding must stay within the bound the module states; rounding twice must
change nothing; and every daemon of a compressed run, with the executor fed in
any order, must end bit-identical, for every algorithm and 1 to 9 daemons, with
the same bytes on several codec threads as on none.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import platform
import random
import subprocess
import sys
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


def _run_on_lanes(algorithm: str, daemons: int, count: int, name: str, lanes: int,
                  seed: int | None) -> list[bytes]:
    """Every daemon's buffer after a compressed allreduce of 256 KiB slices (what a
    codec lane takes off the loop) coded on `lanes` threads (0: inline), slices
    delivered as they are sent (`seed` None) or in a shuffled order."""
    codec = CODECS[name]

    async def main() -> list[bytes]:
        loop = asyncio.get_running_loop()
        queue: list[tuple[int, int, dict[str, int], bytes]] = []
        buffers = [awkward(count, 300 + d) for d in range(daemons)]
        buffers = [np.where(np.isfinite(b), np.clip(b, -1e30, 1e30), b) for b in buffers]
        units = -(-count // codec.block)
        schedules = [in_blocks(ALGORITHMS[algorithm](me, daemons, units), codec.block, count)
                     for me in range(daemons)]

        def sender(me: int):  # type: ignore[no-untyped-def]
            def send(peer: int, header: dict[str, int], payload: object, zero: bool) -> None:
                queue.append((me, peer, header, bytes(payload)))  # type: ignore[call-overload]
            return send

        pool = concurrent.futures.ThreadPoolExecutor(lanes) if lanes else None
        try:
            runs = [ScheduleRun(schedule, buffers[me], ReduceOp.SUM, sender(me), 256 * 1024,
                                loop, codec=codec, codec_pool=pool)
                    for me, schedule in enumerate(schedules)]
            for run in runs:
                run.start()
            shuffle = None if seed is None else random.Random(seed)
            deadline = loop.time() + 60
            while not all(run.done.done() for run in runs):
                assert loop.time() < deadline, "the runs did not finish"
                if not queue:
                    await asyncio.sleep(0.001)  # codec threads at work
                    continue
                source, target, header, payload = queue.pop(
                    0 if shuffle is None else shuffle.randrange(len(queue)))
                runs[target].deliver(source, header["step"], header["t"], header["off"],
                                     payload)
            for run in runs:
                await run.wait_sent(10)
            assert all(run.done.exception() is None for run in runs)
        finally:
            if pool is not None:
                pool.shutdown()
        return [buffer.tobytes() for buffer in buffers]

    return asyncio.run(main())


@pytest.mark.parametrize("name", ["bf16", "fp8"])
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_codec_threads_and_arrival_order_change_no_bit(name: str, algorithm: str) -> None:
    """1, 2 and 4 codec threads, slices in any order: the bytes of a run coded inline
    with slices in sending order, on every daemon.  Each element sees the same
    operations in the same order (a star's root adds its leaves in the order its
    step lists them, whichever arrives first); values over float32's whole range
    make any other order of additions show."""
    for daemons in (3, 4):
        count = 3 * 65_536 + 1_001
        want = _run_on_lanes(algorithm, daemons, count, name, 0, None)
        assert len(set(want)) == 1
        for lanes, seed in ((1, 1), (2, 2), (4, 3), (4, None)):
            got = _run_on_lanes(algorithm, daemons, count, name, lanes, seed)
            assert got == want, (daemons, lanes, seed)


VARIANTS = ("avx512", "avx2", "baseline")
#: Lengths that end the vector loops of every width (4, 8, 16 lanes) and fp8 blocks
#: at every kind of tail.
LENGTHS = (1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 63, 65, 255, 256, 257, 511, 1023, 4099)


@pytest.fixture(params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test with each variant of the C module's kernels this CPU runs."""
    if wire_codec._wirecodec is None:
        pytest.fail("daemon/backends/_wirecodec.c was not built (CI has a C compiler)")
    if request.param not in wire_codec.variants():
        pytest.skip(f"this CPU does not run {request.param}")
    before = wire_codec.variant()
    assert before is not None
    wire_codec.set_variant(request.param)
    try:
        yield request.param
    finally:
        wire_codec.set_variant(before)


def blocks_of(kind: str, count: int, seed: int) -> np.ndarray:
    """float32 values of one kind: random, subnormal, huge, nonfinite, zeros, equal, ties,
    scales (block maxima at and beside each boundary 448 * 2^k of the fp8 scale)."""
    rng = np.random.default_rng(seed)
    sign = rng.choice([-1.0, 1.0], count)
    if kind == "random":
        values = rng.standard_normal(count) * np.exp2(rng.integers(-20, 20, count))
    elif kind == "subnormal":  # float32 subnormals, the smallest normals, and 2^-149
        values = sign * rng.uniform(0, 2.0**-125, count)
        values[rng.integers(0, count, max(1, count // 10))] = 2.0**-149
    elif kind == "huge":  # bf16 rounds the largest to infinity
        values = sign * rng.uniform(0.5, 1.0, count) * float(np.finfo(np.float32).max)
        values[rng.integers(0, count, max(1, count // 10))] = float(np.finfo(np.float32).max)
    elif kind == "nonfinite":  # whole blocks of them too: amax 0
        values = rng.standard_normal(count)
        values[rng.random(count) < 0.3] = np.nan
        values[rng.random(count) < 0.2] = np.inf
        values[rng.random(count) < 0.2] = -np.inf
        values[256:512] = np.nan
    elif kind == "zeros":
        values = sign * 0.0
    elif kind == "equal":
        values = np.full(count, rng.standard_normal() * 2.0 ** rng.integers(-60, 60))
    elif kind == "ties":  # 448 makes the fp8 scale 1: halfway between e4m3 codes, and bf16
        steps = np.concatenate([(np.arange(8) + 0.5) * 2.0**-9,
                                (1 + (2 * np.arange(8) + 1) / 16) * np.exp2(np.arange(-6, 2))])
        values = sign * np.resize(np.concatenate([[448.0], steps, 1 + 2.0**-8 + steps]), count)
        values[::256] = 448.0
    else:
        assert kind == "scales"
        boundary = np.ldexp(np.float32(448), np.arange(-155, 120)).astype(np.float32)
        maxima = np.concatenate([boundary, np.nextafter(boundary, np.float32(0)),
                                 np.nextafter(boundary, np.float32(np.inf))])
        values = np.resize(maxima.repeat(256) * rng.uniform(0, 1, 256 * maxima.size), count)
        values[: 256 * (count // 256) : 256] = maxima[: count // 256]
        values = sign * values
    return values.astype(np.float32)


KINDS = ("random", "subnormal", "huge", "nonfinite", "zeros", "equal", "ties", "scales")


def _bits_equal(ours: np.ndarray, theirs: np.ndarray) -> None:
    """The same float32 bits, but for NaN, which need only be NaN in both."""
    nan = np.isnan(theirs)
    np.testing.assert_array_equal(np.isnan(ours), nan)
    np.testing.assert_array_equal(ours.view(np.uint32)[~nan], theirs.view(np.uint32)[~nan])


def _by_numpy(codec: wire_codec.WireCodec, values: np.ndarray, payload: bytes | None,
              target: np.ndarray) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray]:
    """numpy's encoding of `values` (or `payload` as given), the values it rounds to,
    and its decodings of it into copies of `target`, overwriting and adding."""
    compiled = wire_codec._wirecodec
    try:
        wire_codec._wirecodec = None
        rounded = values.copy()
        encoded = bytes(codec.encode(rounded)) if payload is None else payload
        decoded, added = target.copy(), target.copy()
        codec.decode_into(encoded, decoded, add=False)
        codec.decode_into(encoded, added, add=True)
    finally:
        wire_codec._wirecodec = compiled
    return encoded, rounded, decoded, added


@pytest.mark.parametrize("name", ["bf16", "fp8"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_variant_encodes_and_decodes_as_numpy_does(variant: str, name: str,
                                                         kind: str) -> None:
    codec = CODECS[name]
    for count in (*LENGTHS, 3 * 275 * 256 if kind == "scales" else 20_000):
        original = blocks_of(kind, count, seed=count)
        target = blocks_of("nonfinite" if count % 2 else "random", count, seed=count + 1)
        encoded, rounded, decoded, added = _by_numpy(codec, original, None, target)
        for offset in (0, 1):  # and from an address no vector is aligned to
            values = np.empty(count + offset, np.float32)[offset:]
            values[:] = original
            assert bytes(codec.encode(values)) == encoded, (count, offset)
            _bits_equal(values, rounded)
            ours = np.empty(count + offset, np.float32)[offset:]
            for add, expected in ((False, decoded), (True, added)):
                ours[:] = target
                codec.decode_into(encoded, ours, add=add)
                _bits_equal(ours, expected)


@pytest.mark.parametrize("name", ["bf16", "fp8"])
def test_every_variant_decodes_any_payload_as_numpy_does(variant: str, name: str) -> None:
    """Every code, and fp8 scales no encoder writes (not powers of two, subnormal,
    huge, infinite, NaN): a multiply and an add each round once, in every variant."""
    codec = CODECS[name]
    rng = np.random.default_rng(5)
    for count in (*LENGTHS, 65_536):
        if name == "bf16":
            payload = rng.integers(0, 1 << 16, count, dtype=np.uint16).tobytes()
        else:
            blocks = -(-count // 256)
            scales = rng.integers(0, 1 << 32, blocks, dtype=np.uint32).view(np.float32)
            scales[::3] = rng.standard_normal(scales[::3].size) * 2.0 ** rng.integers(
                -140, 127, scales[::3].size)
            codes = np.resize(np.arange(256, dtype=np.uint8), count)
            payload = scales.astype("<f4").tobytes() + rng.permutation(codes).tobytes()
        target = blocks_of("random" if count % 2 else "huge", count, seed=count)
        target[::7] = np.inf
        _, _, decoded, added = _by_numpy(codec, target, payload, target)
        for add, expected in ((False, decoded), (True, added)):
            ours = target.copy()
            codec.decode_into(payload, ours, add=add)
            _bits_equal(ours, expected)


def test_the_variants_give_the_same_bits_even_for_nan() -> None:
    """What numpy's NaN may differ in (sign, payload), the variants agree on too."""
    if len(wire_codec.variants()) < 2:
        pytest.skip("this CPU runs one variant")
    before = wire_codec.variant()
    assert before is not None
    values = np.concatenate([blocks_of(kind, 4099, seed=9) for kind in KINDS])
    target = blocks_of("nonfinite", values.size, seed=10)
    results: dict[str, list[bytes]] = {}
    try:
        for name in wire_codec.variants():
            wire_codec.set_variant(name)
            outputs = []
            for codec in CODECS.values():
                rounded = values.copy()
                encoded = bytes(codec.encode(rounded))
                outputs += [encoded, rounded.tobytes()]
                for add in (False, True):
                    decoded = target.copy()
                    codec.decode_into(encoded, decoded, add=add)
                    outputs.append(decoded.tobytes())
            results[name] = outputs
    finally:
        wire_codec.set_variant(before)
    baseline = results.pop("baseline")
    for name, outputs in results.items():
        assert outputs == baseline, name


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((set(line.split(":", 1)[1].split()) for line in cpuinfo
                         if line.startswith("flags")), set())
    except OSError:
        return set()


def test_the_module_runs_the_best_variant_the_cpu_offers() -> None:
    assert wire_codec._wirecodec is not None, "daemon/backends/_wirecodec.c was not built"
    offered = wire_codec.variants()
    assert offered[-1] == "baseline" and set(offered) <= set(VARIANTS)
    flags = _cpu_flags()
    if platform.machine() in ("x86_64", "AMD64") and flags:
        avx2 = {"avx2", "fma", "f16c"} <= flags
        avx512 = avx2 and {"avx512f", "avx512bw", "avx512vl"} <= flags
        assert offered == tuple(name for name, runs in
                                (("avx512", avx512), ("avx2", avx2), ("baseline", True))
                                if runs)
    elif platform.machine() not in ("x86_64", "AMD64"):
        assert offered == ("baseline",)
    if not os.environ.get("GRADSYNC_CODEC_VARIANT"):
        assert wire_codec.variant() == offered[0]
    with pytest.raises(ValueError, match="this CPU runs"):
        wire_codec.set_variant("sse9")


@pytest.mark.parametrize("asked", ["baseline", "auto", "sse9"])
def test_gradsync_codec_variant_chooses_at_import(asked: str) -> None:
    """GRADSYNC_CODEC_VARIANT: a variant this CPU runs; auto: the best; else a warning."""
    script = ("import warnings; warnings.simplefilter('always'); "
              "from gradsync.daemon.backends import wire_codec; "
              "print(wire_codec.variant(), *wire_codec.variants())")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "GRADSYNC_CODEC_VARIANT": asked}, check=True)
    chosen, best, *_ = done.stdout.split()
    assert chosen == (best if asked != "baseline" else "baseline")
    assert ("RuntimeWarning: GRADSYNC_CODEC_VARIANT=sse9" in done.stderr) == (asked == "sse9")
