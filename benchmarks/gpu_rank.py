"""One rank of benchmarks.gpu_check: a GPU check or timing, its result as one JSON line.

    python -m benchmarks.gpu_rank ROLE --daemon ipc://PATH --job NAME --rank R --world N [...]

Roles:

- `allreduce`: every op × dtype × size on every buffer kind, against a float64
  host reference.  Kinds: `empty` (a slab from `Client.empty(device=0)`, a
  cupy array; for bfloat16 a torch tensor via `like="torch"`), `cupy` and
  `torch` (ordinary device arrays on a side stream, staged by the client
  through its scratch slab; torch ones with `async_op=True`), `numpy` and
  `host-empty` (the host paths, as a control).  Each rank derives every rank's
  input from the seed, so each computes the reference on its own.
- `collectives`: broadcast, reduce (sum), all_gather, reduce_scatter (sum),
  gather, scatter and all_to_all, every root of the rooted ones, × dtype ×
  chunk (elements per rank) on every buffer kind, against a host reference
  from every rank's input: copies exactly, sums within the dtype's rounding
  (a reduce's other ranks, and a gather's, must find their buffer unchanged;
  outputs start out as SENTINEL, so an element never written shows).  Input
  and output `empty` buffers are two slabs per dtype, reused.
- `ddp`: gradsync's `DistributedDataParallel` on a CUDA model, a few SGD
  steps, against one process training on the concatenated batch; reports
  `unsupported` when DDP refuses CUDA modules.
- `fail`: the last rank SIGKILLs itself, after submitting an all_reduce or
  before; the others report the error they got and how long it took.
- `copy` (world 1): device copy time (`cupy.copyto`), the hand-over (an
  ordinary cupy array's all_reduce: two copies through the scratch slab) and
  an `empty()` slab's all_reduce (no copy: the round trip).
- `reduce`: timed all_reduce (sum) of float32 `empty(device=0)` slabs.

Nothing waits on the host inside the client: results are read on the stream
that submitted them (after synchronising it).  `--device host` runs the same
code on host buffers, so the plumbing can be exercised without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradsync.client import (
    Client,
    CollectiveTimeoutError,
    DaemonUnavailableError,
    GradsyncError,
    InvalidArgumentError,
    JobError,
    MismatchError,
    RankLostError,
)
from gradsync.protocol.dtypes import DTYPES as WIRE_DTYPES

OPS = ("sum", "avg", "min", "max", "prod")
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")
FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})
#: Gap between 1.0 and the next number of each float dtype (twice its unit roundoff).
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}
DEVICE_KINDS = ("empty", "cupy", "torch", "numpy")
HOST_KINDS = ("host-empty", "numpy")
#: Every other size is reduced at this element offset inside its slab.
OFFSET = 3
#: After one of these the job's state is unknown: the matrix stops there.
FATAL = (CollectiveTimeoutError, DaemonUnavailableError, JobError, MismatchError, RankLostError)
MAX_ERRORS_IN_A_ROW = 5


# -- the all_reduce matrix -------------------------------------------------------------


def numpy_dtype(name: str) -> np.dtype[Any]:
    """bfloat16 loads ml_dtypes (half a second of CPU), so only the phases that use it do."""
    return WIRE_DTYPES[name]


def pairs(ops: Sequence[str], dtypes: Sequence[str]) -> Iterator[tuple[str, str]]:
    """(op, dtype) for these ops and dtypes; avg for floats only."""
    for op in ops:
        for dtype in dtypes:
            if op != "avg" or dtype in FLOATS:
                yield op, dtype


def sample(rng: np.random.Generator, op: str, dtype: str, count: int) -> np.ndarray:
    """One rank's input.  Products stay small (no overflow, even with 4 ranks); integer
    sums span the whole dtype, so they wrap around as the dtype does; float sums lie in
    [-1, 1], float min/max spread wider (still inside float16's range)."""
    target = numpy_dtype(dtype)
    if dtype in FLOATS:
        if op == "prod":
            magnitude = rng.uniform(0.5, 2.0, count)
            values = np.where(rng.random(count) < 0.5, -magnitude, magnitude)
        elif op in ("min", "max"):
            values = rng.normal(0.0, 100.0, count)
        else:
            values = rng.uniform(-1.0, 1.0, count)
        return values.astype(target)
    info = np.iinfo(target)
    if op == "prod":
        choices = np.array([1, 2, 3] if info.min == 0 else [-2, -1, 1, 2])
        return rng.choice(choices, count).astype(target)
    return rng.integers(info.min, info.max, count, dtype=target, endpoint=True)


def inputs_of(seed: int, op: str, dtype: str, count: int, world: int) -> list[np.ndarray]:
    """Every rank's input of one case (each rank computes all of them, for the reference)."""
    return [
        sample(np.random.default_rng([seed, OPS.index(op), DTYPES.index(dtype), count, rank]),
               op, dtype, count)
        for rank in range(world)
    ]


@dataclass
class Expected:
    """The right result of one case: exact (tolerance None), or within a tolerance."""

    reference: np.ndarray  # integers: in the dtype itself; floats: float64
    tolerance: np.ndarray | None


def expected(inputs: Sequence[np.ndarray], op: str, dtype: str) -> Expected:
    """The reference, computed on the host from every rank's input."""
    world = len(inputs)
    if dtype not in FLOATS:  # int64 arithmetic, then a cast that wraps like the dtype
        wide = np.stack([x.astype(np.int64) for x in inputs])
        combine = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op]
        return Expected(combine(wide, axis=0).astype(numpy_dtype(dtype)), None)
    wide = np.stack([x.astype(np.float64) for x in inputs])
    eps = EPS[dtype]
    if op == "min":
        return Expected(wide.min(axis=0), None)
    if op == "max":
        return Expected(wide.max(axis=0), None)
    if op == "prod":
        reference = wide.prod(axis=0)
        return Expected(reference, (world + 1) * eps * np.abs(reference))
    # Any summation order errs by less than (n-1)·u·Σ|x|, u = eps/2; then one rounding.
    reference, bound = wide.sum(axis=0), np.abs(wide).sum(axis=0)
    if op == "avg":
        reference, bound = reference / world, bound / world
    return Expected(reference, world * eps * bound + eps * np.abs(reference))


def judge(got: np.ndarray, want: Expected) -> dict[str, Any]:
    """ok, how many elements are wrong and (floats) the largest error."""
    if want.tolerance is None and got.dtype == want.reference.dtype:
        wrong = got != want.reference
        return {"ok": not wrong.any(), "wrong": int(wrong.sum())}
    error = np.abs(got.astype(np.float64) - want.reference)
    tolerance = 0.0 if want.tolerance is None else want.tolerance
    wrong = ~(error <= tolerance)  # NaN counts as wrong
    return {"ok": not wrong.any(), "wrong": int(wrong.sum()),
            "max_err": float(error.max()) if error.size else 0.0}


def to_torch(values: np.ndarray) -> Any:
    """A CPU tensor over `values` (bfloat16 through its bit pattern)."""
    import torch

    if values.dtype.name == "bfloat16":  # only ml_dtypes makes one
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values)


def from_torch(tensor: Any) -> np.ndarray:
    import torch

    if tensor.dtype == torch.bfloat16:
        return np.asarray(tensor.view(torch.int16).numpy()).view(WIRE_DTYPES["bfloat16"])
    return np.asarray(tensor.numpy())


class Buffers:
    """One rank's arrays: one `empty()` slab per dtype and place, reused by every case
    (as DDP reuses its buckets), and the side streams of the ordinary device arrays."""

    def __init__(self, client: Client, capacity: int) -> None:
        self.client = client
        self.capacity = capacity
        self._slabs: dict[tuple[str, str, str], Any] = {}
        self._streams: dict[str, Any] = {}

    def slab(self, dtype: str, place: str, offset: int, count: int, which: str = "") -> Any:
        """`count` elements at `offset` of this dtype's slab on the host or device 0
        (`which` names one of several slabs of a dtype: a collective's input and output)."""
        key = (dtype, place, which)
        if key not in self._slabs:
            kind = numpy_dtype(dtype)
            if place == "host":
                self._slabs[key] = self.client.empty(self.capacity, kind)
            elif dtype == "bfloat16":  # cupy has no bfloat16
                self._slabs[key] = self.client.empty(self.capacity, kind, device=0, like="torch")
            else:
                self._slabs[key] = self.client.empty(self.capacity, kind, device=0)
        return self._slabs[key][offset : offset + count]

    def stream(self, library: str) -> Any:
        """A side stream (not the default one) of cupy or torch on device 0."""
        if library not in self._streams:
            if library == "cupy":
                import cupy

                self._streams[library] = cupy.cuda.Stream(non_blocking=True)
            else:
                import torch

                self._streams[library] = torch.cuda.Stream(device=0)
        return self._streams[library]


def through_cupy(client: Client, array: Any, values: np.ndarray, op: str, stream: Any) -> Any:
    """Fill, all_reduce and read back on one cupy stream (None: the current one); a new
    array from cupy's pool when `array` is None."""
    import cupy

    with stream if stream is not None else contextlib.nullcontext():
        if array is None:
            array = cupy.asarray(values)
        else:
            array[...] = cupy.asarray(values)
        client.all_reduce(array, op)
        # The client made this stream wait for the daemon: synchronising it is enough.
        cupy.cuda.get_current_stream().synchronize()
        return cupy.asnumpy(array)


def through_torch(
    client: Client, tensor: Any, values: np.ndarray, op: str, stream: Any, async_op: bool
) -> np.ndarray:
    """The same with torch (None stream: the current one); a new tensor when None."""
    import torch

    with torch.cuda.stream(stream):  # a no-op for None
        source = to_torch(values)
        if tensor is None:
            tensor = source.to("cuda:0")
        else:
            tensor.copy_(source)
        if async_op:
            work = client.all_reduce(tensor, op, async_op=True)
            assert work is not None
            work.wait()
        else:
            client.all_reduce(tensor, op)
        return from_torch(tensor.cpu())  # .cpu() runs on the current stream and waits


def applies(kind: str, dtype: str) -> bool:
    return not (kind == "cupy" and dtype == "bfloat16")  # cupy has no bfloat16


def run_case(
    buffers: Buffers, kind: str, dtype: str, values: np.ndarray, op: str, offset: int
) -> np.ndarray:
    """All-reduce this rank's `values` in a buffer of `kind`; the result, on the host."""
    client, count = buffers.client, values.size
    if kind == "numpy":
        client.all_reduce(values, op)
        return values
    if kind == "host-empty":
        array = buffers.slab(dtype, "host", offset, count)
        array[...] = values
        client.all_reduce(array, op)
        return np.array(array)
    if kind == "empty" and dtype == "bfloat16":
        tensor = buffers.slab(dtype, "device", offset, count)
        return through_torch(client, tensor, values, op, None, async_op=False)
    if kind == "empty":
        array = buffers.slab(dtype, "device", offset, count)
        return np.asarray(through_cupy(client, array, values, op, None))
    if kind == "cupy":
        return np.asarray(through_cupy(client, None, values, op, buffers.stream("cupy")))
    if kind == "torch":
        return through_torch(client, None, values, op, buffers.stream("torch"), async_op=True)
    raise ValueError(f"unknown buffer kind {kind!r}")


def allreduce_case(buffers: Buffers, kind: str, dtype: str, values: np.ndarray, op: str,
                   offset: int, want: Expected) -> dict[str, Any]:
    return judge(run_case(buffers, kind, dtype, values.copy(), op, offset), want)


class CaseLog:
    """The cases of a matrix role, each recorded (a failing one with its error).  After
    an error that leaves the job's state unknown, or MAX_ERRORS_IN_A_ROW, the rest are
    recorded as not run."""

    def __init__(self) -> None:
        self.cases: list[dict[str, Any]] = []
        self.stopped: str | None = None
        self.errors_in_a_row = 0

    def run(self, case: dict[str, Any], attempt: Callable[..., dict[str, Any]],
            *args: Any) -> None:
        """Record `case` (kind, op, dtype, count) with what `attempt(*args)` found (ok,
        wrong, ...), or its error."""
        if self.stopped is not None:
            self.cases.append({**case, "ok": False, "error": f"not run: {self.stopped}"})
            return
        try:
            case.update(attempt(*args))
            self.errors_in_a_row = 0
        except Exception as exc:  # recorded; the matrix goes on unless the job broke
            self.errors_in_a_row += 1
            case.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
            if isinstance(exc, FATAL) or self.errors_in_a_row >= MAX_ERRORS_IN_A_ROW:
                self.stopped = (f"stopped after {case['kind']} {case['op']} {case['dtype']}"
                                f"[{case['count']}] ({type(exc).__name__})")
        self.cases.append(case)


def allreduce_role(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    """The matrix; every case is recorded, a failing one with its error."""
    kinds, sizes = args.kinds.split(","), [int(s) for s in args.sizes.split(",")]
    buffers = Buffers(client, max(sizes) + OFFSET)
    log = CaseLog()
    started = time.monotonic()
    for op, dtype in pairs(args.ops.split(","), args.dtypes.split(",")):
        for index, count in enumerate(sizes):
            inputs = inputs_of(args.seed, op, dtype, count, client.world_size)
            want = expected(inputs, op, dtype)
            offset = OFFSET if index % 2 else 0
            for kind in (k for k in kinds if applies(k, dtype)):
                log.run({"kind": kind, "op": op, "dtype": dtype, "count": count},
                        allreduce_case, buffers, kind, dtype, inputs[client.rank], op, offset,
                        want)
    return {"cases": log.cases, "seconds": time.monotonic() - started}


# -- the other collectives --------------------------------------------------------------

COLLECTIVES = ("broadcast", "reduce", "all_gather", "reduce_scatter", "gather", "scatter",
               "all_to_all")
ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter"})
COLLECTIVE_DTYPES = ("float32", "bfloat16", "float16")
COLLECTIVE_DEVICE_KINDS = ("empty", "cupy", "torch")
#: Output buffers hold this before the collective: no input comes near it, so an
#: element the collective never wrote shows.
SENTINEL = 7.0


@dataclass
class CollectiveCase:
    """One rank's part in one collective: what it passes, and what it must find after."""

    label: str  # "reduce sum dst 1": the collective, its op and root
    input: np.ndarray | None  # this rank's input (None: it passes none)
    out_count: int | None  # elements of its output (None: it passes none)
    call: Callable[[Client, Any, Any, bool], Any]  # (client, input, output, async_op)
    result_in: str  # "input" (in place, or a gather's non-destination) or "output"
    want: Expected


def collective_inputs(seed: int, name: str, root: int | None, dtype: str, count: int,
                      world: int) -> list[np.ndarray]:
    """Every rank's input of one case: floats in [-1, 1] (so fp16/bf16 sums keep their
    precision), different on each rank (so a chunk in the wrong place shows)."""
    return [
        sample(np.random.default_rng([seed, 100 + COLLECTIVES.index(name),
                                      world if root is None else root,
                                      DTYPES.index(dtype), count, rank]),
               "sum", dtype, count)
        for rank in range(world)
    ]


def exactly(values: np.ndarray) -> Expected:
    return Expected(np.ascontiguousarray(values), None)


def plan_collective(name: str, root: int | None, dtype: str, c: int, rank: int, world: int,
                    seed: int) -> CollectiveCase:
    """This rank's buffers and the host reference of one collective with chunk `c`
    (torch.distributed's sizes: W·c where a rank gives or gets every rank's chunk)."""
    def part(array: np.ndarray, index: int) -> np.ndarray:
        return array[index * c : (index + 1) * c]

    at = 0 if root is None else root  # the root of a rooted collective

    if name == "broadcast":
        xs = collective_inputs(seed, name, root, dtype, c, world)
        return CollectiveCase(f"broadcast src {at}", xs[rank], None,
                              lambda cl, i, o, a: cl.broadcast(i, at, async_op=a),
                              "input", exactly(xs[at]))
    if name == "reduce":
        xs = collective_inputs(seed, name, root, dtype, c, world)
        want = expected(xs, "sum", dtype) if rank == at else exactly(xs[rank])
        return CollectiveCase(f"reduce sum dst {at}", xs[rank], None,
                              lambda cl, i, o, a: cl.reduce(i, at, "sum", async_op=a),
                              "input", want)
    if name == "all_gather":
        xs = collective_inputs(seed, name, root, dtype, c, world)
        return CollectiveCase("all_gather", xs[rank], world * c,
                              lambda cl, i, o, a: cl.all_gather(o, i, async_op=a),
                              "output", exactly(np.concatenate(xs)))
    if name == "reduce_scatter":
        xs = collective_inputs(seed, name, root, dtype, world * c, world)
        whole = expected(xs, "sum", dtype)
        tolerance = None if whole.tolerance is None else part(whole.tolerance, rank)
        return CollectiveCase("reduce_scatter sum", xs[rank], c,
                              lambda cl, i, o, a: cl.reduce_scatter(o, i, "sum", async_op=a),
                              "output", Expected(part(whole.reference, rank), tolerance))
    if name == "gather":
        xs = collective_inputs(seed, name, root, dtype, c, world)
        at_root = rank == at
        return CollectiveCase(f"gather dst {at}", xs[rank], world * c if at_root else None,
                              lambda cl, i, o, a: cl.gather(o, i, at, async_op=a),
                              "output" if at_root else "input",
                              exactly(np.concatenate(xs) if at_root else xs[rank]))
    if name == "scatter":
        xs = collective_inputs(seed, name, root, dtype, world * c, world)
        return CollectiveCase(f"scatter src {at}", xs[rank] if rank == at else None, c,
                              lambda cl, i, o, a: cl.scatter(o, i, at, async_op=a),
                              "output", exactly(part(xs[at], rank)))
    if name == "all_to_all":
        xs = collective_inputs(seed, name, root, dtype, world * c, world)
        return CollectiveCase("all_to_all", xs[rank], world * c,
                              lambda cl, i, o, a: cl.all_to_all(o, i, async_op=a), "output",
                              exactly(np.concatenate([part(x, rank) for x in xs])))
    raise ValueError(f"unknown collective {name!r}")


def run_collective(buffers: Buffers, kind: str, dtype: str, case: CollectiveCase,
                   offset: int) -> np.ndarray:
    """Run this rank's part of `case` in buffers of `kind` (input and output filled first,
    the output with SENTINEL); the buffer holding the result, on the host.  Device
    results are read on the stream that submitted them, after synchronising it."""
    client = buffers.client
    sentinel = np.full(case.out_count or 0, SENTINEL, numpy_dtype(dtype))

    def both(make: Callable[[str, np.ndarray], Any]) -> tuple[Any, Any]:
        return (None if case.input is None else make("in", case.input),
                None if case.out_count is None else make("out", sentinel))

    def result(arrays: tuple[Any, Any]) -> Any:
        return arrays[0] if case.result_in == "input" else arrays[1]

    if kind in ("numpy", "host-empty"):
        def on_host(which: str, values: np.ndarray) -> Any:
            if kind == "numpy":
                return values.copy()
            array = buffers.slab(dtype, "host", offset, values.size, which)
            array[...] = values
            return array

        arrays = both(on_host)
        case.call(client, *arrays, False)
        return np.array(result(arrays))
    if kind == "cupy" or (kind == "empty" and dtype != "bfloat16"):
        import cupy

        def in_cupy(which: str, values: np.ndarray) -> Any:
            if kind == "cupy":
                return cupy.asarray(values)
            array = buffers.slab(dtype, "device", offset, values.size, which)
            array[...] = cupy.asarray(values)
            return array

        stream = buffers.stream("cupy") if kind == "cupy" else None
        with stream if stream is not None else contextlib.nullcontext():
            arrays = both(in_cupy)
            case.call(client, *arrays, False)
            # The client made this stream wait for the daemon: synchronising it is enough.
            cupy.cuda.get_current_stream().synchronize()
            return np.asarray(cupy.asnumpy(result(arrays)))
    if kind in ("torch", "empty"):  # ordinary tensors on a side stream; bfloat16 slabs
        import torch

        def in_torch(which: str, values: np.ndarray) -> Any:
            source = to_torch(values)
            if kind == "torch":
                return source.to("cuda:0")
            tensor = buffers.slab(dtype, "device", offset, values.size, which)
            tensor.copy_(source)
            return tensor

        with torch.cuda.stream(buffers.stream("torch") if kind == "torch" else None):
            arrays = both(in_torch)
            if kind == "torch":
                work = case.call(client, *arrays, True)
                assert work is not None
                work.wait()
            else:
                case.call(client, *arrays, False)
            return from_torch(result(arrays).cpu())  # .cpu() runs on this stream and waits
    raise ValueError(f"unknown buffer kind {kind!r}")


def collective_case(buffers: Buffers, kind: str, dtype: str, case: CollectiveCase,
                    offset: int) -> dict[str, Any]:
    return judge(run_collective(buffers, kind, dtype, case, offset), case.want)


def collectives_role(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    """Every collective × root × dtype × chunk on every buffer kind, against the host
    reference; cases in the allreduce role's form (`op`: the collective and root)."""
    kinds, chunks = args.kinds.split(","), [int(s) for s in args.sizes.split(",")]
    world = client.world_size
    buffers = Buffers(client, world * max(chunks) + OFFSET)
    log = CaseLog()
    started = time.monotonic()
    for name in args.collectives.split(","):
        for root in range(world) if name in ROOTED else [None]:
            for dtype in args.dtypes.split(","):
                for index, chunk in enumerate(chunks):
                    case = plan_collective(name, root, dtype, chunk, client.rank, world,
                                           args.seed)
                    offset = OFFSET if index % 2 else 0
                    for kind in (k for k in kinds if applies(k, dtype)):
                        log.run({"kind": kind, "op": case.label, "dtype": dtype,
                                 "count": chunk},
                                collective_case, buffers, kind, dtype, case, offset)
    return {"cases": log.cases, "seconds": time.monotonic() - started}


# -- DDP ------------------------------------------------------------------------------

IN, HIDDEN, OUT = 16, 32, 4
PER_RANK = 6  # rows of each rank's shard
DDP_STEPS = 4
#: name → (dtype, largest allowed |parameter - one-process reference|, DDP options)
DDP_SCENARIOS: dict[str, tuple[str, float, dict[str, float]]] = {
    "float64, small buckets": ("float64", 1e-10, {"bucket_cap_mb": 0.004,
                                                  "first_bucket_mb": 0.001}),
    "float32, default buckets": ("float32", 1e-4, {}),
}


def make_net(seed: int, dtype: Any, device: str) -> Any:
    """The same weights for the same seed (built on the CPU, then moved)."""
    import torch

    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, OUT),
    )
    return net.to(device=device, dtype=dtype)


def global_batch(step: int, world: int, dtype: Any, device: str) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(world * PER_RANK, IN, generator=generator, dtype=torch.float64)
    y = torch.randn(world * PER_RANK, OUT, generator=generator, dtype=torch.float64)
    return x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)


def train(model: Any, forward: Callable[[Any], Any], world: int, rank: int | None,
          dtype: Any, device: str) -> None:
    """DDP_STEPS of plain SGD; on one shard (`rank`) or on the whole batch (None)."""
    import torch

    for step in range(DDP_STEPS):
        model.zero_grad(set_to_none=True)
        x, y = global_batch(step, world, dtype, device)
        if rank is not None:
            rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            x, y = x[rows], y[rows]
        torch.nn.functional.mse_loss(forward(x), y).backward()
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.sub_(0.1 * param.grad)


def digest(model: Any) -> str:
    """A hash of every parameter's bytes: equal on all ranks iff they hold the same model."""
    import torch

    hasher = hashlib.sha256()
    for param in model.parameters():
        hasher.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()[:16]


def ddp_role(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from gradsync.client.torch import DistributedDataParallel

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 must stay float32
    device = "cuda:0" if args.device == "cuda" else "cpu"
    rank, world = client.rank, client.world_size
    results: dict[str, Any] = {}
    for name, (dtype_name, tolerance, options) in DDP_SCENARIOS.items():
        dtype = getattr(torch, dtype_name)
        model = make_net(1000 + rank, dtype, device)  # differs per rank until DDP broadcasts
        try:
            ddp = DistributedDataParallel(model, client, **options)
        except InvalidArgumentError as exc:
            if re.search("cuda|cpu|device", str(exc), re.IGNORECASE):
                return {"unsupported": str(exc)}
            raise
        initial = digest(model)
        train(model, ddp, world, rank, dtype, device)
        reference = make_net(1000, dtype, device)
        train(reference, reference, world, None, dtype, device)
        error = max(float((a.detach().double() - b.detach().double()).abs().max())
                    for a, b in zip(model.parameters(), reference.parameters(), strict=True))
        results[name] = {"err": error, "tolerance": tolerance, "digest": digest(model),
                         "initial": initial}
        del ddp
    return {"scenarios": results}


# -- timing and failure: one place for the arrays (device 0, or the host) ----------------


class Place:
    """Where the timing and failure arrays live: device 0 (cupy), or host memory."""

    def __init__(self, device: str) -> None:
        self.on_device = device == "cuda"
        if self.on_device:
            import cupy

            self.xp: Any = cupy
        else:
            self.xp = np

    def empty(self, client: Client, count: int) -> Any:
        """A float32 slab from the daemon."""
        if self.on_device:
            return client.empty(count, np.float32, device=0)
        return client.empty(count, np.float32)

    def sync(self) -> None:
        if self.on_device:
            self.xp.cuda.get_current_stream().synchronize()

    def all_equal(self, array: Any, value: float) -> bool:
        self.sync()
        return bool((array == value).all())


def repeats(nbytes: int) -> int:
    """Back-to-back ops per sample: about 256 MiB of data, 1 to 100 ops."""
    return max(1, min(100, (256 << 20) // max(1, nbytes)))


def per_op_seconds(op: Callable[[], object], place: Place, repeat: int, samples: int,
                   before: Callable[[], object] | None = None) -> list[float]:
    """Seconds per op in `samples` samples of `repeat` back-to-back ops, each sample
    ended by a stream synchronisation; one warm-up sample first, not kept."""
    times = []
    for index in range(samples + 1):
        if before is not None:
            before()
        place.sync()
        start = time.perf_counter()
        for _ in range(repeat):
            op()
        place.sync()
        if index:
            times.append((time.perf_counter() - start) / repeat)
    return times


def time_copy(place: Place, source: Any, repeat: int, samples: int) -> list[float]:
    """Seconds per device-to-device copy of `source` (cupy.copyto: a cudaMemcpyAsync)."""
    target = place.xp.empty_like(source)
    return per_op_seconds(lambda: place.xp.copyto(target, source), place, repeat, samples)


def measure_copy(client: Client, place: Place, nbytes: int, samples: int) -> dict[str, Any]:
    """Copy, hand-over and empty() round trip at one size (world 1)."""
    count, repeat = nbytes // 4, repeats(nbytes)
    source = place.xp.ones(count, np.float32)
    copy_s = time_copy(place, source, repeat, samples)
    handover_s = per_op_seconds(lambda: client.all_reduce(source), place, repeat, samples)
    slab = place.empty(client, count)
    slab.fill(1)
    round_trip_s = per_op_seconds(lambda: client.all_reduce(slab), place, repeat, samples)
    correct = place.all_equal(source, 1) and place.all_equal(slab, 1)
    return {"bytes": nbytes, "repeat": repeat, "copy_s": copy_s, "handover_s": handover_s,
            "round_trip_s": round_trip_s, "correct": correct}


def copy_role(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    place = Place(args.device)
    sizes = [int(s) for s in args.sizes.split(",")]
    return {"rows": [measure_copy(client, place, size, args.samples) for size in sizes]}


def measure_reduce(client: Client, place: Place, nbytes: int, samples: int) -> dict[str, Any]:
    """All-reduce (sum) of one float32 empty() slab: checked once, then timed."""
    world = client.world_size
    slab = place.empty(client, nbytes // 4)
    slab.fill(client.rank + 1)
    client.all_reduce(slab)
    correct = place.all_equal(slab, world * (world + 1) // 2)
    slab.fill(0)  # timed sums of zeros stay finite
    seconds = per_op_seconds(lambda: client.all_reduce(slab), place, repeats(nbytes), samples,
                             before=client.barrier)
    return {"bytes": nbytes, "repeat": repeats(nbytes), "seconds": seconds, "correct": correct}


def reduce_role(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    place = Place(args.device)
    sizes = [int(s) for s in args.sizes.split(",")]
    return {"rows": [measure_reduce(client, place, size, args.samples) for size in sizes]}


#: How long rank 0 waits, after the victim died, before it submits: the daemon's
#: chance to see the death first (it would otherwise match a dead rank's submission).
NOTICE_S = 1.0
#: A local bound on waiting for the error (the collective deadline is --timeout-s).
FAIL_WAIT_S = 45.0


def hold_lock(path: str) -> int:
    """Lock `path` until this process dies (the kernel releases it then)."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def wait_for_release(path: str, timeout_s: float) -> bool:
    """True once nobody holds the lock on `path` (the victim is dead)."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.01)
    finally:
        os.close(fd)


def fail_role(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    """The last rank dies; ranks 1.. submit at once, rank 0 only after the death."""
    place = Place(args.device)
    victim = client.world_size - 1
    slab = place.empty(client, 1000)
    slab.fill(1)
    place.sync()
    if client.rank == victim:
        hold_lock(args.lock)
    client.barrier()
    if client.rank == victim:
        if args.mode == "after-submit":
            client.all_reduce(slab, async_op=True)
        os.kill(os.getpid(), signal.SIGKILL)
    record: dict[str, Any] = {}
    if client.rank == 0:
        record["victim_died"] = wait_for_release(args.lock, 30.0)
        time.sleep(NOTICE_S)
    start = time.monotonic()
    try:
        work = client.all_reduce(slab, async_op=True)
        assert work is not None
        work.wait(timeout=FAIL_WAIT_S)
        record["error"] = None
    except GradsyncError as exc:
        record["error"] = type(exc).__name__
        record["message"] = str(exc)[:300]
    record["seconds"] = time.monotonic() - start
    record["unchanged"] = place.all_equal(slab, 1)  # an error leaves no partial result
    return record


# -- main -------------------------------------------------------------------------------

ROLES: dict[str, Callable[[Client, argparse.Namespace], dict[str, Any]]] = {
    "allreduce": allreduce_role,
    "collectives": collectives_role,
    "ddp": ddp_role,
    "fail": fail_role,
    "copy": copy_role,
    "reduce": reduce_role,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=sorted(ROLES))
    parser.add_argument("--daemon", required=True, help="the daemon's ipc:// endpoint")
    parser.add_argument("--job", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, default=60.0, help="collective deadline")
    parser.add_argument("--device", choices=("cuda", "host"), default="cuda")
    parser.add_argument("--kinds", default=",".join(DEVICE_KINDS))
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--collectives", default=",".join(COLLECTIVES),
                        help="collectives: which of them")
    parser.add_argument("--sizes", default="1,1000,1048576",
                        help="element counts (allreduce), chunks per rank (collectives) or "
                             "bytes (copy, reduce)")
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--seed", type=int, default=2024)
    parser.add_argument("--mode", choices=("after-submit", "before-submit"),
                        default="after-submit")
    parser.add_argument("--lock", default="", help="fail: the victim holds this lock until death")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with Client(daemon=args.daemon, job=args.job, rank=args.rank, world_size=args.world,
                local_rank=args.rank, local_world_size=args.world,
                timeout_s=args.timeout_s) as client:
        record = ROLES[args.role](client, args)
    print(json.dumps({"role": args.role, "rank": args.rank, **record}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
