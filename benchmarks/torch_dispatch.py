"""`dist.all_reduce` through torch on backend gradsync, gloo and a do-nothing backend.

    python -m benchmarks.torch_dispatch [--ranks 2] [--iters 2000] [--sizes 4KiB,64KiB,16MiB]

N ranks on this machine (env:// rendezvous, one private gradsyncd started by
the backend itself), float32 sum, synchronous `dist.all_reduce` on an
ordinary torch tensor, as a framework calls it.  The do-nothing backend
("noop": a Python `ProcessGroup` whose allreduce hands back a completed Work
at once) measures torch's own Python dispatch the same way, which is the part
of gradsync's time that is not ours.  "fake" is torch's own do-nothing backend
in C++ (`FakeProcessGroup`, torch's test tool): what the dispatch would cost a
backend written in C++.  "fake-direct" calls that backend's
`ProcessGroup.allreduce` and waits, as `dist.all_reduce` does, without the
Python function around it: the difference is that function's own cost, which
no backend can save.  Prints one table: median µs per call over batches
(the ranks meet at a barrier before each batch).  The same module is the rank
program (`--worker`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from benchmarks.processes import clean_env, log_tail, module_command, rank_env, run_all

BACKENDS = ("gradsync", "gloo", "noop", "fake", "fake-direct")
_SIZES = {"KiB": 1024, "MiB": 1024 * 1024}


def _bytes(text: str) -> int:
    for suffix, scale in _SIZES.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * scale
    return int(text)


def _register_noop() -> None:
    """Backend "noop": every allreduce is done before it returns (torch's dispatch only)."""
    import torch
    import torch.distributed as dist

    class DoneWork(dist.Work):
        def __init__(self, tensors: list[torch.Tensor]) -> None:
            super().__init__()
            self._tensors = tensors

        def wait(self, timeout: Any = None) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

        def get_future(self) -> torch.futures.Future[Any]:
            future: torch.futures.Future[Any] = torch.futures.Future()
            future.set_result(self._tensors)
            return future

    class Noop(dist.ProcessGroup):
        def __init__(self, rank: int, size: int) -> None:
            super().__init__(rank, size)

        def getBackendName(self) -> str:
            return "noop"

        def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
            return DoneWork(tensors)

        def barrier(self, opts: Any = None) -> dist.Work:
            return DoneWork([])

    dist.Backend.register_backend(
        "noop", lambda store, rank, size, timeout: Noop(rank, size), devices=["cpu"])


def worker(backend: str, sizes: list[int], iters: int, result: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "noop":
        _register_noop()
    if backend.startswith("fake"):  # no rendezvous: each rank alone, as nothing crosses
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group(backend)
    call: Callable[[torch.Tensor], object] = dist.all_reduce
    if backend == "fake-direct":
        group, options = dist.group.WORLD, dist.AllreduceOptions()
        assert group is not None

        def call(tensor: torch.Tensor) -> object:
            return group.allreduce([tensor], options).wait()

    results = {}
    for nbytes in sizes:
        tensor = torch.ones(nbytes // 4, dtype=torch.float32)
        count = max(20, iters if nbytes <= 65536 else iters // 100)
        batch = max(10, count // 20)
        for _ in range(min(50, count)):
            call(tensor)
        per_call = []
        for _ in range(count // batch):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(batch):
                call(tensor)
            per_call.append((time.perf_counter() - start) / batch)
        results[nbytes] = statistics.median(per_call) * 1e6
    if dist.get_rank() == 0:
        with open(result, "w", encoding="utf-8") as handle:
            json.dump({"backend": backend, "us": results}, handle)
    dist.destroy_process_group()


def run(backend: str, ranks: int, sizes: list[int], iters: int, port: int) -> dict[int, float]:
    """One backend's figures: µs per call by size, from rank 0's result file."""
    with tempfile.TemporaryDirectory(prefix="gs-bench-") as runtime:
        result = os.path.join(runtime, "result.json")
        env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(ranks),
                        XDG_RUNTIME_DIR=runtime)
        command = module_command("torch_dispatch", "--worker", backend, "--sizes",
                                 ",".join(map(str, sizes)), "--iters", str(iters),
                                 "--result", result)
        log_path = os.path.join(runtime, "ranks.log")
        failure = run_all([(command, rank_env(env, RANK=str(r), LOCAL_RANK=str(r)))
                           for r in range(ranks)], log_path, 600)
        if failure is not None:
            raise SystemExit(f"{backend}: {failure}\n{log_tail(log_path)}")
        with open(result, encoding="utf-8") as handle:
            record = json.load(handle)
    return {int(k): float(v) for k, v in record["us"].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=BACKENDS)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--sizes", default="4KiB,64KiB,16MiB")
    parser.add_argument("--port", type=int, default=29731)
    parser.add_argument("--result", help="(--worker) where rank 0 writes its figures")
    args = parser.parse_args()
    sizes = [_bytes(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(args.worker, sizes, args.iters, args.result)
        return
    table = {b: run(b, args.ranks, sizes, args.iters, args.port + i)
             for i, b in enumerate(BACKENDS)}
    print(f"| size (B) | {' | '.join(f'{b} (µs)' for b in BACKENDS)} | noop share of gradsync | "
          "fake share of gradsync |")
    print(f"| ---: | {' | '.join('---:' for _ in BACKENDS)} | ---: | ---: |")
    for nbytes in sizes:
        cells = " | ".join(f"{table[b][nbytes]:.1f}" for b in BACKENDS)
        shares = " | ".join(f"{table[b][nbytes] / table['gradsync'][nbytes]:.0%}"
                            for b in ("noop", "fake"))
        print(f"| {nbytes} | {cells} | {shares} |")


if __name__ == "__main__":
    main()
