"""The daemon's checkpoint bookkeeping (daemon/checkpoints.py) and its requests, without
a daemon process: segments from a real pool, time from a fake clock."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from gradsync.daemon import checkpoints as checkpoints_module
from gradsync.daemon.backends import Buffers
from gradsync.daemon.backends.shm_pool import pid_alive
from gradsync.daemon.checkpoint_manifest import (
    Manifest,
    ManifestError,
    ManifestFile,
    SavedCheckpoint,
    SavedPart,
    decode,
    encode,
    plan_adoption,
    read_manifest,
    spared_segments,
    write_manifest,
)
from gradsync.daemon.checkpoint_replicas import ReplicaBusy, ReplicaDropped, ReplicaStore
from gradsync.daemon.checkpoints import CheckpointStore
from gradsync.daemon.io import checkpoint_peers as checkpoint_peers_module
from gradsync.daemon.io.checkpoint_peers import CheckpointPeers, choose_step
from gradsync.protocol import messages
from gradsync.protocol.errors import CheckpointError, InvalidArgumentError, ShmExhaustedError
from gradsync.protocol.peer import CkptChunk, CkptHeld
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
    # Two complete checkpoints of two pages, and each rank's two spares for its next saves.
    assert store.buffers.in_use == 4 * PAGE + 4 * PAGE
    assert {key: len(spares) for key, spares in store.spares.items()} == {
        ("j", 0, "data"): 2, ("j", 1, "data"): 2}
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


# -- the manifest and the takeover by a restarted daemon (part 4) ----------------


def dead_pid() -> int:
    """A pid no process has (above any pid_max there is)."""
    pid = 1 << 30
    while pid_alive(pid):
        pid -= 1
    return pid


def manifest_of(*checkpoints: SavedCheckpoint, pid: int = 7, uid: int | None = None) -> Manifest:
    return Manifest(pid, os.getuid() if uid is None else uid, "/tmp/x/d.sock", checkpoints)


def saved(job: str, step: int, committed: float, *sizes: int) -> SavedCheckpoint:
    return SavedCheckpoint(job, step, committed, tuple(
        SavedPart(rank, "data", f"gradsync-7-{job}{step}r{rank}", size)
        for rank, size in enumerate(sizes)))


def test_a_manifest_round_trips_and_anything_else_is_refused() -> None:
    across = dataclasses.replace(saved("m", 2, 1.0, PAGE), elsewhere=((1, "data"),))
    manifest = manifest_of(saved("j", 3, 1.5, PAGE, 2 * PAGE), saved("k", 1, 2.0, PAGE), across)
    assert decode(encode(manifest)) == manifest
    good = msgpack.unpackb(encode(manifest))
    part = good["checkpoints"][0]["parts"][0]
    for bad, error in [
        (b"\xc1", "not msgpack"),
        (msgpack.packb(good | {"v": 2}), "version 2"),
        (msgpack.packb(good | {"pid": True}), "'pid' is True, not int"),
        (msgpack.packb({k: v for k, v in good.items() if k != "socket"}), "no 'socket'"),
        (msgpack.packb(good | {"checkpoints": [good["checkpoints"][0]] * 2}), "listed twice"),
        (msgpack.packb(good | {"checkpoints": [{**good["checkpoints"][0], "parts": [
            [0, "data", "../../etc/passwd", PAGE]]}]}), "not a gradsync segment name"),
        (msgpack.packb(good | {"checkpoints": [{**good["checkpoints"][0], "parts": [
            [*part[:3], 0]]}]}), "is not \\[rank, item, segment, bytes\\]"),
        (msgpack.packb(good | {"checkpoints": [{**good["checkpoints"][0], "job": "x" * 200}]}),
         "bad length"),
        (msgpack.packb(good | {"checkpoints": [{**good["checkpoints"][0], "committed": None}]}),
         "'committed' is None"),
        (msgpack.packb(good | {"checkpoints": [{**good["checkpoints"][0], "elsewhere": [
            [-1, "data"]]}]}), "'elsewhere' is not"),
    ]:
        with pytest.raises(ManifestError, match=error):
            decode(bad)


def test_the_adoption_takes_whole_checkpoints_newest_first_within_the_budget() -> None:
    old, new, newest = (saved("j", 1, 1.0, PAGE, PAGE), saved("j", 2, 2.0, PAGE, PAGE),
                        saved("k", 9, 3.0, 3 * PAGE))
    sizes = {p.name: p.nbytes for c in (old, new, newest) for p in c.parts}
    plan = plan_adoption(manifest_of(old, new, newest), sizes.get, 5 * PAGE)
    assert plan.adopt == [newest, new]
    [(dropped, why)] = plan.dropped
    assert dropped == old and "do not fit in max_shm_bytes" in why
    sizes[new.parts[1].name] = 2 * PAGE  # resized: the checkpoint would be torn
    del sizes[newest.parts[0].name]  # gone
    plan = plan_adoption(manifest_of(old, new, newest), sizes.get, 100 * PAGE)
    assert plan.adopt == [old]
    assert [c for c, why in plan.dropped if "missing or resized" in why] == [newest, new]


def test_a_restarted_store_takes_over_the_segments_bitwise(tmp_path: Any) -> None:
    socket = str(tmp_path / "d.sock")
    manifest = ManifestFile(socket)
    first = CheckpointStore(Buffers(10 * PAGE), kept=2, manifest=manifest)
    for step in (1, 2):
        save(first, step)
        for slab in first.open("j", step).parts.values():
            slab.view(0, 4, np.dtype(np.uint8))[:] = [step, slab.segment_id, 7, 9]
    first.put("k", 1, 0, "data", PAGE)  # a job on two daemons: rank 1's part is on another
    first.commit("k", 1, ((0, "data"), (1, "data")), elsewhere=frozenset({(1, "data")}))
    first.put("j", 3, 0, "data", PAGE)  # unfinished: not left to a successor
    expected = {(step, key): bytes(slab.view(0, 4, np.dtype(np.uint8)))
                for step in (1, 2) for key, slab in first.open("j", step).parts.items()}
    first.close(keep=True)  # as a dying daemon would leave them, but unmapped here
    assert first.buffers.in_use == 0
    left = read_manifest(manifest.path)
    assert left is not None and [(c.job, c.step) for c in left.checkpoints] == [
        ("j", 1), ("j", 2), ("k", 1)]
    names = {p.name for c in left.checkpoints for p in c.parts}
    assert spared_segments() >= names
    write_manifest(dataclasses.replace(left, pid=dead_pid()), manifest.path)
    second = CheckpointStore(Buffers(10 * PAGE), kept=2, manifest=manifest)
    try:
        second.take_over()
        assert [c.step for c in second.complete("j")] == [2, 1]
        assert second.buffers.in_use == 5 * PAGE
        assert second.open("k", 1).every_part == {(0, "data"), (1, "data")}
        for step in (1, 2):
            for key, slab in second.open("j", step).parts.items():
                assert bytes(slab.view(0, 4, np.dtype(np.uint8))) == expected[(step, key)]
        assert all(not os.path.exists(f"/dev/shm/{name}") for name in names)  # renamed
        now = read_manifest(manifest.path)
        assert now is not None and now.pid == os.getpid()
        assert second.snapshot()["j"][0]["adopted_from"] == dead_pid()
    finally:
        second.close(keep=False)
    assert second.buffers.in_use == 0 and not os.path.exists(manifest.path)


def test_a_dead_daemons_manifest_spares_its_segments_while_its_socket_may_return(
    tmp_path: Any
) -> None:
    socket = str(tmp_path / "d.sock")
    manifest = ManifestFile(socket)
    left = Manifest(dead_pid(), os.getuid(), socket, (saved("j", 1, 1.0, PAGE),))
    write_manifest(left, manifest.path)
    try:
        open(socket + ".lock", "w").close()
        assert "gradsync-7-j1r0" in spared_segments()
        os.unlink(socket + ".lock")  # the socket's folder is gone: nobody comes back
        stale = f"{manifest.path}.{dead_pid()}.tmp"  # its writer died writing it
        open(stale, "w").close()
        assert "gradsync-7-j1r0" not in spared_segments()
        assert not os.path.exists(manifest.path) and not os.path.exists(stale)
    finally:
        manifest.remove()


# -- replicas of peers' parts (daemon/checkpoint_replicas.py) ---------------------


@pytest.fixture
def replicas() -> Iterator[ReplicaStore]:
    ticks = itertools.count()
    held = ReplicaStore(Buffers(6 * PAGE), kept=2, clock=lambda: float(next(ticks)))
    yield held
    held.release_all()
    assert held.buffers.in_use == 0 and len(held.buffers) == 0


def receive(replicas: ReplicaStore, step: int, data: bytes, sender: str = "a",
            chunk: int = 1000) -> None:
    """A whole replica of rank 0's part of `step`, in chunks, in order."""
    for off in range(0, len(data), chunk):
        replicas.chunk(("j", step, sender, 0, "data"), (sender, step, False), len(data), off,
                       memoryview(data[off:off + chunk]))


def test_replicas_arrive_in_order_and_the_newest_k_steps_stay(replicas: ReplicaStore) -> None:
    data = os.urandom(PAGE)
    receive(replicas, 1, data)
    whole = replicas.whole("j", 1)[("a", 0, "data")]
    assert whole.complete and bytes(whole.slab.view(0, PAGE, np.dtype(np.uint8))) == data
    receive(replicas, 2, data)
    receive(replicas, 3, data)
    assert replicas.steps("j") == [3, 2]  # kept=2: step 1's replica is gone
    with pytest.raises(ReplicaDropped, match="older than"):
        receive(replicas, 1, data)
    snapshot = replicas.snapshot()["j"]
    assert [(r["step"], r["origin"], r["complete"]) for r in snapshot] == [
        (3, "a", True), (2, "a", True)]


def test_a_replica_out_of_order_too_big_or_from_a_lost_sender_is_dropped(
    replicas: ReplicaStore
) -> None:
    key, push = ("j", 5, "a", 0, "data"), ("a", 1, False)
    replicas.chunk(key, push, 2 * PAGE, 0, memoryview(b"x" * 100))
    with pytest.raises(ReplicaDropped, match="a chunk at 200"):
        replicas.chunk(key, push, 2 * PAGE, 200, memoryview(b"x" * 100))  # a gap
    assert not replicas.replicas
    with pytest.raises(ReplicaDropped, match="not being received"):
        replicas.chunk(key, push, 2 * PAGE, 100, memoryview(b"x"))
    with pytest.raises(ReplicaDropped, match="does not fit"):
        replicas.chunk(key, push, 7 * PAGE, 0, memoryview(b"x"))  # the budget is 6 pages
    replicas.chunk(key, push, 2 * PAGE, 0, memoryview(b"x" * 100))
    replicas.chunk(("j", 5, "b", 1, "data"), ("b", 1, False), PAGE, 0, memoryview(b"y" * 10))
    replicas.drop_from("a", "was lost")
    assert list(replicas.replicas) == [("j", 5, "b", 1, "data")]
    replicas.expire(idle_s=0.5)  # the fake clock moved on: nothing came since
    assert not replicas.replicas


def test_two_transfers_of_one_part_never_mix(replicas: ReplicaStore) -> None:
    key, push, pull = ("j", 5, "a", 0, "data"), ("a", 1, False), ("a", 9, True)
    replicas.chunk(key, push, 2 * PAGE, 0, memoryview(b"p" * PAGE))
    with pytest.raises(ReplicaBusy):
        replicas.chunk(key, ("c", 4, False), 2 * PAGE, 0, memoryview(b"q"))  # another push
    replicas.chunk(key, pull, 2 * PAGE, 0, memoryview(b"r" * PAGE))  # a pull takes over
    with pytest.raises(ReplicaBusy):
        replicas.chunk(key, push, 2 * PAGE, PAGE, memoryview(b"p" * PAGE))
    whole = replicas.chunk(key, pull, 2 * PAGE, PAGE, memoryview(b"r" * PAGE))
    assert whole.complete and bytes(whole.slab.view(0, 2 * PAGE, np.dtype(np.uint8))) == (
        b"r" * 2 * PAGE)
    renewed = replicas.chunk(key, ("a", 7, False), 2 * PAGE, 0, memoryview(b"s"))
    assert not renewed.complete  # the origin sends it again: a whole one is replaced


def test_the_step_to_open_is_the_newest_whose_every_part_some_daemon_holds() -> None:
    parts = ((0, "data"), (0, "metadata"), (1, "data"))
    entries = [
        ("a", CkptHeld(4, True, parts, (("a", 0, "data", PAGE), ("a", 0, "metadata", PAGE)))),
        ("a", CkptHeld(3, True, parts, (("a", 0, "data", PAGE), ("a", 0, "metadata", PAGE)))),
        ("a", CkptHeld(3, True, (), (("b", 1, "data", PAGE),))),  # a replica of b's part
        ("c", CkptHeld(5, False, (), (("c", 1, "data", PAGE),))),  # never committed
    ]
    step, sources = choose_step("j", None, entries)
    assert step == 3 and sources[(1, "data")] == [("a", "b", PAGE)]  # 4 lacks rank 1's part
    assert choose_step("j", 3, entries)[0] == 3
    with pytest.raises(CheckpointError, match=r"steps seen: \{4: '2/3 parts', 3: '3/3 parts'\}"):
        choose_step("j", 4, entries)


class FakeLinks:
    """The peer links as CheckpointPeers sees them: names, and which are up."""

    def __init__(self, endpoint: str, peers: tuple[str, ...], down: set[str]) -> None:
        self.endpoint, self.peers, self.down = endpoint, peers, down

    def is_up(self, peer: str) -> bool:
        return peer not in self.down


def checkpoint_peers(store: CheckpointStore, replicas: ReplicaStore, me: str,
                     down: frozenset[str] = frozenset(), copies: int = 1) -> CheckpointPeers:
    """Daemon `me` of the four a, b, c, d."""
    links = FakeLinks(me, tuple(sorted({"a", "b", "c", "d"} - {me})), set(down))
    return CheckpointPeers(store, replicas, links, copies, busy=lambda peer: False)  # type: ignore[arg-type]


def test_replicas_go_to_the_next_daemons_of_the_ring_that_are_up(
    store: CheckpointStore, replicas: ReplicaStore
) -> None:
    assert checkpoint_peers(store, replicas, "b").targets() == ["c"]
    assert checkpoint_peers(store, replicas, "d").targets() == ["a"]  # the ring wraps
    assert checkpoint_peers(store, replicas, "b", down=frozenset("c")).targets() == ["d"]
    assert checkpoint_peers(store, replicas, "a", copies=2).targets() == ["b", "c"]
    assert checkpoint_peers(store, replicas, "a", copies=9).targets() == ["b", "c", "d"]


def test_a_malformed_or_unasked_checkpoint_message_is_counted_and_dropped(
    store: CheckpointStore, replicas: ReplicaStore, caplog: pytest.LogCaptureFixture
) -> None:
    peers = checkpoint_peers(store, replicas, "a")
    chunk = CkptChunk("j", 7, True, 1, "b", 0, "data", PAGE, 0).to_wire()
    for header, payloads in [({"kind": "ckpt_ask", "job": "j"}, []),
                             ({**chunk, "off": PAGE}, [b"x"]),
                             (chunk, [b"x"]),  # a pull nobody asked for
                             ({**chunk, "pull": False}, [b"x", b"y"])]:  # two payloads
        peers.message("b", header, payloads)
    assert peers.counters.malformed == 4 and not replicas.replicas
    assert "we did not ask for" in caplog.text and "one payload" in caplog.text


class SendingLinks(FakeLinks):
    """Fake links that note when each message went out (loop time)."""

    def __init__(self) -> None:
        super().__init__("a", ("b",), set())
        self.sent: list[tuple[float, dict[str, Any]]] = []

    async def send(self, peer: str, header: dict[str, Any], payloads: Any = ()) -> None:
        self.sent.append((asyncio.get_running_loop().time(), header))


def test_chunks_wait_for_the_collectives_on_the_link_but_not_for_ever(
    store: CheckpointStore, replicas: ReplicaStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checkpoint_peers_module, "CHUNK_BYTES", PAGE // 4)
    store.put("j", 1, 0, "data", PAGE)
    store.commit("j", 1, ((0, "data"),))
    busy = {"b": True}

    async def send_while_busy_for(busy_s: float, always: bool = False) -> list[float]:
        links = SendingLinks()
        peers = CheckpointPeers(store, replicas, links, 1,  # type: ignore[arg-type]
                                busy=lambda peer: busy[peer])
        loop = asyncio.get_running_loop()
        busy["b"], started = True, loop.time()
        if not always:
            loop.call_later(busy_s, busy.update, {"b": False})
        await peers._send_part("b", 1, False, "j", 1, ("a", 0, "data"))
        return [when - started for when, _ in links.sent]

    sent = asyncio.run(send_while_busy_for(0.2))
    assert len(sent) == 4 and min(sent) >= 0.2  # nothing while the collective ran
    monkeypatch.setattr(checkpoint_peers_module, "YIELD_AT_MOST_S", 0.05)
    sent = asyncio.run(send_while_busy_for(0.0, always=True))
    # A link never idle still gets its replicas: each chunk waits 0.05 s at most.
    assert len(sent) == 4 and 0.2 <= max(sent) < 2.0


def test_gradsync_stats_shows_where_the_replicas_are() -> None:
    from gradsync.client.cli.stats import render_table

    snapshot = {"version": "0", "pid": 1, "uptime_s": 1.0,
                "shm": {"in_use": 0, "segments": 0}, "jobs": {}, "peers": {},
                "checkpoints": {"j": [{"step": 3, "bytes": PAGE, "age_s": 1.0,
                                       "complete": True, "ranks": [0],
                                       "replicas": ["tcp://b:7000"]}]},
                "checkpoint_replicas": {"j": [
                    {"step": 3, "origin": "tcp://b:7000", "rank": 1, "item": "data",
                     "bytes": 2 * PAGE, "complete": False, "got": PAGE}]}}
    table = render_table(snapshot)
    assert "step 3 (complete): 4.0 KiB, age 1.0s, ranks 1, replicas on tcp://b:7000" in table
    assert ("replica of job 'j' step 3 rank 1 item 'data' from tcp://b:7000: 8.0 KiB "
            "(arriving: 4.0 KiB)") in table


def test_a_save_of_the_same_size_goes_into_the_spare_its_last_put_named(
    store: CheckpointStore
) -> None:
    store.put("j", 1, 0, "data", PAGE)
    assert store.spare_for("j", 0, "data") is None  # spares come with commits
    store.commit("j", 1, ((0, "data"),), settle=False)
    assert store.spare_for("j", 0, "data") is None and store.buffers.in_use == PAGE
    store.settle()  # after the commit's reply: two spares of the part's size
    first, second = store.spares[("j", 0, "data")]
    assert store.spare_for("j", 0, "data") is first and first.nbytes == PAGE
    assert store.put("j", 2, 0, "data", 100) is first  # the same pages: the spare
    assert store.spare_for("j", 0, "data") is second  # what this put's reply names
    store.commit("j", 2, ((0, "data"),))
    assert store.put("j", 3, 0, "data", PAGE) is second
    store.commit("j", 3, ((0, "data"),))  # prunes step 1
    bigger = store.put("j", 4, 0, "data", 2 * PAGE)  # another size: fresh pages
    assert bigger.nbytes == 2 * PAGE and "j" not in {key[0] for key in store.spares}
    store.commit("j", 4, ((0, "data"),))
    assert [s.nbytes for s in store.spares[("j", 0, "data")]] == [2 * PAGE, 2 * PAGE]
    # Spares are no checkpoints: neither listed nor counted in one.
    assert [(c["step"], c["bytes"]) for c in store.snapshot()["j"]] == [(4, 2 * PAGE),
                                                                         (3, PAGE)]
    assert store.buffers.in_use == 3 * PAGE + 4 * PAGE
    assert store.release_spares("j", 0) and not store.spares
    assert store.buffers.in_use == 3 * PAGE


def test_spares_and_pruned_segments_give_way_to_any_allocation(store: CheckpointStore) -> None:
    save(store, 1, nbytes=2 * PAGE)  # 4 pages, and two spares of 2 pages per rank: 8 more
    assert store.buffers.in_use == 10 * PAGE
    slot = store.buffers.allocate(6 * PAGE, "a gradient slot", {})  # fits without spares
    assert not store.spares and store.buffers.in_use == 10 * PAGE
    with pytest.raises(ShmExhaustedError, match="max_shm_bytes"):
        store.buffers.allocate(PAGE, "another slot", {})  # nothing left to give way
    store.buffers.release(slot.segment_id)
    for step in (2, 3):  # step 3 prunes step 1: its 4 pages are released at `settle`
        for rank in (0, 1):
            store.put("j", step, rank, "data", PAGE)
        store.commit("j", step, ((0, "data"), (1, "data")), settle=False)
    assert sorted(store.jobs["j"]) == [2, 3] and store.buffers.in_use == 8 * PAGE
    slot = store.buffers.allocate(6 * PAGE, "a gradient slot", {})  # fits once they go
    assert store.buffers.in_use == 10 * PAGE
    store.buffers.release(slot.segment_id)
    store.settle()  # spares would wait for the next commit: room was wanted
    assert store.buffers.in_use == 4 * PAGE and not store.spares


@dataclasses.dataclass
class PagesThread:
    """The store's background thread, held busy until the test `free`s it: what the
    store hands it queues, so the test sees what the store did without it."""

    store: CheckpointStore
    background: concurrent.futures.ThreadPoolExecutor
    gate: threading.Event

    def hold(self) -> None:
        self.gate.clear()
        self.background.submit(self.gate.wait, 60)

    def drain(self) -> None:
        self.gate.set()
        self.background.submit(lambda: None).result(10)


@pytest.fixture
def paged() -> Iterator[PagesThread]:
    """A store (16 pages, one kept checkpoint) with its background thread busy."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pages") as background:
        store = CheckpointStore(Buffers(16 * PAGE), kept=1, background=background)
        thread = PagesThread(store, background, threading.Event())
        thread.hold()
        try:
            yield thread
        finally:
            thread.gate.set()
            store.release_all()
    assert store.buffers.in_use == 0 and len(store.buffers) == 0


def reserved_bytes(slab: Any) -> int:
    """The bytes tmpfs has allocated to a segment (a hole has none)."""
    return os.stat(f"/dev/shm/{slab.handle.name}").st_blocks * 512


def test_spares_get_their_pages_and_pruned_ones_lose_theirs_on_the_background_thread(
    paged: PagesThread,
) -> None:
    store = paged.store
    store.put("j", 1, 0, "data", 2 * PAGE)
    store.commit("j", 1, ((0, "data"),))  # settles: two spares asked of the thread
    first, second = store.spares[("j", 0, "data")]
    # Counted in the budget and named at once; their pages not reserved yet.
    assert store.buffers.in_use == 6 * PAGE and store.spare_for("j", 0, "data") is first
    assert reserved_bytes(first) == 0 and reserved_bytes(second) == 0
    threading.Timer(0.2, paged.gate.set).start()
    assert store.put("j", 2, 0, "data", 2 * PAGE) is first  # it waited for the pages
    assert reserved_bytes(first) == 2 * PAGE
    pruned = store.jobs["j"][1].parts[(0, "data")]
    paged.hold()
    store.commit("j", 2, ((0, "data"),))  # prunes step 1: its segment goes
    assert not os.path.exists(f"/dev/shm/{pruned.handle.name}")
    assert not pruned.handle.mapping.closed, "unmapped on the caller's thread"
    paged.drain()
    assert pruned.handle.mapping.closed


def test_a_spare_still_unreserved_past_the_wait_is_dropped_for_fresh_pages(
    paged: PagesThread, monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = paged.store
    monkeypatch.setattr(checkpoints_module, "RESERVE_WAIT_S", 0.2)
    store.put("j", 1, 0, "data", PAGE)
    store.commit("j", 1, ((0, "data"),))
    first, second = store.spares[("j", 0, "data")]
    fresh = store.put("j", 2, 0, "data", PAGE)
    assert fresh not in (first, second) and reserved_bytes(fresh) == PAGE
    assert store.buffers.get(first.segment_id) is None  # dropped, their room back
    assert store.buffers.get(second.segment_id) is None and not store.spares
    store.commit("j", 2, ((0, "data"),))
    assert len(store.spares[("j", 0, "data")]) == 2
    # A session's end releases its spares without waiting for the thread (that
    # would take the whole wait: the thread stays busy).
    monkeypatch.setattr(checkpoints_module, "RESERVE_WAIT_S", 60.0)
    started = time.monotonic()
    assert store.release_spares("j", 0) and not store.spares
    assert time.monotonic() - started < 30 and store.buffers.in_use == PAGE


def test_every_parts_next_spare_is_asked_for_before_any_second_one(paged: PagesThread) -> None:
    save(paged.store, 1)  # two ranks' parts: four spares, in the thread's queue
    (first0, second0), (first1, second1) = (
        paged.store.spares[("j", r, "data")] for r in (0, 1))
    # The thread reserves in the order asked, and slab ids count the asking.
    assert first0.segment_id < first1.segment_id < second0.segment_id < second1.segment_id


def test_spares_whose_reservation_finds_dev_shm_full_give_a_clear_error_then_room() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a mount namespace")
    program = Path(__file__).parent / "programs" / "spares_on_full_shm.py"
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$@"', "sh",
         sys.executable, str(program)],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    happened = json.loads(result.stdout.strip().splitlines()[-1])
    assert happened["spares"] == 2
    assert "/dev/shm is full" in happened["error"] or "bytes free in /dev/shm" in happened["error"]
    assert "checkpoint is not saved" in happened["error"]
    assert happened["spares_after"] == 0  # the failed reservations were dropped
    assert happened["committed"] == [2]
    assert happened["left"] == []  # every segment went with the store


def test_the_daemon_can_ask_what_a_put_would_wait_for_then_put_without_waiting(
    paged: PagesThread,
) -> None:
    store = paged.store
    store.put("j", 1, 0, "data", PAGE)
    store.commit("j", 1, ((0, "data"),))
    first, _ = store.spares[("j", 0, "data")]
    pending = store.reservation_for("j", 0, "data", PAGE)
    assert pending is not None and not pending.done()  # the thread is held: not reserved
    assert store.reservation_for("j", 0, "data", 2 * PAGE) is None  # no spare of that size
    assert store.reservation_for("j", 1, "data", PAGE) is None  # no spare for that rank
    paged.drain()
    assert pending.done() and store.reservation_for("j", 0, "data", PAGE) is None
    assert store.put("j", 2, 0, "data", PAGE, wait_s=0.0) is first  # nothing left to wait for
    paged.hold()
    store.commit("j", 2, ((0, "data"),))  # a new second spare, its reservation held
    second, third = store.spares[("j", 0, "data")]
    assert store.put("j", 3, 0, "data", PAGE, wait_s=0.0) is second  # reserved earlier
    fresh = store.put("j", 4, 0, "data", PAGE, wait_s=0.0)  # `third` is not: fresh pages
    assert fresh is not third and store.buffers.get(third.segment_id) is None
