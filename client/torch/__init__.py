"""PyTorch integration: a DDP wrapper whose gradient buckets live in the daemon's memory.

`DistributedDataParallel` is a drop-in for `torch.nn.parallel.DistributedDataParallel`
on CPU: gradients are views into daemon-owned shared-memory buckets, each bucket
is handed to the daemon (`all_reduce(avg, async_op=True)`) by a post-accumulate-grad
hook the moment its last gradient is ready, while backward goes on, and the end
of backward waits for all of them, so `loss.backward(); optimizer.step()` needs
nothing more.  `comm_hook` lets torch's own DDP send its buckets through gradsync.
Importing this package also registers the torch.distributed backend "gradsync"
(`ProcessGroupGradsync`; `empty` gives tensors in daemon memory).

Importing this package imports torch (`pip install gradsync[torch]`); nothing
else in gradsync does.  Its modules, one job each:

- `ddp.py`: our `DistributedDataParallel` and its overlap records;
  `buckets.py`: its bucket layout over daemon memory;
- `ddp_comm_hook.py`: `comm_hook`, for torch's own DDP;
- `backend.py`: the process group; `rendezvous.py`, `point_to_point.py`,
  `storage_sharing.py`: its store rendezvous, send/recv jobs and zero-copy storages;
  `tensors.py`: torch tensors as daemon buffers; `work.py`: its torch Work;
- `completer.py`: `FutureCompleter`, which completes every torch future here
  (the process group's and `comm_hook`'s);
- `private_daemon.py`: the job's own daemons, started when none runs;
- `monitored_barrier.py`: a barrier whose error names the ranks missing (torch's
  `dist.monitored_barrier` reaches it for gradsync groups);
- `fsdp.py` (imported on its own): FSDP2 buffers in daemon memory.
"""

from __future__ import annotations

from gradsync.client.torch.backend import ProcessGroupGradsync, empty, register
from gradsync.client.torch.ddp import BucketTiming, DistributedDataParallel, StepRecord
from gradsync.client.torch.ddp_comm_hook import comm_hook
from gradsync.client.torch.monitored_barrier import install as _install_monitored_barrier
from gradsync.client.torch.monitored_barrier import monitored_barrier

__all__ = [
    "BucketTiming", "DistributedDataParallel", "ProcessGroupGradsync", "StepRecord", "comm_hook",
    "empty", "monitored_barrier",
]

register()  # the torch.distributed backend "gradsync"
_install_monitored_barrier()  # torch's dist.monitored_barrier serves gradsync groups too
