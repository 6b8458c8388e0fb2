"""The torchft process group's lifecycle: configure, abort, errored, shutdown (real daemon).

Two ranks of one quorum live in this process (one per ProcessGroupGradsync),
configured through a real TCPStore as torchft's Manager would.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchft")
from torch.distributed import TCPStore

from conftest import DaemonProcess, buffers_of, poll_until
from gradsync.client.torch.state_codec import StateCodecError
from gradsync.client.torch.torchft_group import ProcessGroupGradsync
from gradsync.client.torch.torchft_transport import GradsyncTransport

pytestmark = pytest.mark.timeout(60)

TIMEOUT = datetime.timedelta(seconds=30)  # far longer than any wait this test allows


@pytest.fixture
def pair(daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> Iterator[
        list[ProcessGroupGradsync]]:
    """Two ranks of quorum 1, configured concurrently (the rendezvous blocks)."""
    monkeypatch.setenv("GRADSYNC_DAEMON", daemon.endpoint)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups = [ProcessGroupGradsync(timeout=TIMEOUT) for _ in range(2)]
    threads = [threading.Thread(target=g.configure, args=(
        f"127.0.0.1:{store.port}/torchft/1/0", f"replica{r}", r, 2, 1)) for r, g in
        enumerate(groups)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(g.gradsync_job for g in groups)
    yield groups
    for group in groups:
        group.shutdown()


def allreduce(group: ProcessGroupGradsync, tensor: torch.Tensor) -> dist.Work:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    return group.allreduce([tensor], opts)


def test_a_quorum_reduces_and_reconfigure_makes_a_new_job(
    pair: list[ProcessGroupGradsync],
) -> None:
    tensors = [torch.full((1000,), float(r + 1)) for r in range(2)]
    works = [allreduce(g, t) for g, t in zip(pair, tensors, strict=True)]
    for work in works:
        work.wait()
    assert all(torch.equal(t, torch.full((1000,), 3.0)) for t in tensors)
    assert pair[0].gradsync_job == pair[1].gradsync_job
    assert pair[0].errored() is None and pair[0].size() == 2
    assert pair[0].getBackendName() == "torchft-gradsync"


def test_errored_never_blocks_and_abort_fails_everyone_now(
    pair: list[ProcessGroupGradsync], daemon: DaemonProcess
) -> None:
    """Rank 0's allreduce waits for rank 1: errored() answers at once (None).  Rank 0
    aborts: its Work fails at once, and so does rank 1's matching allreduce, long
    before the 30 s timeout."""
    waiting = allreduce(pair[0], torch.ones(1 << 16))
    started = time.monotonic()
    assert pair[0].errored() is None
    assert not waiting.is_completed()
    assert time.monotonic() - started < 1.0  # a poll, not a wait for the collective

    started = time.monotonic()
    pair[0].abort()
    with pytest.raises(dist.DistBackendError):
        waiting.wait()
    assert time.monotonic() - started < 5.0, "abort() did not end the outstanding Work"

    other = allreduce(pair[1], torch.ones(1 << 16))
    started = time.monotonic()
    with pytest.raises(dist.DistBackendError, match=r"rank 0 \(pid \d+\) of job .* disconnected"):
        other.wait()
    assert time.monotonic() - started < 10.0, "rank 1 waited for its timeout"
    poll_until(lambda: pair[1].errored() is not None, 5, "rank 1's errored()")


def test_shutdown_leaves_no_thread_and_no_segment(
    pair: list[ProcessGroupGradsync], daemon: DaemonProcess
) -> None:
    works = [allreduce(g, torch.ones(1 << 16)) for g in pair]
    for work in works:
        work.get_future().wait()
    in_flight = allreduce(pair[0], torch.ones(1 << 16))  # never matched
    for group in pair:
        group.shutdown()
    with pytest.raises(dist.DistBackendError):
        in_flight.wait()
    # The groups' threads; not the process's checkpoint helpers (client/checkpoints.py),
    # which an earlier test in this process may have started and which outlive any group.
    assert not [t.name for t in threading.enumerate() if t.name.startswith("gradsync-")
                and not t.name.startswith("gradsync-checkpoint-")]
    poll_until(lambda: not buffers_of(daemon), 10, "the daemon freed the groups' segments")


def test_the_gradsync_transport_heals_a_state_dict_through_the_daemon(
    pair: list[ProcessGroupGradsync], daemon: DaemonProcess
) -> None:
    """A model's, an optimizer's and torchft's state, 24 MiB in 8 MiB sends: the
    receiver gets it exactly (int keys, OrderedDicts and scalars too), and says so."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    state = {"user": {"model": model.state_dict(), "optim": optimizer.state_dict()},
             "torchft": {"step": 9, "batches_committed": 18}}
    sender, receiver = (GradsyncTransport(g, TIMEOUT, chunk_bytes=8 << 20) for g in pair)
    sent = threading.Thread(target=sender.send_checkpoint, args=([1], 9, state, TIMEOUT))
    sent.start()
    got = receiver.recv_checkpoint(0, sender.metadata(), 9, TIMEOUT)
    sent.join(30)
    assert not sent.is_alive()
    assert got["torchft"] == state["torchft"]
    for name, tensor in state["user"]["model"].items():
        assert torch.equal(got["user"]["model"][name], tensor), name
    assert sorted(got["user"]["optim"]["state"]) == [0, 1, 2, 3]
    assert torch.equal(got["user"]["optim"]["state"][2]["momentum_buffer"],
                       state["user"]["optim"]["state"][2]["momentum_buffer"])
    heal = receiver.last_heal
    assert heal and heal.src_rank == 0 and heal.step == 9 and heal.payload_bytes > 3 * 8 << 20
    model.load_state_dict(got["user"]["model"])  # what the Manager hands the user


def test_the_gradsync_transport_refuses_another_step_or_transport(
    pair: list[ProcessGroupGradsync],
) -> None:
    """A checkpoint of step 5 where step 6 is healed: an error naming both; a
    sender of another transport: an error before anything is awaited."""
    sender, receiver = (GradsyncTransport(g, TIMEOUT) for g in pair)
    with pytest.raises(StateCodecError, match="another-transport"):
        receiver.recv_checkpoint(0, "another-transport", 6, TIMEOUT)
    sent = threading.Thread(target=sender.send_checkpoint,
                            args=([1], 5, {"w": torch.ones(10)}, TIMEOUT))
    sent.start()
    with pytest.raises(StateCodecError, match="checkpoint of step 5; this replica heals to "
                       "step 6"):
        receiver.recv_checkpoint(0, sender.metadata(), 6, TIMEOUT)
    sent.join(30)
    assert not sent.is_alive()
    assert receiver.last_heal is None
