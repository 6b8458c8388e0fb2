"""The measurement loop one rank runs for one message size.

Method (BASELINES.md): check the result, warm up, then samples of k
back-to-back ops with a barrier before each; every rank keeps its own sample
times and the driver takes the slowest rank per sample.  Sample counts come
from a timed warm-up batch, agreed over ranks so every rank runs the same
number of collectives.

`measure_interleaved` does the same for several variants of one contender
(gradsync's inter-daemon algorithms) on one buffer, taking turns sample by
sample, so that a burst of load from elsewhere hits all variants alike and
their comparison stays fair.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks.contenders import Contender, GradsyncContender
from benchmarks.plan import LATENCY_SIZE, SamplePolicy
from gradsync.client.cli.bench_rank import timed_batch, timed_samples

#: Inputs repeat with this period; chunks are a multiple of it, so one
#: precomputed pattern serves every chunk of a buffer of any length.
_PERIOD = 13
_CHUNK = _PERIOD * 65536


@dataclasses.dataclass
class SizeRecord:
    """What one rank measured for one size (times in nanoseconds)."""

    nbytes: int
    ops_per_sample: int
    samples_ns: list[int]
    warmup_sample_ns: int
    cpu_s: float
    wall_s: float
    daemon_cpu_s: float | None
    daemon_pid: int | None
    correct_before: bool
    correct_after: bool
    wrong_detail: str | None
    latency_ns: list[int] | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def make_pattern() -> np.ndarray:
    """One chunk of the input pattern, i mod 13; built once per rank."""
    return (np.arange(_CHUNK, dtype=np.int64) % _PERIOD).astype(np.float32)


def fill_input(buffer: np.ndarray, rank: int, pattern: np.ndarray) -> None:
    """Rank r's input: element i is (r + 1) + i mod 13 (small integers: sums are exact)."""
    for start in range(0, buffer.size, _CHUNK):
        part = buffer[start : start + _CHUNK]
        np.add(pattern[: part.size], float(rank + 1), out=part)


def check_sum(buffer: np.ndarray, world_size: int, pattern: np.ndarray) -> str | None:
    """None if `buffer` holds the sum of every rank's input, else what is wrong."""
    base = world_size * (world_size + 1) / 2
    expected_chunk = pattern * np.float32(world_size) + np.float32(base)
    wrong = 0
    first: int | None = None
    for start in range(0, buffer.size, _CHUNK):
        part = buffer[start : start + _CHUNK]
        bad = np.flatnonzero(part != expected_chunk[: part.size])
        if bad.size:
            wrong += int(bad.size)
            if first is None:
                first = start + int(bad[0])
    if first is None:
        return None
    got = float(buffer[first])
    want = float(expected_chunk[first % _CHUNK])
    return f"{wrong} of {buffer.size} elements wrong; first at {first}: got {got}, want {want}"


def measure_size(
    contender: Contender, nbytes: int, policy: SamplePolicy, pattern: np.ndarray
) -> SizeRecord:
    """Check, warm up and time allreduce of `nbytes` of float32 on this rank."""
    count = nbytes // 4
    k = policy.ops_for(nbytes)
    buffer = contender.allocate(count)
    op = contender.reducer(buffer)

    fill_input(buffer, contender.rank, pattern)
    contender.barrier()
    op()
    wrong_before = check_sum(buffer, contender.world_size, pattern)

    # Timed data are zeros: the sum stays zero, so values never grow to inf or
    # denormals, whatever the number of ops.
    buffer.fill(0.0)
    contender.barrier()
    timed_batch(op, k)  # first touch, lazy allocations, connection set-up
    contender.barrier()
    warm_ns = timed_batch(op, k)
    samples = policy.samples_for(contender.agree_max(warm_ns / 1e9))

    daemon_before = contender.daemon_cpu_s()
    cpu_before = time.process_time()
    wall_before = time.perf_counter()
    samples_ns = timed_samples(op, k, samples, contender.barrier)
    wall_s = time.perf_counter() - wall_before
    cpu_s = time.process_time() - cpu_before
    daemon_after = contender.daemon_cpu_s()
    daemon_cpu = (
        None if daemon_before is None or daemon_after is None else daemon_after - daemon_before
    )

    latency_ns = None
    if nbytes == LATENCY_SIZE:
        per_op_s = float(np.median(samples_ns)) / k / 1e9
        # Each timed op follows a barrier (itself about one op), so count it twice.
        ops = policy.latency_ops_for(2 * contender.agree_max(per_op_s))
        latency_ns = timed_samples(op, 1, ops, contender.barrier)

    fill_input(buffer, contender.rank, pattern)
    contender.barrier()
    op()
    wrong_after = check_sum(buffer, contender.world_size, pattern)
    contender.barrier()
    del op, buffer

    return SizeRecord(
        nbytes=nbytes,
        ops_per_sample=k,
        samples_ns=samples_ns,
        warmup_sample_ns=warm_ns,
        cpu_s=cpu_s,
        wall_s=wall_s,
        daemon_cpu_s=daemon_cpu,
        daemon_pid=contender.daemon_pid,
        correct_before=wrong_before is None,
        correct_after=wrong_after is None,
        wrong_detail=wrong_before or wrong_after,
        latency_ns=latency_ns,
    )



@dataclasses.dataclass
class _Tally:
    """One variant's samples and the CPU its timed batches used."""

    samples_ns: list[int] = dataclasses.field(default_factory=list)
    cpu_s: float = 0.0
    wall_s: float = 0.0
    daemon_cpu_s: float | None = 0.0


def _checked(
    contender: Contender, buffer: np.ndarray, op: Callable[[], None], pattern: np.ndarray
) -> str | None:
    fill_input(buffer, contender.rank, pattern)
    contender.barrier()
    op()
    return check_sum(buffer, contender.world_size, pattern)


def measure_interleaved(
    contender: GradsyncContender,
    nbytes: int,
    policy: SamplePolicy,
    pattern: np.ndarray,
    algorithms: Sequence[str],
) -> dict[str, SizeRecord]:
    """Check, warm up and time every algorithm on one buffer, taking turns per sample.

    CPU and wall time are counted over each algorithm's timed batches only
    (not the barriers between them).  No per-op latency runs here.
    """
    count = nbytes // 4
    k = policy.ops_for(nbytes)
    buffer = contender.allocate(count)
    ops = {}
    for algorithm in algorithms:
        contender.algorithm = algorithm
        ops[algorithm] = contender.reducer(buffer)
    wrong_before = {a: _checked(contender, buffer, op, pattern) for a, op in ops.items()}

    buffer.fill(0.0)  # timed data are zeros: sums stay zero (see measure_size)
    warm_ns = {}
    for algorithm, op in ops.items():
        contender.barrier()
        timed_batch(op, k)
        contender.barrier()
        warm_ns[algorithm] = timed_batch(op, k)
    # One sample of every algorithm per turn: the budget covers each of them.
    turn_s = sum(warm_ns.values()) / 1e9 / max(1, len(ops))
    samples = policy.samples_for(contender.agree_max(turn_s))

    tallies = {algorithm: _Tally() for algorithm in ops}
    for _ in range(samples):
        for algorithm, op in ops.items():
            tally = tallies[algorithm]
            contender.barrier()
            daemon_before = contender.daemon_cpu_s()
            cpu_before = time.process_time()
            elapsed = timed_batch(op, k)
            tally.cpu_s += time.process_time() - cpu_before
            daemon_after = contender.daemon_cpu_s()
            tally.samples_ns.append(elapsed)
            tally.wall_s += elapsed / 1e9
            if daemon_before is None or daemon_after is None or tally.daemon_cpu_s is None:
                tally.daemon_cpu_s = None
            else:
                tally.daemon_cpu_s += daemon_after - daemon_before

    wrong_after = {a: _checked(contender, buffer, op, pattern) for a, op in ops.items()}
    contender.barrier()
    del ops, buffer
    return {
        algorithm: SizeRecord(
            nbytes=nbytes,
            ops_per_sample=k,
            samples_ns=tally.samples_ns,
            warmup_sample_ns=warm_ns[algorithm],
            cpu_s=tally.cpu_s,
            wall_s=tally.wall_s,
            daemon_cpu_s=tally.daemon_cpu_s,
            daemon_pid=contender.daemon_pid,
            correct_before=wrong_before[algorithm] is None,
            correct_after=wrong_after[algorithm] is None,
            wrong_detail=wrong_before[algorithm] or wrong_after[algorithm],
            latency_ns=None,
        )
        for algorithm, tally in tallies.items()
    }
