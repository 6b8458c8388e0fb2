"""One rank of a job spread over daemons: save a DCP checkpoint into daemon memory, or
load the job's newest complete one (tests/test_checkpoint_replicas.py).

argv: JOB MODE STEP [--blob-mib N]; ranks from env:// (RANK, WORLD_SIZE, MASTER_ADDR/PORT)
and the daemon from GRADSYNC_DAEMON.  The state: a tensor every rank shares (DCP
writes it once), one of the rank's own (its part alone holds it), and the step; with
`--blob-mib`, rank 0 also saves an N MiB tensor of its own.  MODE `save` saves step
STEP; `load` loads into zeros.  Prints one JSON line: the rank, the step, and the
SHA-256 of every tensor's bytes.
"""

import argparse
import datetime
import hashlib
import json

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from gradsync.client.torch.checkpoint import DaemonStorageReader, DaemonStorageWriter

parser = argparse.ArgumentParser()
parser.add_argument("job")
parser.add_argument("mode", choices=["save", "load"])
parser.add_argument("step", type=int)
parser.add_argument("--blob-mib", type=int, default=0)
args = parser.parse_args()

dist.init_process_group("gradsync", timeout=datetime.timedelta(seconds=60))
RANK = dist.get_rank()


def state(step: int, fill: bool) -> dict[str, torch.Tensor]:
    """The state to save (`fill`), or zeros of its shapes to load into."""
    generator = torch.Generator().manual_seed(1000 * step + RANK)
    shared = torch.Generator().manual_seed(step)
    made = {"shared": torch.randn(128, 64, generator=shared),
            f"own{RANK}": torch.randn(256, 256, generator=generator),
            "step": torch.tensor(step)}
    if args.blob_mib and RANK == 0:
        made["blob0"] = torch.rand(args.blob_mib * 2**18, generator=generator)
    return made if fill else {key: torch.zeros_like(value) for key, value in made.items()}


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {key: hashlib.sha256(value.numpy().tobytes()).hexdigest()
            for key, value in sorted(tensors.items())}


if args.mode == "save":
    saved = state(args.step, fill=True)
    writer = DaemonStorageWriter(job=args.job)
    dcp.save(saved, storage_writer=writer, checkpoint_id=str(args.step))
    print(json.dumps({"rank": RANK, "step": args.step, "digests": digests(saved),
                      "checkpoints": writer.store.list()}), flush=True)
else:
    loaded = state(args.step, fill=False)
    dcp.load(loaded, storage_reader=DaemonStorageReader(job=args.job))
    print(json.dumps({"rank": RANK, "step": int(loaded["step"]), "digests": digests(loaded)}),
          flush=True)
dist.destroy_process_group()
