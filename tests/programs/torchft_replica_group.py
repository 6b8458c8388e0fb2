"""One rank of a 2-rank torchft replica group, run by torchrun: DDP inside the group,
torchft across groups, everything on gradsync.

Usage: torchrun --standalone --nproc-per-node 2 --max-restarts 1 \
    torchft_replica_group.py REPLICA_ID STEPS KILL_AT VICTIM MARKER_DIR REPLICAS

Inside the group: torch's DistributedDataParallel on `init_process_group("gradsync")`
(torchrun's store), so a step's gradients are averaged over the group's two ranks.
Across groups: torchft's Manager (group world size 2, min_replica_size 2), one
`Manager.allreduce` per gradient on ProcessGroupGradsync, where group rank r meets
rank r of every other group, and healing through GradsyncTransport.  In the first
attempt of the VICTIM (1) group, rank 1 SIGKILLs itself at the first step from
KILL_AT that every group is in, after its backward and before the cross-group
allreduces: the other groups' rank 1 fails there, their whole group discards the
step, and torchrun restarts both of the victim's ranks, which heal and rejoin.
Rank 0 writes MARKER_DIR/started-REPLICA_ID (restarted-... in a later attempt)
once its Manager is up; the others hold for those markers as torchft_replica.py's
replicas do.  Prints one JSON line per rank and step, and a final one.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from torch.nn.parallel import DistributedDataParallel
from torchft import Manager, Optimizer
from torchft_replica import emit, hold

from gradsync.client.torch.torchft_group import ProcessGroupGradsync
from gradsync.client.torch.torchft_transport import GradsyncTransport


def group_store(attempt: int, rank: int) -> TCPStore:
    """A store of this attempt alone for torchft (rank 0 hosts it): torchrun's keeps
    the dead attempt's manager address, which rank 1 would otherwise dial."""
    host = "127.0.0.1"
    agent = dist.distributed_c10d._get_default_store()
    key = f"torchft-store-port/{attempt}"
    if rank == 0:
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        agent.set(key, str(store.port))
        return store
    return TCPStore(host, int(agent.get(key)), is_master=False, wait_for_workers=False)


def main() -> None:
    replica_id, steps, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    victim, markers, replicas = sys.argv[4] == "1", Path(sys.argv[5]), int(sys.argv[6])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    timeout = datetime.timedelta(seconds=30)
    dist.init_process_group("gradsync", timeout=timeout)  # the group's own DDP
    rank, size = dist.get_rank(), dist.get_world_size()
    store = group_store(attempt, rank)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    pg = ProcessGroupGradsync(timeout=timeout)
    transport = GradsyncTransport(pg, timeout)
    manager = Manager(
        pg=pg, hostname="127.0.0.1", min_replica_size=2,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                       inner.load_state_dict(state["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=replica_id, store_addr="127.0.0.1", store_port=store.port,
        rank=rank, world_size=size, timeout=timeout,
        quorum_timeout=datetime.timedelta(seconds=60), use_async_quorum=False,
        checkpoint_transport=transport,
    )
    optimizer = Optimizer(manager, inner)
    trained = DistributedDataParallel(model)
    if rank == 0:
        (markers / f"{'restarted' if attempt else 'started'}-{replica_id}").touch()
    while manager.current_step() < steps:
        if not victim:
            hold(markers, manager.current_step(), kill_at, replicas)
        optimizer.zero_grad()  # the quorum (a healing group gets its step here)
        step = manager.current_step()
        (markers / f"{replica_id}-{rank}-step-{step}").touch()
        generator = torch.Generator().manual_seed(
            1000 * step + 10 * (manager.participating_rank() or 0) + rank)
        trained(torch.randn(16, 32, generator=generator)).square().mean().backward()
        if (victim and rank == 1 and not attempt and step >= kill_at
                and manager.num_participants() == replicas):
            emit({"replica": replica_id, "rank": rank, "killed_at": step})
            (markers / "killed").write_text(str(step))
            os.kill(os.getpid(), signal.SIGKILL)  # the group's other rank goes on, alone
        works = [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]
        for work in works:
            work.wait()
        participants, error = manager.num_participants(), manager.errored()
        optimizer.step()  # should_commit, over both ranks of every group
        emit({"replica": replica_id, "rank": rank, "attempt": attempt, "step": step,
              "participants": participants, "committed": manager.current_step() > step,
              "error": None if error is None else str(error)[:300]})
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    emit({"replica": replica_id, "rank": rank, "attempt": attempt,
          "final_step": manager.current_step(), "params": flat.tolist()[:64],
          "checksum": float(flat.double().sum()),
          "healed": transport.last_heal is not None})
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
