"""torch DDP on backend "gradsync" with a DCP checkpoint in daemon memory every step.

argv: JOB STEPS [options]; ranks from env:// (RANK, WORLD_SIZE, MASTER_ADDR/PORT).
Fixed data order (each step's batch depends on step and rank alone), Adam (so
the optimizer state matters).  Options:

- `--resume`: first load the job's newest complete checkpoint and go on after it;
- `--die-mid-step K`: rank 1 SIGKILLs itself in step K, after backward, before
  the step's save;
- `--die-in-save K`: rank 1 SIGKILLs itself in step K's save, after writing its
  part into the daemon and before the commit;
- `--blob-mib N --blob-step K`: step K's checkpoint also carries an N MiB tensor
  (to overflow the daemon's budget): its save fails, training goes on;
- `--async`: save with `dcp.async_save`, over a gloo group: torch's async_save
  accepts only groups that list a CPU backend in `pg._device_types`, which a
  Python process group such as gradsync's leaves empty;
- `--resume-if-any`: resume where the daemon holds a complete checkpoint of the
  job (what a trainer restarted by `torchrun --max-restarts` does), else start;
- `--all-die-mid-step K`: every rank SIGKILLs itself in step K, after backward;
- `--die-attempt A`, `--all-die-attempt A`: under torchrun the two kinds of death
  happen only in attempt A (`TORCHELASTIC_RESTART_COUNT`; default 0);
- `--out DIR`: each rank marks its start in DIR (attempt-A-rank-R.started) and
  writes its JSON record to DIR/rank-R.json too (torchrun's ranks share a stdout).

Prints one JSON line per rank at the end: the final parameters (hex of their
bytes), the step resumed from, the save errors seen.
"""

import argparse
import datetime
import json
import os
import signal
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from gradsync.client.torch.checkpoint import DaemonStorageReader, DaemonStorageWriter

parser = argparse.ArgumentParser()
parser.add_argument("job")
parser.add_argument("steps", type=int)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--die-mid-step", type=int, default=-1)
parser.add_argument("--die-in-save", type=int, default=-1)
parser.add_argument("--blob-mib", type=int, default=0)
parser.add_argument("--blob-step", type=int, default=-1)
parser.add_argument("--async", dest="use_async", action="store_true")
parser.add_argument("--resume-if-any", action="store_true")
parser.add_argument("--all-die-mid-step", type=int, default=-1)
parser.add_argument("--die-attempt", type=int, default=0)
parser.add_argument("--all-die-attempt", type=int, default=0)
parser.add_argument("--out", default=None)
args = parser.parse_args()
ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT")
if ATTEMPT is not None and int(ATTEMPT) != args.die_attempt:
    args.die_mid_step = args.die_in_save = -1
if ATTEMPT is not None and int(ATTEMPT) != args.all_die_attempt:
    args.all_die_mid_step = -1

dist.init_process_group("gradsync", timeout=datetime.timedelta(seconds=20))
RANK = dist.get_rank()
if args.out is not None:
    open(os.path.join(args.out, f"attempt-{ATTEMPT or 0}-rank-{RANK}.started"), "w").close()


class DyingWriter(DaemonStorageWriter):
    """Dies (SIGKILL) between its write and the commit at step `--die-in-save`."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        if RANK == 1 and self.step == args.die_in_save:
            os.kill(os.getpid(), signal.SIGKILL)
        return written


torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
model = torch.nn.parallel.DistributedDataParallel(net)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
writer = DyingWriter(job=args.job)


def state(step: int) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "step": torch.tensor(step)}


def train_step(step: int) -> None:
    generator = torch.Generator().manual_seed(1000 * step + RANK)
    inputs = torch.randn(8, 16, generator=generator)
    targets = torch.randn(8, 4, generator=generator)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    if (RANK == 1 and step == args.die_mid_step) or step == args.all_die_mid_step:
        os.kill(os.getpid(), signal.SIGKILL)
    optimizer.step()


resumed_from = None
start = 0
if args.resume or (args.resume_if_any and writer.store.list()):
    # Every rank's model and optimizer hold their state after one step, so that the
    # optimizer's state dict has the entries the checkpoint fills.
    train_step(0)
    restored = state(-1)
    dcp.load(restored, storage_reader=DaemonStorageReader(job=args.job))
    set_state_dict(model, optimizer, model_state_dict=restored["model"],
                   optim_state_dict=restored["optim"])
    resumed_from = int(restored["step"])
    start = resumed_from + 1

errors: list[str] = []
pending = None
async_group = dist.new_group(backend="gloo") if args.use_async else None
for step in range(start, args.steps):
    train_step(step)
    saved = state(step)
    if step == args.blob_step:
        saved["blob"] = torch.ones(args.blob_mib * 2**18)
    try:
        if args.use_async:
            if pending is not None:
                pending.result()
            pending = dcp.async_save(saved, storage_writer=writer, checkpoint_id=str(step),
                                     process_group=async_group)
        else:
            dcp.save(saved, storage_writer=writer, checkpoint_id=str(step))
    except (Exception, CheckpointException) as exc:  # the save failed: training goes on
        errors.append(f"{type(exc).__name__}: {exc}")
if pending is not None:
    pending.result()

params = {name: p.detach().numpy().tobytes().hex() for name, p in net.named_parameters()}
record = json.dumps({"rank": RANK, "params": params, "resumed_from": resumed_from,
                     "errors": errors, "checkpoints": writer.store.list()})
print(record, flush=True)
if args.out is not None:
    with open(os.path.join(args.out, f"rank-{RANK}.json"), "w") as out:
        out.write(record)
dist.destroy_process_group()
