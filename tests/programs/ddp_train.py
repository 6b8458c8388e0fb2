"""Rank program: train through gradsync's DDP (and torch's DDP + comm_hook), against one process.

Usage: ddp_train.py SCENARIO[,SCENARIO...] [GLOO_STORE_FILE]
Prints one JSON line per scenario: this rank's error against single-process
training on the concatenated batch, the tolerance, and a digest of the final
parameters (the test checks the digests agree across ranks).
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

import torch
from ddp_common import (
    IN,
    batch,
    digest,
    loss_fn,
    make_net,
    make_optimizer,
    max_error,
    reference_train,
    shard,
    uses_extra,
)
from gloo_exit import exit_past_torch_gloo

from gradsync.client import Client
from gradsync.client.torch import DistributedDataParallel, comm_hook

STEPS = 4


def train_gradsync(
    client: Client, dtype: torch.dtype, *, optimizer: str = "sgd", micros: int = 1,
    spare: bool = False, zero_after_forward: bool = False, head_first: bool = False,
    **ddp_args: Any,
) -> dict[str, Any]:
    """Train with gradsync's DDP; micro-batches before the last run under no_sync()."""
    rank, world = client.rank, client.world_size
    # Differs per rank until DDP broadcasts.
    model = make_net(1000 + rank, dtype, spare, head_first)
    ddp = DistributedDataParallel(model, client, **ddp_args)
    first_layout = ddp.bucket_layout
    initial = digest(model)
    opt = make_optimizer(ddp.parameters(), optimizer)
    synced_outside = 0
    for step in range(STEPS):
        if not zero_after_forward:
            opt.zero_grad()
        for micro in range(micros):
            x, y = batch(step, micro, world, dtype)
            extra = {"use_extra": uses_extra(rank, step)} if spare else {}
            before = ddp.last_step
            if micro < micros - 1:
                with ddp.no_sync():
                    loss = loss_fn(ddp, shard(x, rank), shard(y, rank), **extra)
                    loss.backward()
                synced_outside += ddp.last_step is not before
            else:
                loss = loss_fn(ddp, shard(x, rank), shard(y, rank), **extra)
                if zero_after_forward:
                    opt.zero_grad()  # grads None after forward: the hook copies once
                loss.backward()
                assert ddp.last_step is not before, "backward did not synchronise"
        if spare:
            assert model.unused is not None
            assert all(p.grad is None for p in model.unused.parameters()), "unused got a grad"
            assert model.extra is not None
            expect_grad = step % 2 == 0
            assert (model.extra.grad is not None) == expect_grad, (step, model.extra.grad)
        opt.step()
    reference = reference_train(dtype, world, STEPS, micros, optimizer, spare, head_first)
    return {
        "first_layout": first_layout,
        "layout": ddp.bucket_layout,
        "err": max_error(model, reference),
        "digest": digest(model),
        "initial": initial,
        "buckets": len(ddp.bucket_layout),
        "synced_in_no_sync": synced_outside,
        "state_dict_keys": sorted(model.state_dict()) == sorted(reference.state_dict())
        and sorted(ddp.state_dict()) == sorted(f"module.{k}" for k in reference.state_dict()),
    }


def train_torch_ddp(client: Client, store: str) -> dict[str, Any]:
    """torch's own DDP (gloo only for its construction), gradients through comm_hook."""
    rank, world = client.rank, client.world_size
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world
    )
    calls = 0

    @functools.wraps(comm_hook)  # torch's DDP checks the hook's annotations
    def counting_hook(state: Client, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        nonlocal calls
        calls += 1
        return comm_hook(state, bucket)

    try:
        model = make_net(1000 + rank, torch.float64)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
        ddp.register_comm_hook(client, counting_hook)
        opt = make_optimizer(ddp.parameters(), "sgd")
        for step in range(STEPS):
            opt.zero_grad()
            x, y = batch(step, 0, world, torch.float64)
            loss_fn(ddp, shard(x, rank), shard(y, rank)).backward()
            opt.step()
    finally:
        torch.distributed.destroy_process_group()
    reference = reference_train(torch.float64, world, STEPS, 1, "sgd")
    return {"err": max_error(model, reference), "digest": digest(model), "hook_calls": calls}


def train_half(client: Client, dtype: torch.dtype) -> dict[str, Any]:
    """float16/bfloat16 parameters: trains, stays identical across ranks, near float32."""
    rank, world = client.rank, client.world_size
    model = make_net(1000 + rank, dtype)
    ddp = DistributedDataParallel(model, client, bucket_cap_mb=0.002, first_bucket_mb=0.001)
    opt = make_optimizer(ddp.parameters(), "sgd")
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, 0, world, dtype)
        loss_fn(ddp, shard(x, rank), shard(y, rank)).backward()
        opt.step()
    reference = make_net(1000, dtype).to(torch.float32)  # the same rounded start
    ref_opt = make_optimizer(reference.parameters(), "sgd")
    for step in range(STEPS):
        ref_opt.zero_grad()
        x, y = batch(step, 0, world, dtype)
        loss_fn(reference, x.float(), y.float()).backward()
        ref_opt.step()
    return {"err": max_error(model, reference), "digest": digest(model),
            "buckets": len(ddp.bucket_layout), "finite": all(
                bool(torch.isfinite(p).all()) for p in model.parameters())}


class WithBuffers(torch.nn.Module):
    """Buffers of several dtypes; the output depends on `scale`."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(IN, 2)
        self.register_buffer("scale", torch.ones(1))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("mask", torch.zeros(3, dtype=torch.bool))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x) * self.scale
        return out


def check_buffers(client: Client) -> dict[str, Any]:
    """Buffers are rank 0's at construction and again before each synchronising forward."""
    rank = client.rank
    torch.manual_seed(rank)
    model = WithBuffers()
    model.count.fill_(100 + rank)
    model.mask[rank % 3] = True
    ddp = DistributedDataParallel(model, client)
    after_init = [int(model.count), model.mask.tolist()]
    model.scale.fill_(rank + 2.0)  # diverge; the next forward takes rank 0's again
    ddp(torch.ones(1, IN)).sum().backward()
    scale = float(model.scale)
    model.scale.fill_(rank + 5.0)  # the first evaluation after training syncs too
    with torch.no_grad():
        ddp(torch.ones(1, IN))
    eval_scale = float(model.scale)
    model.scale.fill_(rank + 7.0)  # later evaluations stay local, as in torch's DDP
    with torch.no_grad():
        ddp(torch.ones(1, IN))
    return {"after_init": after_init, "scale": scale, "eval_scale": eval_scale,
            "local_scale": float(model.scale) - rank, "digest": digest(model)}


SCENARIOS = {
    # float64, several buckets (tiny caps), SGD with momentum: 1e-10
    "f64_buckets": lambda c, _: train_gradsync(
        c, torch.float64, bucket_cap_mb=0.004, first_bucket_mb=0.001),
    # float32, one default bucket, zero_grad() between forward and backward: 1e-5
    "f32": lambda c, _: train_gradsync(c, torch.float32, zero_after_forward=True),
    # a parameter no rank uses, and one used by rank 0 at even steps only
    "unused": lambda c, _: train_gradsync(
        c, torch.float64, spare=True, bucket_cap_mb=0.004, first_bucket_mb=0.001),
    # gradient accumulation: two micro-batches under no_sync(), then one synced; Adam
    "no_sync": lambda c, _: train_gradsync(
        c, torch.float64, micros=3, optimizer="adam", bucket_cap_mb=0.004,
        first_bucket_mb=0.001),
    # the head is registered first but its gradient is ready first: buckets rebuilt
    "reordered": lambda c, _: train_gradsync(
        c, torch.float64, head_first=True, micros=2, bucket_cap_mb=0.004,
        first_bucket_mb=0.001),
    # gradients copied into the buckets, with unused parameters and accumulation
    "copy": lambda c, _: train_gradsync(
        c, torch.float64, micros=2, spare=True, gradient_as_bucket_view=False,
        bucket_cap_mb=0.004, first_bucket_mb=0.001),
    "float16": lambda c, _: train_half(c, torch.float16),
    "bfloat16": lambda c, _: train_half(c, torch.bfloat16),
    "buffers": lambda c, _: check_buffers(c),
    "torch_hook": lambda c, store: train_torch_ddp(c, store),
}


def main() -> int:
    names = sys.argv[1].split(",")
    store = sys.argv[2] if len(sys.argv) > 2 else ""
    torch.set_num_threads(1)
    with Client() as client:
        for name in names:
            record = SCENARIOS[name](client, store)
            print(json.dumps({"scenario": name, "rank": client.rank, **record}), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    if torch.distributed.is_available() and "torch_hook" in sys.argv[1].split(","):
        exit_past_torch_gloo(code)
    sys.exit(code)
