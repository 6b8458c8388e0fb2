"""torchft: a replica restarted on the same node heals from its local daemon's checkpoint.

The transport tests run two ranks of one quorum in this process (`pair`); the
replica tests run real replicas with torchft's Lighthouse and Manager on a real
daemon, one of them SIGKILLed and restarted.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchft")
from test_torchft import finish, lighthouse  # noqa: F401 (a fixture)
from test_torchft_group import pair  # noqa: F401 (a fixture)
from torchft._torchft import LighthouseServer

from conftest import PROGRAMS, RANK_ZYGOTE, DaemonProcess
from gradsync.client.torch.state_checkpoints import ITEM, StateCheckpoints
from gradsync.client.torch.torchft_group import ProcessGroupGradsync
from gradsync.client.torch.torchft_transport import GradsyncTransport

pytestmark = pytest.mark.timeout(180)

TIMEOUT = datetime.timedelta(seconds=30)
STEPS = 10
KILL_AT = 5


def manager_state(step: int, batches: int, seed: int = 0) -> dict[str, Any]:
    """A Manager's state dict: a model's and an optimizer's state, torchft's own."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(256, 128)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    return {"user": {"model": model.state_dict(), "optim": optimizer.state_dict()},
            "torchft": {"step": step, "batches_committed": batches}}


def heal(groups: list[ProcessGroupGradsync], sent: dict[str, Any], step: int, name: str,
         keep: Callable[[StateCheckpoints], object] = lambda _: None, sender_keeps: bool = True,
         ) -> tuple[GradsyncTransport[Any], GradsyncTransport[Any], Any]:
    """Replica 1 (local checkpoints `name`) first `keep`s what it kept before it died,
    then heals to `step` from replica 0, which sends `sent` (and keeps local
    checkpoints too, as every replica of a job does, unless not `sender_keeps`)."""
    sender: GradsyncTransport[Any] = GradsyncTransport(
        groups[0], TIMEOUT, local_checkpoints=f"{name}-sender" if sender_keeps else None)
    receiver: GradsyncTransport[Any] = GradsyncTransport(groups[1], TIMEOUT,
                                                         local_checkpoints=name)
    assert receiver.local is not None
    keep(receiver.local)
    thread = threading.Thread(target=sender.send_checkpoint, args=([1], step, sent, TIMEOUT))
    thread.start()
    got = receiver.recv_checkpoint(0, sender.metadata(), step, TIMEOUT)
    thread.join(30)
    assert not thread.is_alive()
    return sender, receiver, got


def assert_state_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["torchft"] == want["torchft"]
    for key, tensor in want["user"]["model"].items():
        assert torch.equal(got["user"]["model"][key], tensor), key
    assert torch.equal(got["user"]["optim"]["state"][0]["momentum_buffer"],
                       want["user"]["optim"]["state"][0]["momentum_buffer"])


def test_a_local_checkpoint_of_the_quorums_step_heals_without_the_state_crossing(
    pair: list[ProcessGroupGradsync],  # noqa: F811
) -> None:
    """Replica 1 kept step 9 (batches 18) in its daemon: it heals from it, the sender
    sends nothing, and the state is in private memory (never the daemon's segment)."""
    state = manager_state(9, 18)
    sender, receiver, got = heal(pair, state, 9, "run-a-replica1",
                                 lambda local: local.save(9, state))
    assert_state_equal(got, state)
    assert receiver.last_heal and receiver.last_heal.source == "local", receiver.last_heal
    assert receiver.last_heal.step == 9 and receiver.last_heal.payload_bytes > 128 * 256 * 4
    assert sender.sent_bytes == 0
    got["user"]["model"]["weight"].fill_(7.0)  # a private copy: the kept one is unchanged
    assert receiver.local is not None
    again = receiver.local.load(9).state
    assert torch.equal(again["user"]["model"]["weight"], state["user"]["model"]["weight"])


def kept_before(kept: str) -> Callable[[StateCheckpoints], object]:
    """What replica 1 kept before it died, by `kept`'s name."""
    return {
        "older": lambda local: local.save(8, manager_state(8, 16, seed=1)),
        "other-history": lambda local: local.save(9, manager_state(9, 17, seed=1)),
        "torn": lambda local: local.store.put(9, ITEM, 1 << 16).close(),
        "none": lambda _: None,
        "sender-keeps-none": lambda local: local.save(9, manager_state(9, 18)),
    }[kept]


@pytest.mark.parametrize("kept", ["older", "other-history", "torn", "none", "sender-keeps-none"])
def test_without_a_matching_local_checkpoint_the_state_comes_over_the_group(
    pair: list[ProcessGroupGradsync], kept: str,  # noqa: F811
) -> None:
    """Kept: step 8 only (older than the quorum's 9); step 9 of another history (other
    batches_committed, other weights); step 9 put but never committed (a save the
    kill cut short); nothing; or the right step, but the sender keeps no local
    checkpoints (so it announces no offers and sends at once).  Each heals over the
    group, with the sender's state."""
    state = manager_state(9, 18)
    sender, receiver, got = heal(pair, state, 9, f"run-{kept}-replica1", kept_before(kept),
                                 sender_keeps=kept != "sender-keeps-none")
    assert sender.metadata().endswith("+offer") == (kept != "sender-keeps-none")
    assert_state_equal(got, state)
    assert receiver.last_heal and receiver.last_heal.source == "network", receiver.last_heal
    assert sender.sent_bytes == receiver.last_heal.payload_bytes > 0


def test_save_local_keeps_each_step_once_and_a_refused_save_is_a_warning(
    daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """save_local keeps the Manager's state at its step; the same step again is
    skipped; a step the daemon already holds complete (from another history) is
    refused by the daemon: a warning and False, never an exception."""
    monkeypatch.setenv("GRADSYNC_DAEMON", daemon.endpoint)

    class FakeManager:
        def __init__(self, step: int, batches: int) -> None:
            self.step, self.batches = step, batches

        def current_step(self) -> int:
            return self.step

        def _manager_state_dict(self) -> dict[str, Any]:
            return manager_state(self.step, self.batches)

    transport: GradsyncTransport[Any] = GradsyncTransport(ProcessGroupGradsync(), TIMEOUT,
                                                          local_checkpoints="run-s-replica0")
    assert transport.local is not None
    assert transport.save_local(FakeManager(3, 6))  # type: ignore[arg-type]
    assert transport.save_local(FakeManager(3, 6))  # type: ignore[arg-type]
    assert transport.local.load(3).state["torchft"] == {"step": 3, "batches_committed": 6}
    transport.local.save(4, manager_state(4, 7, seed=1))
    assert not transport.save_local(FakeManager(4, 8))  # type: ignore[arg-type]
    assert "step 4 not kept in the local daemon" in caplog.text
    assert transport.local.load(4).state["torchft"] == {"step": 4, "batches_committed": 7}
    transport.shutdown()
    with pytest.raises(ValueError, match="local_checkpoints"):
        GradsyncTransport(ProcessGroupGradsync(), TIMEOUT).save_local(
            FakeManager(1, 1))  # type: ignore[arg-type]


def spawn(replica: int, daemon: DaemonProcess, lighthouse: LighthouseServer,  # noqa: F811
          markers: Path, victim: bool, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "GRADSYNC_DAEMON": daemon.endpoint,
           "TORCHFT_LIGHTHOUSE": lighthouse.address(), "LOCAL_NAME": markers.parent.name}
    return RANK_ZYGOTE.popen(
        [sys.executable, str(PROGRAMS / "torchft_local_heal.py"), f"replica{replica}",
         str(STEPS), str(KILL_AT), "1" if victim else "0", str(markers), *extra], env=env)


def kill_restart_finish(daemon: DaemonProcess, lighthouse: LighthouseServer,  # noqa: F811
                        folder: Path, *extra: str) -> list[list[dict[str, Any]]]:
    """Replica 1 SIGKILLs itself in step KILL_AT and is restarted on the same daemon;
    both train to STEPS; each one's records."""
    markers = folder / "markers"
    markers.mkdir()
    replicas = [spawn(r, daemon, lighthouse, markers, r == 1, *extra) for r in range(2)]
    try:
        out, err = replicas[1].communicate(timeout=120)
        assert replicas[1].returncode == -9, f"replica 1 should have killed itself:\n{out}\n{err}"
        restarted = spawn(1, daemon, lighthouse, markers, True, *extra)
        return [finish(replicas[0], 120, "replica 0", [daemon.log]),
                finish(restarted, 120, "restarted replica 1", [daemon.log])]
    finally:
        for process in replicas:
            if process.poll() is None:
                process.kill()


@pytest.mark.fault
@pytest.mark.parametrize("local", [True, False], ids=["local", "older-local"])
def test_a_restarted_replica_heals_from_its_daemon_or_else_over_the_network(
    daemon: DaemonProcess, lighthouse: LighthouseServer, short_tmp: str,  # noqa: F811
    local: bool,
) -> None:
    """2 replicas (min 2) keep every step in the daemon; replica 1 is SIGKILLed in step
    5 and restarted.  Replica 0 cannot commit alone, so the quorum's step is still 5:
    local, replica 1 heals from its own step-5 checkpoint and replica 0 sends nothing;
    older-local (its step 5 was never kept, step 4 was), the state comes over the
    group.  Both ways they end bitwise equal, weights and momentum."""
    records = kill_restart_finish(daemon, lighthouse, Path(short_tmp),
                                  *([] if local else [str(KILL_AT)]))
    finals = [next(r for r in rs if "final_step" in r) for rs in records]
    assert all(f["final_step"] == STEPS for f in finals), finals
    assert finals[0]["params"] == finals[1]["params"]
    assert finals[0]["momentum"] == finals[1]["momentum"]
    assert finals[0]["batches_committed"] == finals[1]["batches_committed"]
    survivor = [r for r in records[0] if "step" in r]
    assert not next(r for r in survivor if r["step"] == KILL_AT)["committed"], survivor
    healed = finals[1]["heal"]
    assert healed and healed["step"] == KILL_AT and healed["src_rank"] == 0, healed
    assert healed["source"] == ("local" if local else "network"), healed
    assert healed["payload_bytes"] >= 4 * 2 * (32 * 64 + 64 + 64 * 4 + 4), healed
    assert finals[0]["sent_bytes"] == (0 if local else healed["payload_bytes"]), finals[0]
    back = [r for r in records[1] if "step" in r]
    assert back[0]["step"] == KILL_AT and all(r["committed"] for r in back), back
