"""FSDP2-sharded model and optimizer state saved by DCP into daemon memory and loaded
into a freshly initialised sharded model (argv[1]: the checkpoints' job).

Ranks from env:// (RANK, WORLD_SIZE, MASTER_ADDR/PORT).  Prints one JSON line:
whether the fresh model differed before the load and equals the trained one after,
for the parameters and Adam's state.
"""

import datetime
import json
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from gradsync.client.torch.checkpoint import DaemonStorageReader, DaemonStorageWriter

dist.init_process_group("gradsync", timeout=datetime.timedelta(seconds=60))
RANK, WORLD = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (WORLD,))


def trained(seed: int, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    for step in range(steps):
        inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(RANK * 10 + step))
        net(inputs).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return net, optimizer


def full(state: dict) -> dict:
    """Every tensor of a (nested) state dict, gathered whole."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in full(value).items()})
        elif isinstance(value, torch.Tensor):
            out[key] = value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
    return out


net, optimizer = trained(0, 2)
model_state, optim_state = get_state_dict(net, optimizer)
saved = full({"model": model_state, "optim": optim_state})
dcp.save({"model": model_state, "optim": optim_state},
         storage_writer=DaemonStorageWriter(job=sys.argv[1]), checkpoint_id="2")

fresh, fresh_optimizer = trained(1, 1)
model_state, optim_state = get_state_dict(fresh, fresh_optimizer)
before = full({"model": model_state, "optim": optim_state})
state = {"model": model_state, "optim": optim_state}
dcp.load(state, storage_reader=DaemonStorageReader(job=sys.argv[1]))
set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"],
               optim_state_dict=state["optim"])
model_state, optim_state = get_state_dict(fresh, fresh_optimizer)
after = full({"model": model_state, "optim": optim_state})
print(json.dumps({
    "rank": RANK,
    "sharded": any(hasattr(p, "full_tensor") for p in fresh.parameters()),
    "keys": sorted(saved),
    "differed_before": any(not torch.equal(before[k], saved[k]) for k in saved),
    "equal_after": sorted(after) == sorted(saved)
    and all(torch.equal(after[k], saved[k]) for k in saved),
}), flush=True)
dist.destroy_process_group()
