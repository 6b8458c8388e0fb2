"""What a checkpoint save blocks (issue 50, save time): each save goes into the
spare segment the daemon set aside at the part's previous save, and which the
client mapped (its pages faulted in) in the background since.

Real daemons; the spares are seen in the daemon's replies and segment names, and
must never change what a checkpoint holds: not for a reader that still maps an
old one, not for a save of another size, not at the daemon's exit (no leak).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from conftest import DaemonProcess, poll_until
from gradsync.client.checkpoints import DaemonCheckpoints, checkpoint_client, map_populated
from gradsync.client.daemon_process import segments_of

pytest.importorskip("torch", reason="torch is the optional extra gradsync[torch]")

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

from gradsync.client.torch.checkpoint import DaemonStorageReader, DaemonStorageWriter

MIB = 2**20


def stats(daemon: DaemonProcess) -> dict[str, Any]:
    from gradsync.client.cli.stats import fetch_snapshot

    return fetch_snapshot(daemon.endpoint + ".stats", 5.0)  # type: ignore[no-any-return]


def pattern(step: int, nbytes: int) -> bytes:
    return bytes([step]) * nbytes


@pytest.mark.timeout(120)
def test_each_save_goes_into_the_spare_and_an_old_checkpoint_stays_intact(
    daemon: DaemonProcess,
) -> None:
    with checkpoint_client("spares", 0, daemon.endpoint) as client:
        store = DaemonCheckpoints(client)
        session = len(segments_of(daemon.pid))  # the session's own (its fast page)

        def save(step: int, nbytes: int) -> dict[str, Any]:
            reply: dict[str, Any] = client.call(
                "ckpt_put", job="spares", step=step, item="data", nbytes=nbytes
            )
            mapping = map_populated(reply["name"], reply["nbytes"])
            mapping[:nbytes] = pattern(step, nbytes)
            mapping.close()
            store.commit(step, [(0, "data")])
            return reply

        first = save(1, MIB)
        assert "spare" not in first  # spares come with commits
        reader = store.open(1)  # held open while later saves prune step 1
        made = set(segments_of(daemon.pid))  # the two spares step 1's commit set aside
        second = save(2, MIB)
        assert second["name"] in made, "the second save did not go into a spare"
        assert second["spare"][0] in made - {second["name"]}
        third = save(3, MIB)
        assert third["name"] == second["spare"][0], "not the spare the last put named"
        fourth = save(4, 2 * MIB)  # another size: fresh pages, and no spare of that size yet
        assert fourth["name"] not in made and "spare" not in fourth
        fifth = save(5, 2 * MIB)
        assert fifth["spare"][1] == 2 * MIB
        assert [c["step"] for c in store.list()] == [5, 4]
        assert reader.parts[(0, "data")][:MIB] == pattern(1, MIB), "a pruned step changed"
        for step in (4, 5):
            assert store.open(step).parts[(0, "data")][: 2 * MIB] == pattern(step, 2 * MIB)
        # Through the client's own put: the spare it mapped in the background.
        for step in (6, 7):
            mapping = store.put(step, "data", 2 * MIB)
            mapping[: 2 * MIB] = pattern(step, 2 * MIB)
            mapping.close()
            store.commit(step, [(0, "data")])
        assert store.open(6).parts[(0, "data")][: 2 * MIB] == pattern(6, 2 * MIB)
        assert store.open(7).parts[(0, "data")][: 2 * MIB] == pattern(7, 2 * MIB)
        assert len(segments_of(daemon.pid)) == session + 4  # steps 6 and 7, two spares
    # The session that would save next is gone: its spares go, the checkpoints stay.
    poll_until(lambda: len(segments_of(daemon.pid)) == 2, 10, "the spares to be released")
    assert [c["step"] for c in stats(daemon)["checkpoints"]["spares"]] == [7, 6]


@pytest.mark.timeout(120)
def test_a_spare_gives_way_to_a_save_that_needs_its_room(start_daemon: Any) -> None:
    daemon: DaemonProcess = start_daemon("--max-shm-bytes", "8MiB")

    def save(store: DaemonCheckpoints, step: int, nbytes: int) -> None:
        mapping = store.put(step, "data", nbytes)
        mapping[:4] = pattern(step, 4)
        mapping.close()
        store.commit(step, [(0, "data")])

    with (
        checkpoint_client("first", 0, daemon.endpoint) as first,
        checkpoint_client("second", 0, daemon.endpoint) as second,
    ):
        saves = DaemonCheckpoints(first)
        sessions = len(segments_of(daemon.pid))  # the sessions' own (their fast pages)
        for step in (1, 2):  # 2 MiB each: two kept and a spare take 6 of 8 MiB
            save(saves, step, 2 * MIB)
        saves.list()  # answered after what the commit left for later (the spares)
        assert len(segments_of(daemon.pid)) == sessions + 3
        # Another job's 3 MiB fit only once the first job's spare has given way.
        save(DaemonCheckpoints(second), 1, 3 * MIB)
        assert [c["step"] for c in saves.list()] == [2, 1]
        assert len(segments_of(daemon.pid)) == sessions + 3  # and no room for its spare
        assert saves.open(2).parts[(0, "data")][:4] == pattern(2, 4)
        assert DaemonCheckpoints(second).open(1).parts[(0, "data")][:4] == pattern(1, 4)


@pytest.mark.timeout(180)
def test_dcp_saves_reuse_the_spare_and_load_bitwise(daemon: DaemonProcess) -> None:
    os.environ["GRADSYNC_DAEMON"] = daemon.endpoint
    try:
        state = {f"t{i}": torch.randn(300_000) for i in range(4)}
        writer = DaemonStorageWriter(job="dcp-spares")
        assert isinstance(writer, AsyncStager)  # async_save stages as with FileSystemWriter
        dcp.save(state, storage_writer=writer, checkpoint_id="1")
        writer.store.list()  # answered after what the commit left for later (the spares)
        before = set(segments_of(daemon.pid))
        state = {name: tensor + 1 for name, tensor in state.items()}
        dcp.save(state, storage_writer=writer, checkpoint_id="2")
        parts = writer.store.client.call("ckpt_open", job="dcp-spares", step=2)["parts"]
        data = [name for _, item, name, _ in parts if item == "data"]
        assert data and data[0] in before, "the second save's data did not go into the spare"
        state = {name: tensor * 3 for name, tensor in state.items()}
        dcp.async_save(state, storage_writer=writer, checkpoint_id="3").result()  # type: ignore[union-attr]
        loaded = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
        dcp.load(loaded, storage_reader=DaemonStorageReader(client=writer.store.client))
        for name, tensor in state.items():
            assert torch.equal(loaded[name], tensor), name
    finally:
        del os.environ["GRADSYNC_DAEMON"]


@pytest.mark.timeout(120)
def test_a_save_right_after_a_commit_gets_the_spare_once_its_pages_are_there(
    daemon: DaemonProcess,
) -> None:
    """512 MiB: the two spares' pages take the daemon's page thread a few hundred ms, so
    the next put, sent as soon as the commit is answered, finds its spare still being
    reserved; the daemon waits for it off its loop, then hands it over."""
    nbytes = 512 * MIB
    with checkpoint_client("spares-busy", 0, daemon.endpoint) as client:
        store = DaemonCheckpoints(client)
        mapping = store.put(1, "data", nbytes)
        mapping[:4] = pattern(1, 4)
        mapping.close()
        made_before = set(segments_of(daemon.pid))
        store.commit(1, [(0, "data")])
        reply = client.call("ckpt_put", job="spares-busy", step=2, item="data", nbytes=nbytes)
        spares = set(segments_of(daemon.pid)) - made_before
        assert reply["name"] in spares, "the save right after the commit did not get a spare"
        assert os.stat(f"/dev/shm/{reply['name']}").st_blocks * 512 >= nbytes  # reserved
        written = map_populated(reply["name"], nbytes)
        written[:4] = pattern(2, 4)
        written.close()
        store.commit(2, [(0, "data")])
        assert store.open(2).parts[(0, "data")][:4] == pattern(2, 4)
        assert store.open(1).parts[(0, "data")][:4] == pattern(1, 4)
