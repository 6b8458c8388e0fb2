"""Inter-daemon allreduce schedules, run on arrays by the lockstep simulator.

Every algorithm, every M from 1 to 17, counts 0, 1, M - 1, M + 1 (and
1,000,003 for a subset of M): every daemon must end with exactly the reduction
of all inputs (float64 holding small integers, so sums are exact; int64 bit
patterns for the bitwise ops, where xor shows any element combined twice), the
schedules must obey the pairing and overlap rules, and each daemon's traffic
must match theory.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradsync.daemon.algorithms import (
    ALGORITHMS,
    Recv,
    Schedule,
    ScheduleError,
    Send,
    Step,
    build_schedules,
    check_schedules,
    double_binary_tree,
    tree,
)
from gradsync.daemon.algorithms.simulate import SimulationResult, simulate
from gradsync.daemon.algorithms.tree import default_tree_chunks, tree_steps

pytestmark = pytest.mark.timeout(60)

SIZES = range(1, 18)
LARGE_COUNT = 1_000_003
LARGE_SIZES = (1, 2, 3, 5, 8, 13, 16, 17)
LARGE_MAX_SIZES = (3, 16, 17)  # max is checked on every size with small counts already
ITEMSIZE = 8  # float64, and int64 for the bitwise ops
EXPECTED = {"sum": np.add.reduce, "max": np.maximum.reduce, "band": np.bitwise_and.reduce,
            "bor": np.bitwise_or.reduce, "bxor": np.bitwise_xor.reduce}
BITWISE = ("band", "bor", "bxor")


def small_counts(size: int) -> list[int]:
    return sorted({0, 1, max(size - 1, 0), size + 1, 3 * size + 2})


def make_inputs(size: int, count: int, seed: int, op: str = "sum") -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if op in BITWISE:
        return [rng.integers(-(2**63), 2**63, count, dtype=np.int64) for _ in range(size)]
    return [rng.integers(-8, 9, count).astype(np.float64) for _ in range(size)]


def run(algorithm: str, size: int, count: int, op: str) -> SimulationResult:
    """Simulate one allreduce and assert every daemon holds the exact reduction."""
    schedules = build_schedules(algorithm, size, count)
    inputs = make_inputs(size, count, seed=size * 7919 + count, op=op)
    result = simulate(schedules, inputs, op)
    expected = EXPECTED[op](np.stack(inputs), axis=0)
    for rank, output in enumerate(result.outputs):
        assert np.array_equal(output, expected), f"{algorithm} M={size} D={count}: daemon {rank}"
    return result


def is_power_of_two(size: int) -> bool:
    return size & (size - 1) == 0


def expected_steps(algorithm: str, size: int, count: int) -> int:
    if size == 1:
        return 0
    levels = size.bit_length() - 1
    steps: int = {
        "ring": 2 * (size - 1),
        "rhd": 2 * levels if is_power_of_two(size) else 2 * (levels + 1),
        "star": 2,
        "tree": default_tree_chunks(count) + 2 * levels - 1,
    }[algorithm]
    return steps


def check_traffic(algorithm: str, size: int, count: int, result: SimulationResult) -> None:
    """Bytes sent per daemon against theory, with the rounding slack each algorithm allows."""
    sent = [nbytes // ITEMSIZE for nbytes in result.bytes_sent]  # in elements
    assert sum(sent) * ITEMSIZE == sum(result.bytes_received)
    if size == 1:
        assert sent == [0]
        return
    levels = size.bit_length() - 1
    if algorithm == "ring":
        # Every chunk but two neighbours, which together hold 2D/M ± < 1 element
        # (chunk i starts at ⌊iD/M⌋): slack under 1 element.
        ideal = 2 * (size - 1) / size * count
        assert all(abs(s - ideal) < 1 for s in sent), (ideal, sent)
    elif algorithm == "rhd":
        # Reduce-scatter sends D - |own block|, the first all-gather step |own block|; each
        # later step sends 2^j blocks starting at ⌊iD/p⌋, 2^j·D/p ± < 1 element: so the
        # slack is under log2 p - 1 elements (under 1 for p = 2, where it is exact).
        p = 1 << levels
        ideal = 2 * (p - 1) / p * count
        extra = size - p
        for rank, s in enumerate(sent):
            if rank < 2 * extra and rank % 2 == 0:
                assert s == count  # folded away: sends its buffer once
            else:
                folded = count if rank < 2 * extra else 0  # partners send the result back
                assert abs(s - folded - ideal) < max(1, levels - 1), (rank, s, ideal)
    elif algorithm == "star":
        assert sent == [(size - 1) * count] + [count] * (size - 1)
        assert result.bytes_received[0] == (size - 1) * count * ITEMSIZE
    elif algorithm == "tree":
        halves = (count // 2, count - count // 2)
        for rank, s in enumerate(sent):
            # Up to the parent (unless root) and down to each child, in each tree.
            theory = sum(
                half * ((links.parent[rank] is not None) + len(links.children[rank]))
                for links, half in zip(double_binary_tree(size), halves, strict=True)
            )
            assert s == theory
            assert s <= 2 * count + 1
        # Interior daemons with two children (not the root) send ≈ 2D: 3 halves + 1 half.
        first, second = double_binary_tree(size)
        for rank, s in enumerate(sent):
            for links in (first, second):
                if len(links.children[rank]) == 2 and links.parent[rank] is not None:
                    assert abs(s - 2 * count) <= 1


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("size", SIZES)
def test_small_counts_every_size(algorithm: str, size: int) -> None:
    for count in small_counts(size):
        for op in EXPECTED:
            result = run(algorithm, size, count, op)
            check_traffic(algorithm, size, count, result)
        schedules = build_schedules(algorithm, size, count)
        assert {len(s.steps) for s in schedules} == {expected_steps(algorithm, size, count)}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("size", LARGE_SIZES)
def test_large_count(algorithm: str, size: int) -> None:
    result = run(algorithm, size, LARGE_COUNT, "sum")
    check_traffic(algorithm, size, LARGE_COUNT, result)
    if size in LARGE_MAX_SIZES:
        run(algorithm, size, LARGE_COUNT, "max")


@pytest.mark.parametrize("size", [2, 4, 8, 16])
def test_power_of_two_step_counts(size: int) -> None:
    levels = size.bit_length() - 1
    assert len(build_schedules("rhd", size, 100)[0].steps) == 2 * levels
    assert len(build_schedules("ring", size, 100)[0].steps) == 2 * (size - 1)


@pytest.mark.parametrize("size", SIZES)
def test_double_binary_tree_shape(size: int) -> None:
    first, second = double_binary_tree(size)
    for links in (first, second):
        assert links.height(links.root) == size.bit_length() - 1
        assert links.parent[links.root] is None
        assert sum(len(c) for c in links.children) == size - 1
        assert all(len(c) <= 2 for c in links.children)
        for rank in range(size):
            for child in links.children[rank]:
                assert links.parent[child] == rank
    interior = [
        sum(bool(links.children[rank]) for links in (first, second)) for rank in range(size)
    ]
    # No daemon is interior in both trees; with M odd one daemon (rank 0) is a leaf in both.
    assert max(interior) <= 1 or size == 1
    if size > 1:
        assert interior.count(0) == size % 2


@pytest.mark.parametrize("chunks", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("size", [2, 3, 6, 9, 16])
@pytest.mark.parametrize("count", [0, 1, 5, 81, 10_001])
def test_tree_explicit_chunks(chunks: int, size: int, count: int) -> None:
    schedules = [tree(rank, size, count, chunks) for rank in range(size)]
    assert {len(s.steps) for s in schedules} == {tree_steps(size, chunks)}
    inputs = make_inputs(size, count, seed=chunks)
    result = simulate(schedules, inputs, "sum")
    expected = np.add.reduce(np.stack(inputs), axis=0)
    assert all(np.array_equal(output, expected) for output in result.outputs)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_callable_and_enum_ops(algorithm: str) -> None:
    size, count = 6, 23
    inputs = make_inputs(size, count, seed=5)
    schedules = build_schedules(algorithm, size, count)
    lowest = np.minimum.reduce(np.stack(inputs), axis=0)
    assert all(np.array_equal(o, lowest) for o in simulate(schedules, inputs, np.minimum).outputs)
    total = np.add.reduce(np.stack(inputs), axis=0)
    outputs = simulate(schedules, inputs, lambda acc, new: acc + new).outputs
    assert all(np.array_equal(o, total) for o in outputs)
    with pytest.raises(ValueError, match="avg"):
        simulate(schedules, inputs, "avg")


def test_no_zero_length_transfers() -> None:
    for algorithm in ALGORITHMS:
        for size in SIZES:
            for count in small_counts(size):
                for schedule in build_schedules(algorithm, size, count):
                    for step in schedule.steps:
                        assert all(t.start < t.stop for t in (*step.sends, *step.recvs))


def test_bad_arguments() -> None:
    for make in ALGORITHMS.values():
        with pytest.raises(ValueError, match="rank"):
            make(3, 3, 10)
        with pytest.raises(ValueError, match="count"):
            make(0, 3, -1)
        with pytest.raises(ValueError, match="size"):
            make(0, 0, 1)
    with pytest.raises(ValueError, match="chunks"):
        tree(0, 2, 10, chunks=0)
    with pytest.raises(ValueError, match="unknown algorithm"):
        build_schedules("butterfly", 2, 10)


def two_daemons(first: Step, second: Step, count: int = 10) -> list[Schedule]:
    return [Schedule("test", 0, 2, count, (first,)), Schedule("test", 1, 2, count, (second,))]


def test_unpaired_send_is_named() -> None:
    schedules = two_daemons(Step(sends=(Send(1, 0, 5),)), Step(recvs=(Recv(0, 0, 4, True),)))
    with pytest.raises(ScheduleError, match=r"step 0: daemon 0 sends \[0, 5\) to daemon 1"):
        check_schedules(schedules)


def test_receive_overlapping_send_is_named() -> None:
    schedules = two_daemons(
        Step(sends=(Send(1, 0, 5),), recvs=(Recv(1, 4, 8, True),)),
        Step(sends=(Send(0, 4, 8),), recvs=(Recv(0, 0, 5, True),)),
    )
    with pytest.raises(ScheduleError, match=r"daemon 0, step 0: send to 1 \[0, 5\) overlaps"):
        check_schedules(schedules)


def test_copy_overlapping_receive_is_named() -> None:
    schedules = [
        Schedule("test", 0, 3, 10, (Step(recvs=(Recv(1, 0, 5, False), Recv(2, 3, 6, True))),)),
        Schedule("test", 1, 3, 10, (Step(sends=(Send(0, 0, 5),)),)),
        Schedule("test", 2, 3, 10, (Step(sends=(Send(0, 3, 6),)),)),
    ]
    with pytest.raises(ScheduleError, match=r"daemon 0, step 0: copying recv from 1 \[0, 5\)"):
        check_schedules(schedules)
    # Reducing receives may overlap each other (a tree node's two children).
    schedules[0] = Schedule(
        "test", 0, 3, 10, (Step(recvs=(Recv(1, 0, 5, True), Recv(2, 3, 6, True))),)
    )
    check_schedules(schedules)


def test_range_outside_buffer_is_named() -> None:
    schedules = two_daemons(Step(sends=(Send(1, 8, 12),)), Step(recvs=(Recv(0, 8, 12, False),)))
    with pytest.raises(ScheduleError, match=r"daemon 0, step 0: send to 1 range \[8, 12\)"):
        check_schedules(schedules)


def test_simulate_checks_inputs() -> None:
    schedules = build_schedules("ring", 2, 4)
    with pytest.raises(ValueError, match="input 1"):
        simulate(schedules, [np.zeros(4), np.zeros(5)], "sum")
