"""FSDP2 training with a DCP checkpoint in daemon memory after every step, on ranks
spread over daemons (tests/test_checkpoint_netns.py).

argv: JOB STEPS [--stop-after K] [--resume]; ranks from env:// (RANK, WORLD_SIZE,
MASTER_ADDR/PORT).  Fixed data order (each step's batch depends on step and rank
alone), Adam.  `--stop-after K`: end after step K's save; `--resume`: first load
the job's newest complete checkpoint and go on after it.  Prints one JSON line:
the rank, the step resumed from, and the SHA-256 of every tensor of the final
model and optimizer state, gathered whole.
"""

import argparse
import datetime
import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from gradsync.client.torch.checkpoint import DaemonStorageReader, DaemonStorageWriter

parser = argparse.ArgumentParser()
parser.add_argument("job")
parser.add_argument("steps", type=int)
parser.add_argument("--stop-after", type=int, default=-1)
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()

dist.init_process_group("gradsync", timeout=datetime.timedelta(seconds=60))
RANK, WORLD = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (WORLD,))

torch.manual_seed(0)
net = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3)))
for layer in net:
    fully_shard(layer, mesh=mesh)
fully_shard(net, mesh=mesh)
optimizer = torch.optim.Adam(net.parameters(), lr=0.01)


def train_step(step: int) -> None:
    inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(1000 * step + RANK))
    net(inputs).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def state(step: int) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(net, optimizer)
    return {"model": model_state, "optim": optim_state, "step": torch.tensor(step)}


def digests(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Each tensor's bytes, gathered whole, hashed."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(digests(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[prefix + str(key)] = hashlib.sha256(whole.numpy().tobytes()).hexdigest()
    return out


start, resumed_from = 0, None
if args.resume:
    train_step(0)  # the optimizer's state dict then has the entries the load fills
    restored = state(-1)
    dcp.load(restored, storage_reader=DaemonStorageReader(job=args.job))
    set_state_dict(net, optimizer, model_state_dict=restored["model"],
                   optim_state_dict=restored["optim"])
    resumed_from = int(restored["step"])
    start = resumed_from + 1

writer = DaemonStorageWriter(job=args.job)
for step in range(start, args.steps):
    train_step(step)
    dcp.save(state(step), storage_writer=writer, checkpoint_id=str(step))
    if step == args.stop_after:
        break
final = state(step)
print(json.dumps({"rank": RANK, "resumed_from": resumed_from, "digests": digests(final)}),
      flush=True)
dist.destroy_process_group()
