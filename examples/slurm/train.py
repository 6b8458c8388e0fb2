"""A torch training script for examples/slurm/train.sbatch: torch's DDP on backend "gradsync".

Each task of the srun step is one rank: the rank and world size come from
Slurm (`SLURM_PROCID`, `SLURM_NTASKS`; torchrun's `RANK`, `WORLD_SIZE` win
where set), the rendezvous from `MASTER_ADDR`/`MASTER_PORT` (env://, which
train.sbatch sets to the first node), and the daemon of this node from
`GRADSYNC_DAEMON`.  Only the backend name differs from a torch DDP script.
Without Slurm, on one machine:

    MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 gradsync launch --nproc-per-node 2 \
        examples/slurm/train.py

Every rank trains a small MLP on its share of each global batch of one
synthetic data set, then checks that its parameters are bit-identical to every
other rank's (element-wise min and max over ranks) and equal, to 1e-4, to the
same model trained in this process alone on the whole batches.  Each rank
prints one line `gradsync-train: rank=R world=W node=NAME identical=BOOL
max_error=E`; the exit status is 1 if a check fails.  Options: `--epochs`,
`--samples`, `--batch` (global), `--lr`, `--seed`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist

import gradsync.client.torch  # noqa: F401  (registers the backend "gradsync")

FEATURES, HIDDEN, CLASSES = 16, 64, 4


def make_data(seed: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and a random teacher's labels: the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    return x, (torch.tanh(x) @ teacher).argmax(dim=1)


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES)
    )


def train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
          args: argparse.Namespace, rows: slice) -> float:
    """Plain torch training on `rows` of every global batch; the last epoch's mean loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    steps = len(x) // args.batch
    loss_sum = 0.0
    for _epoch in range(args.epochs):
        loss_sum = 0.0
        for step in range(steps):
            batch = slice(step * args.batch, (step + 1) * args.batch)
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[batch][rows]), y[batch][rows])
            loss.backward()  # under DDP: gradients averaged over the ranks here
            optimizer.step()
            loss_sum += loss.item()
    return loss_sum / max(steps, 1)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=256, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the ranks of a node share its cores
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    if args.batch % world:
        print(f"--batch {args.batch} must be a multiple of the {world} ranks", file=sys.stderr)
        return 2
    dist.init_process_group("gradsync", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    x, y = make_data(args.seed, args.samples)
    # Every rank starts from its own seed: torch's DDP broadcasts rank 0's parameters.
    model = torch.nn.parallel.DistributedDataParallel(make_model(args.seed + rank))
    per_rank = args.batch // world
    loss = train(model, x, y, args, slice(rank * per_rank, (rank + 1) * per_rank))

    mine = flat(model.module)
    low, high = mine.clone(), mine.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    identical = bool(torch.equal(low, mine) and torch.equal(high, mine))
    dist.destroy_process_group()

    reference = make_model(args.seed)
    train(reference, x, y, args, slice(None))
    error = float((mine - flat(reference)).abs().max())
    if rank == 0:
        print(f"gradsync-train: {world} rank(s), {args.epochs} epoch(s), last epoch's loss "
              f"{loss:.4f} on rank 0's shard", flush=True)
    print(f"gradsync-train: rank={rank} world={world} node={socket.gethostname()} "
          f"identical={str(identical).lower()} max_error={error:.3g}", flush=True)
    if not identical:
        print(f"rank {rank}: FAIL: parameters differ between ranks", file=sys.stderr)
    if not error < 1e-4:
        print(f"rank {rank}: FAIL: parameters differ from single-process training by "
              f"{error:.3g}", file=sys.stderr)
    return 0 if identical and error < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
