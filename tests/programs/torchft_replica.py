"""Replica program: one torchft replica group of one rank, training on gradsync.

Usage: torchft_replica.py REPLICA_ID STEPS KILL_AT VICTIM MARKER_DIR REPLICAS
Environment: TORCHFT_LIGHTHOUSE (the Lighthouse), GRADSYNC_DAEMON; and, for
replicas on several hosts (network namespaces), REPLICA_HOST (the address its
store and manager are reached at, default 127.0.0.1); REPLICA_PG `gradsync`
(default) or `gloo` (torchft's ProcessGroupGloo, for comparison);
REPLICA_TIMEOUT_S (the Manager's and the group's timeout, default 30);
REPLICA_INIT_SYNC=0 to start from the seeded weights without torchft's step-0
sync (whose HTTP transport dials the host name, which namespaces share);
REPLICA_TRANSPORT=pg to heal through the process group (torchft's PGTransport:
its send and recv) rather than torchft's default HTTP transport, `gradsync`
through gradsync's own GradsyncTransport (the final record then says what it
received: `heal`);
REPLICA_LAG=N to keep every replica within N steps of the others (each waits,
60 s at most, before asking for a quorum at step S until every replica has
asked at S - N or later or waits for a quorum now: the others cannot finish
while one is failing or retrying a step after a daemon restart; and the last
step, taken by fewer than all, is discarded and retried); REPLICA_DDP=MB to train through
torchft's DistributedDataParallel (its comm hook's `Manager.allreduce` per
bucket of MB megabytes) rather than one `Manager.allreduce` per gradient.
Trains a small model with torchft's Manager (min_replica_size 2), one
`Manager.allreduce` per gradient, torchft's OptimizerWrapper, until torchft's
step reaches STEPS.  At step KILL_AT the VICTIM (1) SIGKILLs itself mid-step
(once; its restart, which finds its first marker, does not); a VICTIM `stall`
stops there instead, with the others waiting in the step's allreduces, for the
test to cut its node off; a VICTIM `stop` SIGSTOPs itself at the first
step from KILL_AT that every replica is in (a hung process, once) and, when
the test sends SIGCONT, writes its restarted-... marker and trains on.  It writes
MARKER_DIR/started-REPLICA_ID (restarted-... when restarted) once its Manager
is up; the others hold at some steps for those markers (`hold`), so that all
REPLICAS take part and the rejoin happens before the run ends.  Prints one
JSON line per step (with its wall-clock time, and the error of a discarded
step) and a final one.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed import TCPStore
from torchft import Manager, Optimizer
from torchft.checkpointing.pg_transport import PGTransport
from torchft.ddp import DistributedDataParallel
from torchft.process_group import ProcessGroupGloo

from gradsync.client.torch.torchft_group import ProcessGroupGradsync
from gradsync.client.torch.torchft_transport import GradsyncTransport


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def hold(markers: Path, step: int, kill_at: int, replicas: int) -> None:
    """Wait (60 s at most) where the run must not go on alone: from step 3 until
    every replica has started, and 3 steps after the kill until its restart has.
    Every wait ends at a marker a replica writes before it asks for a quorum."""
    def count(prefix: str) -> int:
        return sum(1 for p in markers.iterdir() if p.name.startswith(prefix))

    killed = markers / "killed"
    deadline = time.monotonic() + 60
    while ((step >= 3 and count("started-") < replicas)
           or (kill_at >= 0 and killed.exists() and step >= int(killed.read_text() or 0) + 3
               and count("restarted-") == 0)):
        if time.monotonic() > deadline:
            raise SystemExit(f"step {step}: a replica did not (re)start within 60 s")
        time.sleep(0.05)


def keep_up(markers: Path, step: int, lag: int, replicas: int) -> None:
    """Wait until every replica has asked for a quorum at step - lag or later, or
    is waiting for one now (it then joins the next quorum and heals)."""
    deadline = time.monotonic() + 60
    while True:
        asked: dict[str, int] = {}
        for marker in markers.glob("asks-*"):
            _, name, at = marker.name.split("-")
            asked[name] = max(asked.get(name, -1), int(at))
        waiting = {marker.name.split("-", 1)[1] for marker in markers.glob("waiting-*")}
        if step <= lag or (len(asked) >= replicas and all(
                at >= step - lag or name in waiting for name, at in asked.items())):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"step {step}: a replica stayed more than {lag} steps behind "
                             f"for 60 s: {asked}")
        time.sleep(0.02)


def others_reached(markers: Path, what: str, step: int, others: int) -> None:
    """Wait (60 s at most) until `others` replicas wrote their `what` marker of `step`."""
    deadline = time.monotonic() + 60
    while len(list(markers.glob(f"{what}-{step}-*"))) < others:
        if time.monotonic() > deadline:
            raise SystemExit(f"step {step}: the other replicas did not reach {what} in 60 s")
        time.sleep(0.01)


def main() -> None:
    replica_id, steps, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    victim, markers, replicas = sys.argv[4] != "0", Path(sys.argv[5]), int(sys.argv[6])
    stall, stop = sys.argv[4] == "stall", sys.argv[4] == "stop"
    restarted = (markers / f"started-{replica_id}").exists()
    torch.manual_seed(0)  # every replica starts equal; torchft syncs step 0 anyway
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    host = os.environ.get("REPLICA_HOST", "127.0.0.1")
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    timeout = datetime.timedelta(seconds=float(os.environ.get("REPLICA_TIMEOUT_S", "30")))
    pg = (ProcessGroupGloo(timeout=timeout) if os.environ.get("REPLICA_PG") == "gloo"
          else ProcessGroupGradsync(timeout=timeout))
    transport_name = os.environ.get("REPLICA_TRANSPORT")
    transport = (PGTransport(pg, timeout, torch.device("cpu")) if transport_name == "pg"
                 else GradsyncTransport(pg, timeout) if transport_name == "gradsync" else None)
    manager = Manager(
        pg=pg, hostname=host, init_sync=os.environ.get("REPLICA_INIT_SYNC") != "0",
        min_replica_size=2,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                       inner.load_state_dict(state["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=replica_id, store_addr=host, store_port=store.port,
        rank=0, world_size=1, timeout=timeout,
        quorum_timeout=datetime.timedelta(seconds=60), use_async_quorum=False,
        checkpoint_transport=transport,
    )
    optimizer = Optimizer(manager, inner)
    bucket_mb = os.environ.get("REPLICA_DDP")
    trained = (DistributedDataParallel(manager, model, bucket_cap_mb=float(bucket_mb))
               if bucket_mb else model)
    (markers / f"{'restarted' if restarted else 'started'}-{replica_id}").touch()
    while manager.current_step() < steps:
        step = manager.current_step()
        if not victim:
            hold(markers, step, kill_at, replicas)
        lag = int(os.environ.get("REPLICA_LAG", "0"))
        waiting = markers / f"waiting-{replica_id}"
        if lag:
            keep_up(markers, step, lag, replicas)
            (markers / f"asks-{replica_id}-{step}").touch()
            waiting.touch()
        optimizer.zero_grad()  # starts the quorum (a healing replica gets its step here)
        if lag:  # the step it healed to counts as asked: keep_up never waits on it then
            (markers / f"asks-{replica_id}-{manager.current_step()}").touch()
            waiting.unlink()
        step = manager.current_step()
        (markers / f"{replica_id}-step-{step}").touch()  # for a test that acts mid-run
        generator = torch.Generator().manual_seed(1000 * manager.current_step()
                                                  + (manager.participating_rank() or 0))
        x = torch.randn(16, 32, generator=generator)
        loss = trained(x).square().mean()
        # The victim dies only in a step all replicas take part in: a quorum formed while
        # it was still starting (or healing) leaves it out, and the survivors' step would
        # then commit without it (seen once in CI, under load).
        full = manager.num_participants() == replicas
        if bucket_mb and sys.argv[4] == "1" and not restarted and step >= kill_at and full:
            emit({"replica": replica_id, "killed_at": step})
            (markers / "killed").write_text(str(step))
            # The others are in their backward, whose first bucket waits for this one.
            others_reached(markers, "backward", step, replicas - 1)
            os.kill(os.getpid(), signal.SIGKILL)
        (markers / f"backward-{step}-{replica_id}").touch()
        loss.backward()  # through DDP: its comm hook allreduces each bucket
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if stop and step >= kill_at and full and not (markers / "killed").exists():
            emit({"replica": replica_id, "killed_at": step, "t": time.time()})
            (markers / "killed").write_text(str(step))
            os.kill(os.getpid(), signal.SIGSTOP)  # hung, with the others in the allreduces
            (markers / f"restarted-{replica_id}").touch()  # SIGCONT: back, for `hold`
        if stall and step >= kill_at:
            emit({"replica": replica_id, "killed_at": step, "t": time.time()})
            (markers / "killed").write_text(str(step))
            time.sleep(600)  # the test cuts this node off, then kills it
        if sys.argv[4] == "1" and not restarted and step >= kill_at and full:
            emit({"replica": replica_id, "killed_at": step})
            (markers / "killed").write_text(str(step))
            # The first of the step's allreduces, then death: once it is done, every
            # other replica has issued its first one, and its second waits for this one.
            manager.allreduce(grads[0]).wait()
            emit({"replica": replica_id, "sigkill_t": time.time()})
            os.kill(os.getpid(), signal.SIGKILL)
        works = [] if bucket_mb else [manager.allreduce(g) for g in grads]
        for work in works:
            work.wait()
        participants = manager.num_participants()
        if lag and step == steps - 1 and participants < replicas:
            # The last step is whole: one a quorum of fewer took (a laggard asked late) is
            # discarded and retried with it, or the others would finish and leave it
            # waiting alone for a quorum until its timeout (seen in a suite run).
            manager.report_error(RuntimeError(f"the last step needs all {replicas} replicas, "
                                              f"not {participants}"))
        error = manager.errored()
        optimizer.step()  # should_commit: a step with a failure is discarded
        emit({"replica": replica_id, "step": step, "participants": participants,
              "committed": manager.current_step() > step, "healed": restarted,
              "t": time.time(), "error": None if error is None else str(error)[:300]})
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    emit({"replica": replica_id, "final_step": manager.current_step(),
          "params": flat.tolist()[:64], "checksum": float(flat.double().sum()),
          "batches_committed": manager.batches_committed(),
          "heal": (dataclasses.asdict(transport.last_heal)
                   if isinstance(transport, GradsyncTransport) and transport.last_heal
                   else None)})
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
