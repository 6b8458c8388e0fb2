"""Rank program: torch.distributed on backend "gradsync", every primitive against a reference.

Usage: torch_backend_ranks.py SCENARIO[,SCENARIO...]
Rank and world come from torchrun-style variables; the rendezvous is
`init_method=env://` (MASTER_ADDR/MASTER_PORT), or GRADSYNC_TEST_INIT
(`tcp://…` or `file://…`).  Each scenario checks its own results against values
every rank can compute alone and prints one JSON line
{"scenario", "checks", "digest"?, "err"?}; any wrong value raises.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from ddp_common import batch, digest, loss_fn, make_net, make_optimizer, max_error, shard

import gradsync.client.torch as gt

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
INT_DTYPES = [torch.int8, torch.uint8, torch.int32, torch.int64]
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
STEPS = 3
# torch 2.13 renames several collectives; the old names are what 2.1-2.12 users call.
warnings.filterwarnings("ignore", category=FutureWarning)


def value(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank `rank`'s contribution: small values exact in every dtype."""
    base = torch.arange(n, dtype=torch.int64) * 3 + rank * 5 + salt
    return (base % 7 + 1).to(dtype)


class Checker:
    def __init__(self, scenario: str) -> None:
        self.scenario = scenario
        self.count = 0

    def equal(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        self.count += 1
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            raise AssertionError(
                f"rank {RANK} {self.scenario}/{what}: got {got.dtype}{tuple(got.shape)} "
                f"{got.flatten()[:8].tolist()}, want {want.dtype}{tuple(want.shape)} "
                f"{want.flatten()[:8].tolist()}"
            )

    def raises(self, what: str, error: type[BaseException], call: Callable[[], Any],
               needle: str) -> None:
        self.count += 1
        try:
            call()
        except error as exc:
            if needle not in str(exc):
                raise AssertionError(f"{what}: {needle!r} not in {exc}") from exc
            return
        raise AssertionError(f"rank {RANK} {self.scenario}/{what}: no {error.__name__}")


def reduce_ref(op: str, dtype: torch.dtype, n: int, ranks: list[int]) -> torch.Tensor:
    parts = [value(r, n, dtype) for r in ranks]
    if dtype == torch.bool or op in ("band", "bor", "bxor"):
        acc = parts[0].clone()
        for p in parts[1:]:
            acc = {"band": torch.bitwise_and, "bor": torch.bitwise_or,
                   "bxor": torch.bitwise_xor}[op](acc, p)
        return acc
    wide = [p.double() for p in parts]
    if op in ("sum", "avg"):
        out = sum(wide[1:], wide[0])
        if op == "avg":
            out = out / len(ranks)
    elif op == "prod":
        out = functools.reduce(torch.mul, wide)
    else:
        stacked = torch.stack(wide)
        out = stacked.max(0).values if op == "max" else stacked.min(0).values
    return out.to(dtype)


TORCH_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
             "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT,
             "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}


def primitives(group: Any = None, ranks: list[int] | None = None) -> int:
    """Every dist.* call of the issue on `group` (default: the world) against references."""
    check = Checker("primitives")
    ranks = ranks or list(range(WORLD))
    me, size = ranks.index(RANK), len(ranks)
    pg = group if group is not None else dist.group.WORLD
    assert isinstance(pg, gt.ProcessGroupGradsync), pg
    assert (pg.rank(), pg.size(), pg.getBackendName()) == (me, size, "gradsync"), pg
    assert pg.group_name == pg.getGroupName() == dist.distributed_c10d._get_process_group_name(
        pg), pg
    n = 37
    for dtype in FLOAT_DTYPES + INT_DTYPES:
        ops = ["sum", "max", "min", "prod"] + (["avg"] if dtype.is_floating_point
                                                else ["band", "bor", "bxor"])
        for op in ops:
            t = value(me, n, dtype)
            dist.all_reduce(t, op=TORCH_OPS[op], group=group)
            check.equal(f"all_reduce {op} {dtype}", t, reduce_ref(op, dtype, n, list(range(size))))
    for op in ("max", "min", "sum"):  # bool: NCCL's meaning (sum is "any")
        t = value(me, n, torch.int64).remainder(2).bool()
        dist.all_reduce(t, op=TORCH_OPS[op], group=group)
        parts = torch.stack([value(r, n, torch.int64).remainder(2).bool() for r in range(size)])
        check.equal(f"all_reduce bool {op}", t,
                    parts.all(0) if op == "min" else parts.any(0))
    z = torch.complex(value(me, n, torch.float32), value(me, n, torch.float32, salt=1))
    dist.all_reduce(z, group=group)
    want = sum(torch.complex(value(r, n, torch.float32), value(r, n, torch.float32, salt=1))
               for r in range(size))
    check.equal("all_reduce complex64", z, want)
    # A non-contiguous tensor is reduced in place, like any other.
    wide = value(me, 2 * n, torch.float32).view(n, 2)
    column = wide[:, 1]
    dist.all_reduce(column, group=group)
    check.equal("all_reduce strided", wide[:, 1],
                reduce_ref("sum", torch.float32, 2 * n, list(range(size))).view(n, 2)[:, 1])
    check.equal("all_reduce strided leaves the rest", wide[:, 0],
                value(me, 2 * n, torch.float32).view(n, 2)[:, 0])
    # Daemon-memory tensors: zero copy.
    shared = gt.empty(n, dtype=torch.float32, group=group)
    shared.copy_(value(me, n, torch.float32))
    work = dist.all_reduce(shared, async_op=True, group=group)
    assert work is not None
    result = work.get_future().wait()
    check.equal("all_reduce async future", result[0], reduce_ref("sum", torch.float32, n,
                                                                  list(range(size))))
    assert result[0].data_ptr() == shared.data_ptr()
    coalesced = [value(me, k, torch.float64) for k in (3, 5, 8)]
    dist.all_reduce_coalesced(coalesced, group=group)
    for k, t in zip((3, 5, 8), coalesced, strict=True):
        check.equal(f"all_reduce_coalesced {k}", t, reduce_ref("sum", torch.float64, k,
                                                               list(range(size))))
    for root in range(size):
        t = value(me, n, torch.bfloat16)
        dist.broadcast(t, src=ranks[root], group=group)
        check.equal(f"broadcast from {root}", t, value(root, n, torch.bfloat16))
        t = value(me, n, torch.int32)
        dist.reduce(t, dst=ranks[root], op=dist.ReduceOp.MAX, group=group)
        want = reduce_ref("max", torch.int32, n, list(range(size))) if me == root else value(
            me, n, torch.int32)
        check.equal(f"reduce to {root}", t, want)
    everyone = torch.stack([value(r, n, torch.float16) for r in range(size)])
    gathered = [torch.empty(n, dtype=torch.float16) for _ in range(size)]
    dist.all_gather(gathered, value(me, n, torch.float16), group=group)
    check.equal("all_gather list", torch.stack(gathered), everyone)
    # all_gather_coalesced: one output list per rank, each shaped like the inputs.
    shapes = [(2, 3), (0,), (5,)]
    lists = [[torch.full(shape, -1.0) for shape in shapes] for _ in range(size)]
    dist.all_gather_coalesced(lists, [value(me, math.prod(shape), torch.float32, salt=j)
                                      .view(shape) for j, shape in enumerate(shapes)],
                              group=group)
    for r in range(size):
        for j, shape in enumerate(shapes):
            check.equal(f"all_gather_coalesced rank {r} tensor {j}", lists[r][j],
                        value(r, math.prod(shape), torch.float32, salt=j).view(shape))
    # Sparse COO: summed as gloo sums them (indices and values gathered, coalesced).
    rows = torch.tensor([[me % 3, (me + 1) % 5, 4]])
    sparse = torch.sparse_coo_tensor(rows, value(me, 6, torch.float32).view(3, 2), (5, 2))
    dense_sum = sum(torch.sparse_coo_tensor(torch.tensor([[r % 3, (r + 1) % 5, 4]]),
                                            value(r, 6, torch.float32).view(3, 2),
                                            (5, 2)).to_dense() for r in range(size))
    dist.all_reduce(sparse, group=group)
    check.equal("all_reduce sparse", sparse.to_dense(), dense_sum)
    # A bare ReduceOp where torch's options object usually goes (torchft passes one).
    t = value(me, n, torch.float32)
    work = pg.allreduce([t], dist.ReduceOp.MAX)
    work.wait()
    check.equal("allreduce with a bare ReduceOp", t,
                reduce_ref("max", torch.float32, n, list(range(size))))
    flat = torch.empty(size * n, dtype=torch.float16)
    dist.all_gather_into_tensor(flat, value(me, n, torch.float16), group=group)
    check.equal("all_gather_into_tensor", flat, everyone.reshape(-1))
    rows = torch.empty(size, n, dtype=torch.float16)
    dist.all_gather_into_tensor(rows, value(me, n, torch.float16), group=group)
    check.equal("all_gather_into_tensor stacked", rows, everyone)
    chunks = [value(me, n, torch.float32, salt=j) for j in range(size)]
    out = torch.empty(n, dtype=torch.float32)
    dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=group)
    want = sum(value(r, n, torch.float32, salt=me).double() for r in range(size)).float()
    check.equal("reduce_scatter list", out, want)
    out = torch.empty(n, dtype=torch.float32)
    dist.reduce_scatter_tensor(out, torch.cat(chunks), op=dist.ReduceOp.AVG, group=group)
    check.equal("reduce_scatter_tensor avg", out, (want.double() / size).float())
    # all_to_all_single, even and uneven splits.
    send = torch.cat([value(me, 4, torch.int64, salt=10 * j) for j in range(size)])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    check.equal("all_to_all_single", recv,
                torch.cat([value(r, 4, torch.int64, salt=10 * me) for r in range(size)]))

    def split(src: int, dst: int) -> int:
        return (src + 2 * dst) % 3 + 1

    send = torch.cat([value(me, split(me, j) * 2, torch.float64, salt=j).view(-1, 2)
                      for j in range(size)])
    recv = torch.empty(sum(split(r, me) for r in range(size)), 2, dtype=torch.float64)
    dist.all_to_all_single(recv, send, [split(r, me) for r in range(size)],
                           [split(me, j) for j in range(size)], group=group)
    check.equal("all_to_all_single uneven", recv, torch.cat(
        [value(r, split(r, me) * 2, torch.float64, salt=me).view(-1, 2) for r in range(size)]))
    outs = [torch.empty(split(r, me), dtype=torch.int32) for r in range(size)]
    dist.all_to_all(outs, [value(me, split(me, j), torch.int32, salt=j) for j in range(size)],
                    group=group)
    for r in range(size):
        check.equal(f"all_to_all list from {r}", outs[r],
                    value(r, split(r, me), torch.int32, salt=me))
    root = size - 1
    target = [torch.empty(n, dtype=torch.uint8) for _ in range(size)] if me == root else None
    dist.gather(value(me, n, torch.uint8), target, dst=ranks[root], group=group)
    if target is not None:
        check.equal("gather", torch.stack(target),
                    torch.stack([value(r, n, torch.uint8) for r in range(size)]))
    out = torch.empty(n, dtype=torch.int8)
    pieces = [value(root, n, torch.int8, salt=j) for j in range(size)] if me == root else None
    dist.scatter(out, pieces, src=ranks[root], group=group)
    check.equal("scatter", out, value(root, n, torch.int8, salt=me))
    dist.barrier(group=group)
    check.count += 1
    if size > 1:
        p2p(check, group, ranks)
    # Clear errors, and the group keeps working after them.
    check.raises("premul_sum", ValueError, lambda: dist.all_reduce(
        torch.ones(3), op=dist._make_nccl_premul_sum(2.0), group=group), "PREMUL_SUM")
    check.raises("int16", ValueError, lambda: dist.all_reduce(
        torch.ones(3, dtype=torch.int16), group=group), "int16")
    check.raises("avg of ints", ValueError, lambda: dist.all_reduce(
        torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.AVG, group=group), "avg")
    check.raises("band of floats", ValueError, lambda: dist.all_reduce(
        torch.ones(3), op=dist.ReduceOp.BAND, group=group), "band")
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    check.equal("after the errors", t, torch.full((3,), float(size)))
    return check.count


def reduce_ref_of(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    wide = torch.stack([p.double() for p in parts])
    return wide.sum(0) if op == "sum" else wide.max(0).values


def p2p(check: Checker, group: Any, ranks: list[int]) -> None:
    """send/recv, isend/irecv and batch_isend_irecv around a ring, two tags."""
    me, size = ranks.index(RANK), len(ranks)
    right, left = ranks[(me + 1) % size], ranks[(me - 1) % size]
    got = torch.empty(5, dtype=torch.float64)
    if me % 2 == 0:
        dist.send(value(me, 5, torch.float64), dst=right, group=group)
        dist.recv(got, src=left, group=group)
    else:
        dist.recv(got, src=left, group=group)
        dist.send(value(me, 5, torch.float64), dst=right, group=group)
    check.equal("send/recv", got, value((me - 1) % size, 5, torch.float64))
    tagged = [torch.empty(3, dtype=torch.int64) for _ in range(2)]
    reqs = [dist.irecv(tagged[1], src=left, group=group, tag=7),
            dist.irecv(tagged[0], src=left, group=group, tag=0),
            dist.isend(value(me, 3, torch.int64, salt=1), dst=right, group=group, tag=0),
            dist.isend(value(me, 3, torch.int64, salt=2), dst=right, group=group, tag=7)]
    for req in reqs:
        assert req is not None
        req.wait()
    check.equal("tag 0", tagged[0], value((me - 1) % size, 3, torch.int64, salt=1))
    check.equal("tag 7", tagged[1], value((me - 1) % size, 3, torch.int64, salt=2))
    got = torch.empty(4, dtype=torch.bfloat16)
    ops = [dist.P2POp(dist.isend, value(me, 4, torch.bfloat16), right, group),
           dist.P2POp(dist.irecv, got, left, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    check.equal("batch_isend_irecv", got, value((me - 1) % size, 4, torch.bfloat16))
    # A small send is over before its receive is posted (as gloo's): every rank sends
    # first (a ring of blocking sends would wait for ever), and may change its
    # tensor at once; the receiver gets what was sent.
    mine = value(me, 7, torch.float32, salt=9)
    dist.send(mine, dst=right, group=group, tag=9)
    mine.fill_(-1.0)
    got = torch.empty(7, dtype=torch.float32)
    dist.recv(got, src=left, group=group, tag=9)
    check.equal("eager send", got, value((me - 1) % size, 7, torch.float32, salt=9))
    any_source(check, group, ranks)


def any_source(check: Checker, group: Any, ranks: list[int]) -> None:
    """recv without src: each message is taken once, from whoever sent it, and a
    receive naming its sender and one from any source share the order per sender."""
    me, size = ranks.index(RANK), len(ranks)
    if me == 1:  # the first by its sender's name, the second from any source
        for salt in (5, 6):
            dist.send(value(me, 6, torch.float32, salt=salt), dst=ranks[0], group=group, tag=4)
    if me != 0:
        dist.send(value(me, 6, torch.float32, salt=1), dst=ranks[0], group=group, tag=3)
        dist.send(value(me, 6, torch.float32, salt=2), dst=ranks[0], group=group, tag=3)
        return
    got = torch.empty(6, dtype=torch.float32)
    dist.recv(got, src=ranks[1], group=group, tag=4)
    check.equal("recv naming its sender", got, value(1, 6, torch.float32, salt=5))
    sender = dist.recv(got, group=group, tag=4)
    check.equal(f"then recv from any source (rank {sender})", got,
                value(1, 6, torch.float32, salt=6))
    senders = []
    for k in range(2 * (size - 1)):
        got = torch.empty(6, dtype=torch.float32)
        if k % 2:
            work = dist.irecv(got, group=group, tag=3)
            assert work is not None
            work.wait()
            sender = ranks[work._source_rank()]
        else:
            sender = dist.recv(got, group=group, tag=3)
        nth = senders.count(sender) + 1
        senders.append(sender)
        check.equal(f"recv from any source, message {nth} of rank {sender}", got,
                    value(ranks.index(sender), 6, torch.float32, salt=nth))
    if sorted(senders) != sorted(ranks[1:] * 2):
        raise AssertionError(f"recv from any source: senders {senders}, want each of "
                             f"{ranks[1:]} twice")


def groups() -> int:
    """new_group of everyone, of one rank, disjoint halves; each runs the primitives."""
    total = 0
    everyone = dist.new_group(list(range(WORLD)))
    total += primitives(everyone)
    singles = [dist.new_group([r]) for r in range(WORLD)]
    total += primitives(singles[RANK], [RANK])
    if WORLD >= 2:
        evens, odds = list(range(0, WORLD, 2)), list(range(1, WORLD, 2))
        halves = [dist.new_group(evens), dist.new_group(odds)]
        mine = evens if RANK % 2 == 0 else odds
        total += primitives(halves[RANK % 2], mine)
    return total


def functional() -> int:
    """torch's functional collectives and DeviceMesh over gradsync."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    check = Checker("functional")
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    n = 12
    mine = value(RANK, n, torch.float32)
    check.equal("all_reduce", funcol.all_reduce(mine, "sum", mesh).wait(),
                reduce_ref("sum", torch.float32, n, list(range(WORLD))))
    everyone = torch.cat([value(r, n, torch.float32) for r in range(WORLD)])
    check.equal("all_gather_tensor", funcol.all_gather_tensor(mine, 0, mesh).wait(), everyone)
    chunks = torch.cat([value(RANK, n, torch.float32, salt=j) for j in range(WORLD)])
    check.equal("reduce_scatter_tensor",
                funcol.reduce_scatter_tensor(chunks, "sum", 0, mesh).wait(),
                sum(value(r, n, torch.float32, salt=RANK).double()
                    for r in range(WORLD)).float())
    check.equal("all_to_all_single",
                funcol.all_to_all_single(chunks, None, None, mesh).wait(),
                torch.cat([value(r, n, torch.float32, salt=RANK) for r in range(WORLD)]))
    if WORLD % 2 == 0 and WORLD >= 2:
        grid = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("rep", "shard"))
        row = grid["shard"].get_group()
        row_ranks = dist.get_process_group_ranks(row)
        got = funcol.all_reduce(mine, "max", grid["shard"]).wait()
        check.equal("sub-mesh all_reduce", got, reduce_ref("max", torch.float32, n, row_ranks))
        assert row_ranks == [r for r in range(WORLD) if r // (WORLD // 2) == RANK // (WORLD // 2)]
    return check.count


# -- training: torch's DDP and FSDP2 against one process --------------------------------


def reference(dtype: torch.dtype, micros: int = 1, spare: bool = False) -> torch.nn.Module:
    model = make_net(1000, dtype, spare)
    opt = make_optimizer(model.parameters(), "sgd")
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(micros):
            x, y = batch(step, micro, WORLD, dtype)
            (loss_fn(model, x, y) / micros).backward()
        opt.step()
    return model


def ddp(hook: str = "", micros: int = 1, spare: bool = False, **ddp_args: Any
        ) -> dict[str, Any]:
    """torch DDP on gradsync; rank r starts from different weights (the broadcast fixes it).

    With `spare`, the model has parameters no forward uses.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    model = make_net(1000 + 7 * RANK, torch.float64, spare)
    wrapped = torch.nn.parallel.DistributedDataParallel(model, **ddp_args)
    if hook == "fp16":
        wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                            start_powerSGD_iter=2, use_error_feedback=True)
        wrapped.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = make_optimizer(wrapped.parameters(), "sgd")
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(micros):
            x, y = batch(step, micro, WORLD, torch.float64)

            def backward(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
                (loss_fn(wrapped, shard(x, RANK), shard(y, RANK)) / micros).backward()

            if micro < micros - 1:
                with wrapped.no_sync():
                    backward()
            else:
                backward()
        opt.step()
    ref = reference(torch.float64, micros, spare)
    return {"err": max_error(model, ref), "digest": digest(model)}


def fsdp(mixed: bool = False, hsdp: bool = False, daemon_memory: bool = False
         ) -> dict[str, Any]:
    """FSDP2: fully_shard per layer and the root; compare the full state dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = torch.float32
    model = make_net(1000, dtype)
    kwargs: dict[str, Any] = {}
    if mixed:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    if hsdp:
        kwargs["mesh"] = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("rep", "shard"))
    for layer in [*model.body, model.head]:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    pool = None
    if daemon_memory:
        from gradsync.client.torch.fsdp import DaemonMemoryPool, use_daemon_memory

        pool = DaemonMemoryPool()
        assert use_daemon_memory(model, pool) == 5  # four Linear layers and the root
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, 0, WORLD, dtype)
        loss_fn(model, shard(x, RANK), shard(y, RANK)).backward()
        opt.step()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    ref = make_net(1000, dtype)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        ref_opt.zero_grad()
        x, y = batch(step, 0, WORLD, dtype)
        loss_fn(ref, x, y).backward()
        ref_opt.step()
    err = max(float((full[name].double() - p.detach().double()).abs().max())
              for name, p in ref.named_parameters())
    flat = torch.cat([full[name].reshape(-1) for name, _ in ref.named_parameters()])
    if pool is not None:  # every step's buffers came from daemon memory, reused
        assert pool.handed_out >= 2 * 5 * STEPS and pool.reused > 0, vars(pool)
    return {"err": err, "digest": digest(torch.nn.ParameterList([torch.nn.Parameter(flat)]))}


def sharing() -> int:
    """Tensors that come back are moved to shared memory the daemon maps; aliases hold."""
    import numpy as np

    from gradsync.client.ping import query

    check = Checker("sharing")
    n = 1 << 16  # 256 KiB of float32

    def thrice(t: torch.Tensor) -> None:
        for step in range(3):
            t.fill_(RANK + step)
            dist.all_reduce(t)
            check.equal(f"step {step}", t, torch.full((n,), float(sum(range(WORLD)) +
                                                          WORLD * step)))

    reused = torch.empty(n)
    view = reused[10:20]
    thrice(reused)
    enabled = os.environ.get("GRADSYNC_TORCH_SHARE", "1") != "0"
    assert reused.untyped_storage().is_shared() == enabled
    if enabled:
        assert int(query(os.environ["GRADSYNC_DAEMON"], 5.0)["shm_attached"]) >= 4 * n
    view.fill_(-1.0)  # a view made before the move still is the tensor's memory
    check.equal("view follows", reused[10:20], torch.full((10,), -1.0))
    array = np.zeros(n, dtype=np.float32)
    wrapped = torch.from_numpy(array)
    thrice(wrapped)
    array[0] = 42.0  # from_numpy memory never moves: the array still aliases the tensor
    assert float(wrapped[0]) == 42.0 and not wrapped.untyped_storage().is_shared()
    exported = torch.zeros(n)
    alias = exported.numpy()
    thrice(exported)
    alias[1] = 7.0
    assert float(exported[1]) == 7.0 and not exported.untyped_storage().is_shared()
    for dtype, op in ((torch.bfloat16, "max"), (torch.bool, "max"), (torch.int64, "sum")):
        shared = gt.empty(n, dtype=dtype)  # daemon memory in any dtype
        assert shared.dtype == dtype and shared.shape == (n,), shared
        shared.copy_(value(RANK, n, torch.int64).remainder(2).to(dtype))
        dist.all_reduce(shared, op=TORCH_OPS[op])
        parts = [value(r, n, torch.int64).remainder(2).to(dtype) for r in range(WORLD)]
        want = (torch.stack(parts).any(0) if dtype == torch.bool
                else reduce_ref_of(parts, op).to(dtype))
        check.equal(f"empty() {dtype}", shared, want)
    small = torch.zeros(16)  # passing through the backend leaves a tensor resizable
    dist.all_reduce(small)
    small.resize_(1 << 12)
    check.equal("resized", small[:16], torch.zeros(16))
    return check.count


def errors() -> int:
    """Failures are DistBackendErrors naming who and what; the group's timeout is the deadline."""
    import time

    check = Checker("errors")
    others = [r for r in range(WORLD) if r != RANK]
    check.raises("mismatch", dist.DistBackendError,
                 lambda: dist.all_reduce(torch.ones(10 + RANK)), f"rank {others[0]} sent")
    quick = dist.new_group(list(range(WORLD)), timeout=datetime.timedelta(seconds=3))
    if RANK == 0:  # alone in this group's collective: its deadline is the group's 3 s
        started = time.monotonic()
        check.raises("timeout", dist.DistBackendError,
                     lambda: dist.all_reduce(torch.ones(3), group=quick), "timed out after 3s")
        # gloo's words too, which torch's own tests look for.
        check.raises("timeout in gloo's words", dist.DistBackendError,
                     lambda: dist.barrier(group=quick), " Timed out waiting: ")
        assert time.monotonic() - started < 30, time.monotonic() - started
    t = torch.ones(4)
    dist.all_reduce(t)  # the default group works on after both
    check.equal("after", t, torch.full((4,), float(WORLD)))
    return check.count


def on_page() -> int:
    """Small allreduces end on the fast page before allreduce() returns; a late peer
    never holds the caller up until it comes, and async order dependencies hold."""
    import time

    from gradsync.client.cli.stats import fetch_snapshot

    check = Checker("on_page")
    job = dist.distributed_c10d._get_default_group().gradsync_job  # type: ignore[attr-defined]

    def on_page_so_far() -> int:
        stats = fetch_snapshot(os.environ["GRADSYNC_DAEMON"] + ".stats", 5.0)
        done = stats["jobs"][job]["done"]
        return int(done.get("allreduce/fast", 0))

    want = float(sum(range(WORLD)))
    before, at_once = on_page_so_far(), 0
    for _ in range(50):
        t = torch.full((1024,), float(RANK))
        dist.barrier()
        work = dist.all_reduce(t, async_op=True)
        at_once += work.is_completed()
        work.wait()
        check.equal("in step", t, torch.full((1024,), want))
    # In step, most end on the page (a loaded machine may hold a rank up past the wait).
    assert on_page_so_far() > before and at_once > 0, "none of 50 ended on the fast page"
    late = torch.full((1024,), float(RANK))
    dist.barrier()
    if RANK == WORLD - 1:
        time.sleep(0.5)  # comes late: the others' allreduce must not wait for it
    work = dist.all_reduce(late, async_op=True)
    if RANK != WORLD - 1:
        assert not work.is_completed(), "the allreduce waited for its late peer"
    work.wait()
    check.equal("late peer", late, torch.full((1024,), want))
    # Rank 0's async allreduce comes before the send its peer waits for to issue its own.
    ordered, token = torch.full((64,), float(RANK)), torch.zeros(1)
    if RANK == 0:
        work = dist.all_reduce(ordered, async_op=True)
        for peer in range(1, WORLD):
            dist.send(token, peer)
        work.wait()
    else:
        dist.recv(token, 0)
        dist.all_reduce(ordered)
    check.equal("ordered", ordered, torch.full((64,), want))
    on_page_reused_memory(check)
    return check.count


def on_page_reused_memory(check: Checker) -> None:
    """The page's kept view of a tensor is right for whatever lies at its address
    next: the same tensor with new values, another shape, dtype or op over the
    same bytes, a storage moved by a resize, and more tensors than it keeps."""
    from gradsync.client.torch.fast_path import VIEWS_KEPT

    t = torch.zeros(1024)
    for step in range(3):
        t.fill_(float(RANK + step))
        dist.all_reduce(t)
        check.equal(f"same tensor {step}", t, torch.full((1024,), float(
            sum(r + step for r in range(WORLD)))))
    t.fill_(float(RANK + 1))  # the same tensor object again, with another op
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    check.equal("same tensor, other op", t, torch.full((1024,), float(WORLD)))
    dist.all_reduce(t.fill_(1.0))  # then, after the same call again,
    t.resize_(512).fill_(float(RANK))  # shrunk in place: same address, fewer elements
    guard = t.untyped_storage()
    tail = torch.tensor([], dtype=t.dtype).set_(guard, 512, (512,)).fill_(-7.0)
    dist.all_reduce(t)
    check.equal("same tensor, shrunk", t, torch.full((512,), float(sum(range(WORLD)))))
    check.equal("past the shrunk end", tail, torch.full((512,), -7.0))
    t.resize_(1024)
    square = t.view(32, 32).fill_(float(RANK + 2))
    dist.all_reduce(square, op=dist.ReduceOp.MAX)
    check.equal("other shape and op", square, torch.full((32, 32), float(WORLD + 1)))
    ints = t.view(torch.int32).fill_(0x10000000 + RANK)  # summed as floats: another sum
    dist.all_reduce(ints)
    check.equal("other dtype", ints, torch.full((1024,), 0x10000000 * WORLD + sum(range(
        WORLD)), dtype=torch.int32))
    t.untyped_storage().resize_(8 * 4096)  # the storage moves; its old bytes are freed
    t.set_(t.untyped_storage(), 0, (1024,)).fill_(float(RANK))
    others = [torch.full((1024,), -1.0) for _ in range(8)]  # may land where t was
    dist.all_reduce(t)
    check.equal("after a resize", t, torch.full((1024,), float(sum(range(WORLD)))))
    assert all(bool((o == -1.0).all()) for o in others), "a freed view was written"
    many = [torch.full((16 + i,), float(RANK * i)) for i in range(VIEWS_KEPT * 2 + 1)]
    for _ in range(2):
        for i, m in enumerate(many):
            m.fill_(float(RANK * i))
            dist.all_reduce(m)
    for i, m in enumerate(many):
        check.equal(f"many {i}", m, torch.full((16 + i,), float(i * sum(range(WORLD)))))


def smoke() -> int:
    """One allreduce and a barrier: enough to show a launcher or init_method works."""
    check = Checker("smoke")
    t = value(RANK, 9, torch.float32)
    dist.all_reduce(t)
    check.equal("all_reduce", t, reduce_ref("sum", torch.float32, 9, list(range(WORLD))))
    dist.barrier()
    return check.count


SCENARIOS: dict[str, Callable[[], Any]] = {
    "smoke": smoke,
    "on_page": on_page,
    "sharing": sharing,
    "errors": errors,
    "primitives": primitives,
    "groups": groups,
    "functional": functional,
    "ddp": lambda: ddp(bucket_cap_mb=0.002),
    "ddp_no_sync": lambda: ddp(micros=2, bucket_cap_mb=0.002),
    "ddp_unused": lambda: ddp(spare=True, find_unused_parameters=True, bucket_cap_mb=0.002),
    "ddp_fp16": lambda: ddp("fp16", bucket_cap_mb=0.002),
    "ddp_powersgd": lambda: ddp("powersgd"),
    "fsdp": fsdp,
    "fsdp_bf16": lambda: fsdp(mixed=True),
    "hsdp": lambda: fsdp(hsdp=True),
    "fsdp_daemon_memory": lambda: fsdp(daemon_memory=True),
}


def emit(record: dict[str, Any]) -> None:
    """One JSON line in one write: ranks sharing a launcher's stdout do not interleave."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def main() -> None:
    init = os.environ.get("GRADSYNC_TEST_INIT", "env://")
    timeout = datetime.timedelta(seconds=float(os.environ.get("GRADSYNC_TEST_TIMEOUT_S", "60")))
    dist.init_process_group("gradsync", init_method=init, rank=RANK, world_size=WORLD,
                            timeout=timeout)
    assert dist.get_backend() == "gradsync"
    world = dist.group.WORLD
    assert isinstance(world, gt.ProcessGroupGradsync), world
    for name in sys.argv[1].split(","):
        outcome = SCENARIOS[name]()
        record = outcome if isinstance(outcome, dict) else {"checks": outcome}
        emit({"scenario": name, "rank": RANK, **record})
    dist.destroy_process_group()
    assert world.closed, "destroy_process_group did not shut the gradsync group down"
    left = [t.name for t in threading.enumerate() if t.name.startswith("gradsync-")]
    assert not left, f"threads still running after destroy_process_group: {left}"


if __name__ == "__main__":
    main()
