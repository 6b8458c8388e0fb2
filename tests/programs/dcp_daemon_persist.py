"""Training that checkpoints every step into daemon memory and persists every N-th
step to a directory (DaemonStorageWriter(persist_dir=...)).

argv: JOB DIR STEPS [--every N] [--fsdp] [--async]; ranks from env:// (RANK,
WORLD_SIZE, MASTER_ADDR/PORT).  Torch DDP (or FSDP2 with `--fsdp`) with Adam on
backend "gradsync", steps 1..STEPS; `--async` saves with `dcp.async_save` (over a
gloo group, as tests/programs/dcp_daemon_train.py explains).  Prints one JSON
line per rank: the final state flattened (persist_state.flatten), whether the
daemon's newest checkpoint loads back equal to it, the steps this rank
persisted, the warnings and errors seen.
"""

import argparse
import datetime
import json
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from persist_state import flatten, make_model, train_step
from torch.distributed.checkpoint.state_dict import get_state_dict

from gradsync.client.torch.checkpoint import DaemonStorageReader, DaemonStorageWriter

parser = argparse.ArgumentParser()
parser.add_argument("job")
parser.add_argument("dir")
parser.add_argument("steps", type=int)
parser.add_argument("--every", type=int, default=2)
parser.add_argument("--fsdp", action="store_true")
parser.add_argument("--async", dest="use_async", action="store_true")
args = parser.parse_args()

dist.init_process_group("gradsync", timeout=datetime.timedelta(seconds=60))
RANK = dist.get_rank()
net = make_model(args.fsdp)
if args.fsdp:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in net:
        fully_shard(layer, mesh=mesh)
    model: torch.nn.Module = fully_shard(net, mesh=mesh)
else:
    model = torch.nn.parallel.DistributedDataParallel(net)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
writer = DaemonStorageWriter(job=args.job, persist_dir=args.dir, persist_every=args.every,
                             persist_timeout_s=60)


def state(step: int) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "step": torch.tensor(step)}


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    async_group = dist.new_group(backend="gloo") if args.use_async else None
    pending = None
    for step in range(1, args.steps + 1):
        train_step(model, optimizer, step, RANK, 8 if args.fsdp else 16)
        if pending is not None:
            pending.result()
        if args.use_async:
            pending = dcp.async_save(state(step), storage_writer=writer,
                                     checkpoint_id=str(step), process_group=async_group)
        else:
            dcp.save(state(step), storage_writer=writer, checkpoint_id=str(step))
    if pending is not None:
        pending.result()
    final = flatten(state(args.steps))
    waited = writer.wait_persisted(120)

restored = state(-1)
dcp.load(restored, storage_reader=DaemonStorageReader(job=args.job, client=writer.store.client))
assert writer.persister is not None
print(json.dumps({
    "rank": RANK, "state": final, "daemon_equal": flatten(restored) == final,
    "waited": waited, "persisted": writer.persister.persisted,
    "errors": writer.persister.errors,
    "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
}), flush=True)
dist.destroy_process_group()
