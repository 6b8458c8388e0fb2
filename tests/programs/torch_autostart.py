"""Trains a small model with torch DDP on backend "gradsync", with no daemon set up.

Run under torchrun with no gradsyncd running and GRADSYNC_DAEMON unset: the
backend starts the job's daemons itself.  Prints one JSON line per rank: the
daemon it used (endpoint and pid, for the test to check that it is gone
afterwards), the final parameters' checksum and a few values.
"""

import datetime
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gradsync", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
endpoint = os.environ["GRADSYNC_DAEMON"]  # set by the backend for later groups

from gradsync.client.ping import query  # noqa: E402  (only to report the daemon's pid)

daemon_pid = query(endpoint, 10.0)["pid"]
print(json.dumps({"started": rank, "endpoint": endpoint, "daemon_pid": daemon_pid}), flush=True)
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
generator = torch.Generator().manual_seed(100 + rank)
for _ in range(int(os.environ.get("STEPS", "20"))):
    inputs = torch.randn(8, 16, generator=generator)
    loss = (model(inputs) - inputs.sum(1, keepdim=True)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
dist.destroy_process_group()
print(json.dumps({
    "rank": rank, "endpoint": endpoint, "daemon_pid": daemon_pid,
    "params": flat[:8].tolist(), "checksum": float(flat.double().sum()),
    "sum": float(total[0]), "node": os.environ.get("NODE", ""),
}), flush=True)
