"""A torchrun worker whose first attempt loses a rank: the restart must re-form the group.

On the first attempt (TORCHELASTIC_RESTART_COUNT 0) rank 1 exits after one
allreduce, as a crashed worker would; torchrun (`--max-restarts`) stops the
others and starts every worker again, and the new attempt must form a fresh
group on backend "gradsync" and finish.  Prints one JSON line per finished rank.
"""

import datetime
import json
import os

import torch
import torch.distributed as dist

dist.init_process_group("gradsync", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
values = torch.full((256,), float(rank + 1))
dist.all_reduce(values)
if attempt == 0 and rank == 1:
    os._exit(3)
dist.barrier()
job = dist.distributed_c10d._get_default_group().gradsync_job  # type: ignore[attr-defined]
dist.destroy_process_group()
print(json.dumps({"rank": rank, "attempt": attempt, "sum": float(values[0]), "job": job,
                  "endpoint": os.environ.get("GRADSYNC_DAEMON")}), flush=True)
