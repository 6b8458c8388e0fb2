"""Rank program: torch DDP on backend gradsync, uncompressed, bf16 and fp8 with
error feedback, torch's fp16_compress_hook on gloo, and gradsync's own DDP with bf16: the same
training each.

An MLP regresses a fixed random teacher for `steps` SGD steps, each rank on
batches of its own; the loss is measured on one held-out set every rank
shares.  Compression is switched per run by the one line a user writes,
`set_compression(None, ...)`, on the default group.  Prints one JSON line:
each run's final loss, and whether every rank ended with the same parameters
(the digest of their bytes).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel

import gradsync.client.torch  # noqa: F401  (the backend)
from gradsync.client.cli.stats import fetch_snapshot
from gradsync.client.torch import DistributedDataParallel as GradsyncDDP
from gradsync.client.torch.compression import compression_of, set_compression

FEATURES, HIDDEN = 32, 512  # 70 KB of gradients: above the 64 KiB torch shares


def timed(seconds: dict[str, float], name: str, run: object) -> tuple[float, float, str]:
    """`run()`, its wall time kept in `seconds` (printed: where the test's time goes)."""
    start = time.monotonic()
    result: tuple[float, float, str] = run()  # type: ignore[operator]
    seconds[name] = round(time.monotonic() - start, 2)
    return result


def train(
    steps: int, group: dist.ProcessGroup | None, fp16_hook: bool, ours: str | None = None,
    fsdp: bool = False,
) -> tuple[float, float, str]:
    """`ours`: train with gradsync's own DDP wrapper, compressed with that format;
    `fsdp`: with FSDP2 (fully_shard), whose gradients go by reduce-scatter."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(),
                                torch.nn.Linear(HIDDEN, 1))
    ddp: torch.nn.Module
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        ddp = fully_shard(model)  # one group: a gather and a reduce-scatter a step
    elif ours is not None:
        ddp = GradsyncDDP(model, compression=ours)
    else:
        ddp = DistributedDataParallel(model, process_group=group)
    if fp16_hook:
        ddp.register_comm_hook(group, fp16_compress_hook)  # type: ignore[operator]
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    teacher = torch.Generator().manual_seed(1)
    weights = torch.randn(FEATURES, 1, generator=teacher) / FEATURES**0.5
    held_out = torch.randn(512, FEATURES, generator=teacher)
    data = torch.Generator().manual_seed(100 + dist.get_rank())
    with torch.no_grad():
        first = torch.nn.functional.mse_loss(model(held_out), torch.sin(held_out @ weights))
    for _ in range(steps):
        batch = torch.randn(64, FEATURES, generator=data)
        loss = torch.nn.functional.mse_loss(ddp(batch), torch.sin(batch @ weights))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(model(held_out), torch.sin(held_out @ weights))
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in full)).hexdigest()
    return float(final), float(first), digest


def main() -> int:
    steps = int(sys.argv[1])
    dist.init_process_group("gradsync", timeout=datetime.timedelta(seconds=60),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    gloo = dist.new_group(backend="gloo")
    runs = {}
    seconds: dict[str, float] = {}
    for name, compression, feedback in (("gradsync", None, False), ("gradsync_bf16", "bf16", False),
                                        ("gradsync_fp8_ef", "fp8", True)):
        set_compression(None, compression, error_feedback=feedback)
        assert compression_of(None).format == compression
        runs[name] = timed(seconds, name, lambda: train(steps, None, False))
        if feedback:  # torch's buckets, once shared with the daemon, hold residuals
            held = fetch_snapshot(os.environ["GRADSYNC_DAEMON"] + ".stats", 10.0)
    runs["gloo_fp16_hook"] = timed(seconds, "gloo_fp16_hook", lambda: train(steps, gloo, True))
    runs["ours_bf16"] = timed(seconds, "ours_bf16",
                              lambda: train(steps, None, False, ours="bf16"))
    for name, compression in (("fsdp2", None), ("fsdp2_bf16", "bf16")):
        set_compression(None, compression)
        runs[name] = timed(seconds, name,  # slower per step: fewer
                           lambda: train(steps // 4, None, False, fsdp=True))
    dist.destroy_process_group()
    print(json.dumps({"rank": dist.get_rank() if dist.is_initialized() else None,
                      "losses": {name: loss for name, (loss, _, _) in runs.items()},
                      "initial": runs["gradsync"][1], "seconds": seconds,
                      "error_feedback": held["error_feedback"],
                      "digests": {name: digest for name, (_, _, digest) in runs.items()}}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
