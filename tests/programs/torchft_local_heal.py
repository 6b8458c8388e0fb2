"""Replica program: a torchft replica that keeps its state in the local daemon each step.

Usage: torchft_local_heal.py REPLICA_ID STEPS KILL_AT VICTIM MARKER_DIR [SKIP_SAVE]
Environment: TORCHFT_LIGHTHOUSE, GRADSYNC_DAEMON, LOCAL_NAME (the run's prefix of
the local checkpoints' names).  Trains a small model (SGD with momentum, so the
optimizer's state must heal too) with torchft's Manager (min_replica_size 2, no
step-0 sync: every replica starts from the same seed) over ProcessGroupGradsync
and GradsyncTransport(local_checkpoints=...), calling `save_local` after every
step, until torchft's step reaches STEPS.  A VICTIM (1) SIGKILLs itself once the
quorum of step KILL_AT is in (the first run only: its restart finds its marker);
its first run does not keep step SKIP_SAVE (default: none skipped).  Prints one
JSON line per step and a final one: parameters, how it healed, bytes it sent.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed import TCPStore
from torchft import Manager, Optimizer

from gradsync.client.torch.torchft_group import ProcessGroupGradsync
from gradsync.client.torch.torchft_transport import GradsyncTransport


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def main() -> None:
    replica_id, steps, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    victim, markers = sys.argv[4] == "1", Path(sys.argv[5])
    skip_save = int(sys.argv[6]) if len(sys.argv) > 6 else -1
    restarted = (markers / f"started-{replica_id}").exists()
    (markers / f"started-{replica_id}").touch()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = datetime.timedelta(seconds=30)
    pg = ProcessGroupGradsync(timeout=timeout)
    transport: GradsyncTransport[Any] = GradsyncTransport(
        pg, timeout, local_checkpoints=f"{os.environ['LOCAL_NAME']}-{replica_id}-rank0")
    manager = Manager(
        pg=pg, hostname="127.0.0.1", init_sync=False, min_replica_size=2,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                       inner.load_state_dict(state["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=replica_id, store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, timeout=timeout,
        quorum_timeout=datetime.timedelta(seconds=60), use_async_quorum=False,
        checkpoint_transport=transport,
    )
    optimizer = Optimizer(manager, inner)
    while manager.current_step() < steps:
        optimizer.zero_grad()  # the quorum: a restarted replica heals here
        step = manager.current_step()
        if victim and not restarted and step == kill_at:
            emit({"replica": replica_id, "killed_at": step})
            os.kill(os.getpid(), signal.SIGKILL)
        generator = torch.Generator().manual_seed(1000 * step + (manager.participating_rank()
                                                                 or 0))
        model(torch.randn(16, 32, generator=generator)).square().mean().backward()
        for work in [manager.allreduce(p.grad) for p in model.parameters()
                     if p.grad is not None]:
            work.wait()
        participants, error = manager.num_participants(), manager.errored()
        optimizer.step()  # should_commit: a step with a failure is discarded
        kept = (restarted or manager.current_step() != skip_save) and transport.save_local(manager)
        emit({"replica": replica_id, "step": step, "participants": participants,
              "committed": manager.current_step() > step, "kept": kept, "healed": restarted,
              "error": None if error is None else str(error)[:300]})
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    momentum = torch.cat([inner.state[p]["momentum_buffer"].reshape(-1)
                          for p in model.parameters()])
    emit({"replica": replica_id, "final_step": manager.current_step(),
          "params": flat.tolist(), "momentum": momentum.tolist(),
          "batches_committed": manager.batches_committed(), "sent_bytes": transport.sent_bytes,
          "heal": dataclasses.asdict(transport.last_heal) if transport.last_heal else None})
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
