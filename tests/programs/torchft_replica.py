"""Replica program: one torchft replica group of one rank, training on gradsync.

Usage: torchft_replica.py REPLICA_ID STEPS KILL_AT VICTIM MARKER_DIR
Environment: TORCHFT_LIGHTHOUSE (the Lighthouse), GRADSYNC_DAEMON.
Trains a small model with torchft's Manager (min_replica_size 2), one
`Manager.allreduce` per gradient, torchft's OptimizerWrapper, until torchft's
step reaches STEPS.  At step KILL_AT the VICTIM (1) SIGKILLs itself mid-step
(once; its restart, which finds its first marker, does not).  It writes
MARKER_DIR/started-REPLICA_ID (restarted-... when restarted) once its Manager
is up; from step KILL_AT+3 on, a replica that did not kill itself waits (60 s
at most) for the restarted replica's marker, so the rejoin happens before the
run ends.  Prints one JSON line per step and a final one.
"""

from __future__ import annotations

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

from gradsync.client.torch.torchft_group import ProcessGroupGradsync


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def main() -> None:
    replica_id, steps, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    victim, markers = sys.argv[4] == "1", Path(sys.argv[5])
    restarted = (markers / f"started-{replica_id}").exists()
    torch.manual_seed(0)  # every replica starts equal; torchft syncs step 0 anyway
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = datetime.timedelta(seconds=30)
    manager = Manager(
        pg=ProcessGroupGradsync(timeout=timeout),
        min_replica_size=2,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                       inner.load_state_dict(state["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=replica_id, store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, timeout=timeout,
        quorum_timeout=datetime.timedelta(seconds=60), use_async_quorum=False,
    )
    optimizer = Optimizer(manager, inner)
    (markers / f"{'restarted' if restarted else 'started'}-{replica_id}").touch()
    waited = False
    while manager.current_step() < steps:
        step = manager.current_step()
        if not waited and not victim and 0 <= kill_at <= step - 3:
            deadline = time.monotonic() + 60
            while not any(p.name.startswith("restarted-") for p in markers.iterdir()):
                if time.monotonic() > deadline:
                    raise SystemExit("the killed replica was not restarted within 60 s")
                time.sleep(0.05)
            waited = True
        optimizer.zero_grad()  # starts the quorum (a healing replica gets its step here)
        step = manager.current_step()
        generator = torch.Generator().manual_seed(1000 * manager.current_step()
                                                  + (manager.participating_rank() or 0))
        x = torch.randn(16, 32, generator=generator)
        loss = model(x).square().mean()
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if victim and not restarted and step >= kill_at:
            emit({"replica": replica_id, "killed_at": step})
            manager.allreduce(grads[0])  # the first of the step's allreduces, then death:
            time.sleep(0.2)  # the others wait in the second one by now
            os.kill(os.getpid(), signal.SIGKILL)
        works = [manager.allreduce(g) for g in grads]
        for work in works:
            work.wait()
        participants = manager.num_participants()
        optimizer.step()  # should_commit: a step with a failure is discarded
        emit({"replica": replica_id, "step": step, "participants": participants,
              "committed": manager.current_step() > step, "healed": restarted})
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    emit({"replica": replica_id, "final_step": manager.current_step(),
          "params": flat.tolist()[:64], "checksum": float(flat.double().sum()),
          "batches_committed": manager.batches_committed()})
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
