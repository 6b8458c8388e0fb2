"""Data-parallel PyTorch training through gradsync's DistributedDataParallel.

Run it on two local ranks (a private daemon is started and stopped for you):

    gradsync launch --nproc-per-node 2 examples/ddp_torch.py

Every rank builds the same synthetic classification data set from one seed
(labels from a random "teacher" network) and trains an MLP on its share of
each global batch.  The training loop is torch's usual one: wrapping the model
in `gradsync.client.torch.DistributedDataParallel` is the only change.  Its
gradients live in the daemon's shared memory and are averaged bucket by bucket
while backward is still running.  At the end each rank checks that

- its parameters are bit-identical to every other rank's, and
- they match the same model trained in one process on the whole global
  batches, to 1e-3 (float32 sums in a different order round differently, and
  training can amplify that; in float64 the two agree to about 1e-16);

and exits 1 if not.  Options: `--epochs N`, `--samples N`, `--batch N`
(global), `--lr X`, `--seed N`.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from gradsync.client import Client
from gradsync.client.torch import DistributedDataParallel

FEATURES, HIDDEN, CLASSES = 20, 256, 4


def make_data(seed: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and the labels a random teacher network gives them; the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    y = (torch.tanh(x) @ teacher).argmax(dim=1)
    return x, y


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


def train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace,
          rows: slice, log: bool) -> list[float]:
    """Plain torch training on `rows` of every global batch; returns the hidden shares."""
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    hidden: list[float] = []
    steps_per_epoch = len(x) // args.batch
    for epoch in range(args.epochs):
        correct = total = 0
        loss_sum = 0.0
        for step in range(steps_per_epoch):
            batch = slice(step * args.batch, (step + 1) * args.batch)
            xb, yb = x[batch][rows], y[batch][rows]
            optimizer.zero_grad()
            logits = model(xb)
            loss = torch.nn.functional.cross_entropy(logits, yb)
            loss.backward()          # gradients are averaged across ranks by the end of this
            optimizer.step()
            loss_sum += loss.item()
            correct += int((logits.argmax(dim=1) == yb).sum())
            total += len(yb)
            record = getattr(model, "last_step", None)
            if record is not None:
                hidden.append(record.hidden_fraction())
        if log:
            print(f"epoch {epoch}: loss {loss_sum / steps_per_epoch:.4f}  "
                  f"accuracy {correct / total:.3f} (rank 0's shard)", flush=True)
    return hidden


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=256, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # ranks share the machine's cores
    x, y = make_data(args.seed, args.samples)

    with Client() as client:
        rank, world = client.rank, client.world_size
        if args.batch % world:
            print(f"--batch {args.batch} must be a multiple of {world} ranks", file=sys.stderr)
            return 2
        per_rank = args.batch // world
        # Rank 0's initial parameters win (broadcast at construction).  Small buckets, so
        # that this small model has several and the first is handed over early.
        model = DistributedDataParallel(make_model(args.seed + rank), client,
                                        bucket_cap_mb=0.1, first_bucket_mb=0.01)
        if rank == 0:
            print(f"gradsync DDP example: {world} rank(s), {args.samples} samples, global "
                  f"batch {args.batch}, {len(model.bucket_layout)} bucket(s), daemon pid "
                  f"{client.daemon_pid}", flush=True)
        started = time.perf_counter()
        hidden = train(model, x, y, args, slice(rank * per_rank, (rank + 1) * per_rank),
                       log=rank == 0)
        elapsed = time.perf_counter() - started

        # Identical everywhere: the element-wise min and max over ranks are ours.
        mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        low, high = client.empty(mine.size, np.float32), client.empty(mine.size, np.float32)
        low[...] = mine
        high[...] = mine
        client.all_reduce(low, op="min")
        client.all_reduce(high, op="max")
        identical = bool(np.array_equal(low, mine) and np.array_equal(high, mine))

    reference = make_model(args.seed)
    train(reference, x, y, args, slice(None), log=False)
    with torch.no_grad():
        error = max(float((a - b).abs().max()) for a, b in
                    zip(model.module.parameters(), reference.parameters(), strict=True))
    matches = error < 1e-3
    if rank == 0:
        steps = args.epochs * (args.samples // args.batch)
        print(f"{steps} steps in {elapsed:.2f}s ({elapsed / max(steps, 1) * 1e3:.1f} ms/step); "
              f"communication hidden behind backward: {100 * float(np.mean(hidden)):.0f}%",
              flush=True)
    if not identical:
        print(f"rank {rank}: FAIL: parameters differ between ranks", file=sys.stderr)
    if not matches:
        print(f"rank {rank}: FAIL: parameters differ from single-process training "
              f"(max abs error {error:.2e})", file=sys.stderr)
    if identical and matches and rank == 0:
        print(f"OK: parameters identical on all {world} ranks and equal to single-process "
              f"training on the full batches (max abs error {error:.1e})", flush=True)
    return 0 if identical and matches else 1


if __name__ == "__main__":
    sys.exit(main())
