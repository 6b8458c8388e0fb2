"""One rank of benchmarks/latency_ab.py: small allreduces timed on whichever gradsync
the interpreter imports.

Run by `gradsync launch` with a tree's `.mypy-src` first on PYTHONPATH (`--api
client` or `torch`), or as the references are run: torchrun (`--api gloo`) and
mpirun (`--api mpi`, mpi4py).  It imports nothing of this repository but the
public client API that every tree since the fast path has had (`Client`,
`Client.empty`, `Client.all_reduce`) and torch's, so the same file times old
commits and the working tree alike, and the references with the same loop.
Each sample is `--batch` back-to-back allreduces after a barrier; rank 0 prints
one `LATENCY {json}` line: per size, the microseconds per op of every sample.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable

import numpy as np


def samples_of(run: Callable[[], object], barrier: Callable[[], object], batch: int,
               samples: int) -> list[float]:
    """Microseconds per op of `samples` batches of `batch` back-to-back `run()`s."""
    for _ in range(max(10, batch // 4)):  # warm-up: page views, caches, the spin's tuning
        run()
    per_op = []
    for _ in range(samples):
        barrier()
        start = time.perf_counter_ns()
        for _ in range(batch):
            run()
        per_op.append((time.perf_counter_ns() - start) / batch / 1e3)
    return per_op


def client_cases(sizes: list[int], batch: int, samples: int) -> tuple[int, dict[str, list[float]]]:
    """`Client.all_reduce` on daemon memory (`Client.empty`): the fast path's cost."""
    from gradsync.client import Client

    with Client() as client:
        token = client.empty(1, np.float32)
        results = {}
        for nbytes in sizes:
            array = client.empty(nbytes // 4, np.float32)
            array[:] = 1.0
            results[str(nbytes)] = samples_of(lambda a=array: client.all_reduce(a),
                                              lambda: client.all_reduce(token),
                                              batch_for(nbytes, batch), samples)
            del array  # its segment goes back before the next size's
        return client.rank, results


def dist_cases(backend: str, sizes: list[int], batch: int,
               samples: int) -> tuple[int, dict[str, list[float]]]:
    """`torch.distributed.all_reduce` on plain tensors through `backend` ("gradsync",
    or "gloo" for the reference), env:// rendezvous."""
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend)
    token = torch.zeros(1)
    results = {}
    for nbytes in sizes:
        tensor = torch.ones(nbytes // 4)
        results[str(nbytes)] = samples_of(lambda t=tensor: dist.all_reduce(t),
                                          lambda: dist.all_reduce(token),
                                          batch_for(nbytes, batch), samples)
    rank = dist.get_rank()
    dist.barrier()
    if backend == "gradsync":  # gloo's teardown aborts at exit on torch 2.13: left to the OS
        dist.destroy_process_group()
    return rank, results


def mpi_cases(sizes: list[int], batch: int, samples: int) -> tuple[int, dict[str, list[float]]]:
    """Open MPI's `Allreduce` in place on numpy arrays (mpi4py under mpirun)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    results = {}
    for nbytes in sizes:
        array = np.ones(nbytes // 4, np.float32)
        results[str(nbytes)] = samples_of(
            lambda a=array: comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM), comm.Barrier,
            batch_for(nbytes, batch), samples)
    return comm.Get_rank(), results


def batch_for(nbytes: int, batch: int) -> int:
    """Fewer ops a sample where one op is long (gloo, MiB sizes): samples stay short."""
    return max(5, batch * 65536 // max(nbytes, 65536))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--api", choices=tuple(CASES), default="client")
    parser.add_argument("--sizes", required=True, help="comma-separated byte counts")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--samples", type=int, default=30)
    args = parser.parse_args()
    sizes = [int(text) for text in args.sizes.split(",")]
    rank, results = CASES[args.api](sizes, args.batch, args.samples)
    if rank == 0:
        sys.stdout.write("LATENCY " + json.dumps(results) + "\n")
        sys.stdout.flush()
    return 0


CASES = {"client": client_cases, "torch": functools.partial(dist_cases, "gradsync"),
         "gloo": functools.partial(dist_cases, "gloo"), "mpi": mpi_cases}


if __name__ == "__main__":
    sys.exit(main())
