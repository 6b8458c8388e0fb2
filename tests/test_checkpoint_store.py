"""The daemon's checkpoint bookkeeping (daemon/checkpoints.py) and its requests, without
a daemon process: segments from a real pool, time from a fake clock."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from gradsync.daemon.backends import Buffers
from gradsync.daemon.checkpoints import CheckpointStore
from gradsync.protocol import messages
from gradsync.protocol.errors import CheckpointError, InvalidArgumentError, ShmExhaustedError
from gradsync.protocol.requests import CheckpointCommit, CheckpointOpen, parse_request

PAGE = 4096


@pytest.fixture
def store() -> Iterator[CheckpointStore]:
    ticks = itertools.count()
    checkpoints = CheckpointStore(Buffers(10 * PAGE), kept=2, clock=lambda: float(next(ticks)))
    yield checkpoints
    checkpoints.release_all()
    assert checkpoints.buffers.in_use == 0 and len(checkpoints.buffers) == 0


def save(store: CheckpointStore, step: int, ranks: int = 2, nbytes: int = PAGE) -> None:
    for rank in range(ranks):
        store.put("j", step, rank, "data", nbytes)
    store.commit("j", step, tuple((rank, "data") for rank in range(ranks)))


def test_only_committed_checkpoints_open_and_the_newest_k_stay(store: CheckpointStore) -> None:
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        store.open("j", None)
    store.put("j", 1, 0, "data", 100)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        store.open("j", None)  # put, not committed
    with pytest.raises(CheckpointError, match=r"parts \[\(1, 'data'\)\]"):
        store.commit("j", 1, ((0, "data"), (1, "data")))
    store.put("j", 1, 1, "data", 100)
    store.commit("j", 1, ((0, "data"), (1, "data")))
    assert store.open("j", None).step == 1
    save(store, 2)
    store.put("j", 3, 0, "data", 100)  # a save that died: rank 1 never wrote
    save(store, 4)
    save(store, 5)
    assert [c.step for c in store.complete("j")] == [5, 4]
    assert sorted(store.jobs["j"]) == [4, 5]  # step 3 was superseded, 1 and 2 pruned
    assert store.buffers.in_use == 4 * PAGE
    with pytest.raises(CheckpointError, match="complete: \\[5, 4\\]"):
        store.open("j", 2)
    with pytest.raises(CheckpointError, match="already complete"):
        store.put("j", 5, 0, "data", 10)
    entry = store.snapshot()["j"][0]
    assert entry["age_s"] > 0
    assert entry | {"age_s": 0} == {"step": 5, "bytes": 2 * PAGE, "age_s": 0, "complete": True,
                                    "ranks": [0, 1]}


def test_a_part_put_again_replaces_the_old_one(store: CheckpointStore) -> None:
    store.put("j", 1, 0, "data", PAGE)
    store.put("j", 1, 0, "data", 2 * PAGE)  # the save retried after a crash
    assert store.buffers.in_use == 2 * PAGE
    store.commit("j", 1, ((0, "data"),))
    assert store.open("j", 1).parts[(0, "data")].nbytes == 2 * PAGE


def test_over_the_budget_the_save_fails_and_the_complete_ones_stay(
    store: CheckpointStore
) -> None:
    save(store, 1, nbytes=2 * PAGE)
    store.put("j", 2, 0, "data", 2 * PAGE)  # then rank 1 died: step 2 never completes
    # Out of room, a later step first drops the abandoned unfinished one.
    store.put("j", 3, 0, "data", 5 * PAGE)
    assert sorted(store.jobs["j"]) == [1, 3]
    with pytest.raises(ShmExhaustedError, match=r"checkpoint step 3 of job 'j'.*max_shm_bytes"
                       r".*not saved"):
        store.put("j", 3, 1, "data", 2 * PAGE)
    assert [c.step for c in store.complete("j")] == [1]
    assert sorted(store.jobs["j"]) == [1]  # step 3 gave its space back
    assert store.buffers.in_use == 4 * PAGE


def wire(kind: str, **fields: Any) -> Any:
    return parse_request(messages.decode_request(
        msgpack.packb(messages.request(kind, 1, **fields), use_bin_type=True)))


def test_checkpoint_requests_are_checked() -> None:
    assert wire("ckpt_open", job="j") == CheckpointOpen("j", None)
    assert wire("ckpt_commit", job="j", step=3, parts=[[0, "data"], [1, "m"]]) == \
        CheckpointCommit("j", 3, ((0, "data"), (1, "m")))
    for kind, fields, error in [
        ("ckpt_put", {"job": "j", "step": -1, "item": "d", "nbytes": 1}, "step must be"),
        ("ckpt_put", {"job": "j", "step": 1, "item": "", "nbytes": 1}, "item must be"),
        ("ckpt_put", {"job": "j", "step": 1, "item": "d\n", "nbytes": 1}, "item must be"),
        ("ckpt_put", {"job": "j", "step": 1, "item": "d", "nbytes": 0}, "positive size"),
        ("ckpt_put", {"job": "", "step": 1, "item": "d", "nbytes": 1}, "job name"),
        ("ckpt_commit", {"job": "j", "step": 1, "parts": []}, "at least one part"),
        ("ckpt_commit", {"job": "j", "step": 1, "parts": [[True, "d"]]}, "rank, item"),
        ("ckpt_commit", {"job": "j", "step": 1, "parts": [[0, "d", 1]]}, "rank, item"),
    ]:
        with pytest.raises(InvalidArgumentError, match=error):
            wire(kind, **fields)
    with pytest.raises(Exception, match="unknown fields"):
        wire("ckpt_list", job="j", rank=3)


def test_a_checkpoint_session_names_its_job_and_rank() -> None:
    from gradsync.protocol.requests import checkpoint_session_job, parse_checkpoint_session_job

    assert checkpoint_session_job("a#1", 3) == "checkpoint:a#1#3"
    assert parse_checkpoint_session_job("checkpoint:a#1#3") == ("a#1", 3)
    for other in ("a", "checkpoint:a", "checkpoint:#3", "checkpoint:a#x", "a#3"):
        assert parse_checkpoint_session_job(other) is None, other
