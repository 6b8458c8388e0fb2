"""The registry of collective kinds (daemon/core/collectives/): one module per kind,
found by its wire name, covering exactly the wire's collectives."""

from __future__ import annotations

import numpy as np
import pytest

from gradsync.daemon.core.collectives import KINDS, chooses_algorithm, chunk_count, run_local
from gradsync.protocol.dtypes import ReduceOp
from gradsync.protocol.errors import InvalidArgumentError
from gradsync.protocol.requests import ALLREDUCE, COLLECTIVES


def test_every_wire_collective_has_exactly_one_kind() -> None:
    assert set(KINDS) == COLLECTIVES and ALLREDUCE in KINDS
    assert all(kind.name == name for name, kind in KINDS.items())
    assert [name for name in sorted(KINDS) if chooses_algorithm(name)] == [ALLREDUCE]


def test_an_unknown_kind_is_refused_by_name() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown collective 'allgather'"):
        chunk_count("allgather", 0, None, 4, 8, 2)


@pytest.mark.parametrize(("kind", "rank", "root", "count", "out_count", "chunk"), [
    ("allreduce", 0, None, 6, None, 6),
    ("broadcast", 1, 0, 6, None, 6),
    ("all_gather", 0, None, 3, 6, 3),
    ("reduce_scatter", 0, None, 6, 3, 3),
    ("gather", 0, 0, 3, 6, 3),
    ("gather", 1, 0, 3, None, 3),
    ("scatter", 0, 0, 6, 3, 3),
    ("scatter", 1, 0, 0, 3, 3),
    ("all_to_all", 0, None, 6, 6, 3),
])
def test_each_kind_says_its_chunk(kind: str, rank: int, root: int | None, count: int,
                                  out_count: int | None, chunk: int) -> None:
    assert chunk_count(kind, rank, root, count, out_count, 2) == chunk


def test_a_size_rule_broken_names_the_kind_and_the_world() -> None:
    with pytest.raises(InvalidArgumentError, match=r"all_gather with world_size 2: output must"):
        chunk_count("all_gather", 0, None, 3, 5, 2)


def test_a_local_all_to_all_transposes_the_chunks() -> None:
    ins = {rank: np.arange(4, dtype=np.float32) + 10 * rank for rank in range(2)}
    outs = {rank: np.zeros(4, np.float32) for rank in range(2)}
    run_local("all_to_all", ins, outs, 2, 2, None, None)  # type: ignore[arg-type]
    np.testing.assert_array_equal(outs[0], [0, 1, 10, 11])
    np.testing.assert_array_equal(outs[1], [2, 3, 12, 13])
    reduced = {rank: np.full(2, rank + 1.0, np.float32) for rank in range(2)}
    run_local("reduce", reduced, {}, 2, 2, ReduceOp.AVG, 1)  # type: ignore[arg-type]
    np.testing.assert_array_equal(reduced[1], [1.5, 1.5])
    np.testing.assert_array_equal(reduced[0], [1.0, 1.0])
