"""Rank program: a backward slow enough to overlap with the first bucket's allreduce.

Prints one JSON line per step: when backward ended (this process's
time.monotonic()) and, per bucket, whether it was handed over during backward
and the daemon's timestamps (the same clock).
"""

from __future__ import annotations

import json
import sys

import torch

from gradsync.client import Client
from gradsync.client.torch import DistributedDataParallel

WIDTH, LAYERS, BATCH, STEPS = 1024, 8, 128, 3


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))
    with Client() as client:
        ddp = DistributedDataParallel(model, client, bucket_cap_mb=8.0, first_bucket_mb=1.0)
        for step in range(STEPS):
            for param in ddp.parameters():
                param.grad = None
            x = torch.randn(BATCH, WIDTH)
            client.barrier()  # start each step together: what remains is compute jitter
            ddp(x).square().mean().backward()
            with torch.no_grad():
                for param in ddp.parameters():
                    param.sub_(1e-3 * param.grad)
            record = ddp.last_step
            assert record is not None
            print(json.dumps({
                "rank": client.rank,
                "step": step,
                "backward_end": record.backward_end,
                "hidden": record.hidden_fraction(),
                "buckets": [
                    {"index": b.index, "nbytes": b.nbytes, "during_backward": b.during_backward,
                     "handed_over": b.handed_over, **b.timing}
                    for b in record.buckets
                ],
            }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
