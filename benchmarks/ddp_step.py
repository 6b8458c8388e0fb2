"""Training step benchmark: gradsync DDP, torch DDP and FSDP2 on gradsync and on gloo, no sync.

    python -m benchmarks.ddp_step [--steps 20] [--warmup 5] [--batch 16]
                                  [--out benchmarks/RESULTS.md]

The same MLP (~25 M float32 parameters, 2048→4096→2048→2048→2048, ReLU),
the same random data per rank, SGD.  One run of N ranks per mode: gradsync's
`DistributedDataParallel` (private gradsyncd, ranks via `gradsync launch`),
torch's `DistributedDataParallel` and FSDP2 (`fully_shard` per Linear + root)
on process groups of backend "gradsync" (the same daemon) and "gloo", and N
ranks that train alone at the same time (no sync: the compute floor).  Every rank has
OMP_NUM_THREADS=1 and torch.set_num_threads(1).  With --out writes the
`ddp_step` section of RESULTS.md (other sections kept).  The same module is
the rank program (`python -m benchmarks.ddp_step --worker`).  Run from the
repository root.  See README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks import machine, results_file
from benchmarks.private_daemon import private_daemon
from benchmarks.processes import (
    command_line,
    exit_without_destructors,
    log_tail,
    module_command,
    rank_env,
    run_all,
    signals_unwind,
)
from benchmarks.report import format_time

WIDTHS = (2048, 4096, 2048, 2048, 2048)
MODES = {
    "gradsync": "gradsync DDP",
    "torch-gradsync": "torch DDP + gradsync backend",
    "gloo": "torch DDP + gloo",
    "torch-gradsync-view": "torch DDP (bucket view) + gradsync backend",
    "gloo-view": "torch DDP (bucket view) + gloo",
    "fsdp-gradsync": "torch FSDP2 + gradsync backend",
    "fsdp-gradsync-pool": "torch FSDP2 + gradsync backend, daemon-memory buffers",
    "fsdp-gloo": "torch FSDP2 + gloo",
    "nosync": "no sync (alone)",
}
#: Modes on torch.distributed: mode → (backend, wrapper).  "ddp" is torch's DDP as
#: it comes; "ddp-view" with gradient_as_bucket_view=True (gradients are views of
#: the buckets, as in gradsync's own DDP: torch's advice for speed).
TORCH_MODES = {
    "torch-gradsync": ("gradsync", "ddp"),
    "gloo": ("gloo", "ddp"),
    "torch-gradsync-view": ("gradsync", "ddp-view"),
    "gloo-view": ("gloo", "ddp-view"),
    "fsdp-gradsync": ("gradsync", "fsdp"),
    "fsdp-gradsync-pool": ("gradsync", "fsdp-pool"),
    "fsdp-gloo": ("gloo", "fsdp"),
}
#: Which gloo run each mode is compared with.
BASELINES = {"torch-gradsync-view": "gloo-view", "fsdp-gradsync": "fsdp-gloo",
             "fsdp-gradsync-pool": "fsdp-gloo",
             "fsdp-gloo": "fsdp-gloo", "gloo-view": "gloo-view"}
SECTION = "ddp_step"


def log(message: str) -> None:
    print(f"[ddp_step] {message}", file=sys.stderr, flush=True)


# -- rank side ----------------------------------------------------------------


def make_model() -> Any:
    import torch

    torch.manual_seed(0)  # same initial weights on every rank (DDP broadcasts anyway)
    layers: list[Any] = []
    for a, b in itertools.pairwise(WIDTHS):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def worker(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    rank, nproc = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    path = os.path.join(args.out_dir, f"{args.mode}-rank{rank}.json")
    doc: dict[str, Any] = {"rank": rank, "error": None}
    client = None
    try:
        module = make_model()
        nparams = sum(p.numel() for p in module.parameters())
        comm_alone: list[float] = []
        if args.mode == "gradsync":
            from gradsync.client import Client
            from gradsync.client.torch import DistributedDataParallel as GDDP

            client = Client()
            model = GDDP(module, client=client, bucket_cap_mb=args.bucket_mb)
            grads = client.empty(nparams, np.float32)
            grads.fill(0.0)

            def sync_alone() -> None:
                client.all_reduce(grads, op="avg")

            def barrier() -> None:
                client.barrier()
        elif args.mode in TORCH_MODES:
            import torch.distributed as dist

            backend, wrapper = TORCH_MODES[args.mode]
            if backend == "gradsync":
                import gradsync.client.torch  # noqa: F401 (registers the backend)
            dist.init_process_group(
                backend, init_method=f"file://{args.init_file}", rank=rank, world_size=nproc,
                timeout=datetime.timedelta(seconds=args.timeout_s))
            if wrapper.startswith("ddp"):
                view = wrapper == "ddp-view"
                model = torch.nn.parallel.DistributedDataParallel(
                    module, bucket_cap_mb=args.bucket_mb,
                    gradient_as_bucket_view=view)
            else:
                from torch.distributed.fsdp import fully_shard

                for layer in module:
                    if isinstance(layer, torch.nn.Linear):
                        fully_shard(layer)
                model = fully_shard(module)
                if wrapper == "fsdp-pool":
                    from gradsync.client.torch.fsdp import use_daemon_memory

                    use_daemon_memory(model)
            tgrads = torch.zeros(nparams)

            def sync_alone() -> None:
                dist.all_reduce(tgrads)

            def barrier() -> None:
                dist.barrier()
        else:
            model = module
            sync_alone = barrier = None  # type: ignore[assignment]
        gen = torch.Generator().manual_seed(1000 + rank)  # different data per rank
        x = torch.randn(args.batch, WIDTHS[0], generator=gen)
        y = torch.randn(args.batch, WIDTHS[-1], generator=gen)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        steps, hidden, exposed = [], [], []
        for step in range(args.warmup + args.steps):
            start = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            elapsed = time.perf_counter() - start
            if step >= args.warmup:
                steps.append(elapsed)
                record = getattr(model, "last_step", None)
                if record is not None:
                    hidden.append(record.hidden_fraction())
                    exposed.append(record.synced - record.backward_end)
        if sync_alone is not None:  # the gradient's allreduce on its own, for scale
            for i in range(7):
                barrier()
                start = time.perf_counter()
                sync_alone()
                if i >= 2:
                    comm_alone.append(time.perf_counter() - start)
        checksum = _checksum(module, args.mode)
        doc.update(steps_s=steps, hidden=hidden, exposed_s=exposed, comm_alone_s=comm_alone,
                   nparams=nparams, checksum=checksum)
        if args.mode in TORCH_MODES:
            import torch.distributed as dist

            dist.destroy_process_group()
    except BaseException as exc:
        doc["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        if client is not None:
            client.close()
    with open(path, "w") as out:
        json.dump(doc, out)
    return 1 if doc["error"] else 0


def _checksum(module: Any, mode: str) -> float:
    """Sum of all parameters (FSDP2's are shards: the sum of every rank's shard sums)."""
    total = 0.0
    for param in module.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += float(local.detach().double().sum().item())
    if TORCH_MODES.get(mode, ("", ""))[1].startswith("fsdp"):
        import torch
        import torch.distributed as dist

        summed = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(summed)
        total = float(summed[0])
    return total


# -- driver side ----------------------------------------------------------------


def run_mode(mode: str, args: argparse.Namespace, run_dir: str, endpoint: str) -> dict[str, Any]:
    store = os.path.join(run_dir, f"{mode}.store")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(store)  # a file store left by an earlier run of this mode would mislead
    worker = module_command(
        "ddp_step", "--worker", "--mode", mode, "--out-dir", run_dir,
        "--init-file", store, "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--batch", str(args.batch),
        "--bucket-mb", str(args.bucket_mb), "--timeout-s", str(args.timeout_s),
    )
    log_path = os.path.join(run_dir, f"{mode}.log")
    if mode == "gradsync":
        commands = [([sys.executable, "-m", "gradsync.client.cli", "launch",
                      "--nproc-per-node", str(args.nproc), "--daemon", endpoint,
                      "--job", "ddp-step", *worker], rank_env())]
    else:
        commands = [(worker,
                     rank_env(RANK=str(r), WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(r),
                              LOCAL_WORLD_SIZE=str(args.nproc), GLOO_SOCKET_IFNAME="lo",
                              GRADSYNC_DAEMON=endpoint))
                    for r in range(args.nproc)]
    meter = machine.LoadMeter()
    failure = run_all(commands, log_path, args.timeout_s)
    background = meter.foreign_cores()
    docs, errors = [], [failure] if failure else []
    for r in range(args.nproc):
        path = os.path.join(run_dir, f"{mode}-rank{r}.json")
        if not os.path.exists(path):
            errors.append(f"rank {r}: no result")
            continue
        with open(path) as source:
            docs.append(json.load(source))
        if docs[-1]["error"]:
            errors.append(f"rank {r}: {docs[-1]['error']}")
    if errors:
        log(f"{MODES[mode]} failed: {'; '.join(errors)}\n{log_tail(log_path)}")
        return {"error": "; ".join(errors)}
    per_step = np.max([d["steps_s"] for d in docs], axis=0)  # slowest rank per step
    result: dict[str, Any] = {
        "step_s": float(np.median(per_step)),
        "p10_s": float(np.percentile(per_step, 10)),
        "p90_s": float(np.percentile(per_step, 90)),
        "nparams": docs[0]["nparams"],
        "checksums": [d["checksum"] for d in docs],
        "background": background,
    }
    if docs[0]["hidden"]:
        result["hidden"] = statistics.median(h for d in docs for h in d["hidden"])
        result["exposed_s"] = statistics.median(e for d in docs for e in d["exposed_s"])
    if docs[0]["comm_alone_s"]:
        result["comm_alone_s"] = float(np.median(np.max([d["comm_alone_s"] for d in docs],
                                                        axis=0)))
    return result


def render(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> tuple[str, list[str]]:
    lines = ["| run | step time (median) | p10 to p90 | vs the same wrapper on gloo | "
             "gradient allreduce alone | comm hidden behind backward | exposed sync wait |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    gloo = results.get("gloo", {}).get("step_s")

    def baseline(mode: str) -> float | None:
        """Step time of the gloo run with the same wrapper and settings."""
        value = results.get(BASELINES.get(mode, "gloo"), {}).get("step_s")
        return float(value) if value else None

    for mode, res in results.items():
        if "error" in res:
            lines.append(f"| {MODES[mode]} | failed | — | — | — | — | — |")
            continue
        base = baseline(mode)
        speed = f"{base / res['step_s']:.2f}x" if base else "—"
        alone = format_time(res["comm_alone_s"]) if "comm_alone_s" in res else "—"
        hidden = f"{100 * res['hidden']:.0f} %" if "hidden" in res else "—"
        exposed = format_time(res["exposed_s"]) if "exposed_s" in res else "—"
        lines.append(f"| {MODES[mode]} | {format_time(res['step_s'])} | "
                     f"{format_time(res['p10_s'])} to {format_time(res['p90_s'])} | {speed} | "
                     f"{alone} | {hidden} | {exposed} |")
    notes: list[str] = []
    ours = results.get("gradsync", {})
    if "step_s" in ours and gloo:
        faster = ours["step_s"] < gloo
        notes.append(f"- faster than torch DDP + gloo: {'met' if faster else 'MISSED'} "
                     f"({gloo / ours['step_s']:.2f}x)")
    for mode in ("torch-gradsync", "torch-gradsync-view", "fsdp-gradsync",
                 "fsdp-gradsync-pool"):
        base, res = baseline(mode), results.get(mode, {})
        if "step_s" in res and base:
            ratio = base / res["step_s"]
            notes.append(f"- {MODES[mode]} ≥ 1.3x the step rate on gloo: "
                         f"{'met' if ratio >= 1.3 else 'MISSED'} ({ratio:.2f}x)")
    if "hidden" in ours:
        notes.append(f"- ≥ 70 % of communication hidden: "
                     f"{'met' if ours['hidden'] >= 0.7 else 'MISSED'} "
                     f"({100 * ours['hidden']:.0f} %)")
    for mode in (m for m in MODES if m != "nosync"):  # alone, ranks differ on purpose
        sums = results.get(mode, {}).get("checksums")
        if sums and max(sums) - min(sums) > 1e-6 * max(1.0, abs(sums[0])):
            notes.append(f"- WRONG: {MODES[mode]} ranks ended with different parameters: {sums}")
    return "\n".join(lines), notes


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank (default 16)")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="both DDPs (default 25)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", metavar="RESULTS.md", help="write the 'ddp_step' section")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every mode this many times, in turns, and keep each "
                        "mode's fastest run (default 1)")
    parser.add_argument("--keep", action="store_true", help="keep per-rank JSON and logs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    parser.add_argument("--init-file", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        code = worker(args)
        if args.mode in TORCH_MODES:
            exit_without_destructors(code)  # the result file is written
        return code
    signals_unwind()
    modes = [m for m in args.modes.split(",") if m]
    if any(m not in MODES for m in modes) or args.nproc < 2:
        print(f"ddp_step: modes come from {list(MODES)}, N >= 2", file=sys.stderr)
        return 2
    started_at = datetime.datetime.now().astimezone()
    started = time.perf_counter()
    run_dir = tempfile.mkdtemp(prefix="gsb-ddp-", dir="/tmp")
    results: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    try:
        with private_daemon() as daemon:
            daemon_command = daemon.shown_command()
            # Modes take turns (A B C, A B C, ...); each keeps its least disturbed run.
            for repeat in range(args.repeat):
                for mode in modes:
                    log(f"{MODES[mode]} ({repeat + 1} of {args.repeat}) ...")
                    result = run_mode(mode, args, run_dir, daemon.endpoint)
                    if "error" in result:
                        problems.append(f"- {MODES[mode]}: {result['error']}")
                        results[mode] = result
                        continue
                    log(f"{MODES[mode]}: {format_time(result['step_s'])} per step")
                    best = results.get(mode)
                    if best is None or "error" in best or result["step_s"] < best["step_s"]:
                        results[mode] = result
        if daemon.exit_code != 0:
            problems.append(f"- gradsyncd exited with status {daemon.exit_code} on SIGTERM")
        if daemon.leaked_segments:
            problems.append(f"- gradsyncd left {len(daemon.leaked_segments)} /dev/shm segments")
    except KeyboardInterrupt:
        log("interrupted; ranks and daemon stopped")
        return 130
    finally:
        if args.keep:
            log(f"kept {run_dir}")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    table, notes = render(results, args)
    problems += [n for n in notes if "WRONG" in n]
    print(f"\n{table}\n\n" + "\n".join(notes))
    if args.out:
        info = machine.describe()
        nparams = next((r["nparams"] for r in results.values() if "nparams" in r), 0)
        load = ", ".join(f"{MODES[m]} {r['background']:.2f}"
                         for m, r in results.items() if "background" in r)
        text = "\n".join([
            "# Training step benchmark: gradsync DDP, torch DDP and FSDP2 on gradsync and on "
            "gloo, no sync\n",
            f"Recorded {started_at.strftime('%Y-%m-%d %H:%M %Z')}, "
            f"{time.perf_counter() - started:.0f} s in all, on {info['CPU']} (torch "
            f"{info['torch']}, gradsync {info['gradsync']}). Reproduce from the repository "
            "root (venv active):\n",
            f"```\n{command_line(__file__, argv)}\n```\n",
            f"{args.nproc} ranks on this node, each training the same MLP "
            f"({'→'.join(map(str, WIDTHS))}, ReLU; {nparams / 1e6:.1f} M float32 parameters, "
            f"{nparams * 4 / 2**20:.0f} MiB of gradients) on its own random batch of "
            f"{args.batch}, MSE loss, SGD. Step = zero_grad + forward + backward (+ gradient "
            f"averaging) + optimizer step; {args.warmup} warm-up steps, then {args.steps} "
            "timed; time per step = median over steps of the slowest rank"
            + (f", the fastest of {args.repeat} runs per mode, the modes taking turns"
               if args.repeat > 1 else "") + ". Every rank runs "
            "with `OMP_NUM_THREADS=1` and `torch.set_num_threads(1)` (fair: one core each). "
            f"The DDPs use bucket_cap_mb={args.bucket_mb:g}. gradsync DDP: "
            "`gradsync.client.torch.DistributedDataParallel`, private daemon "
            f"`{daemon_command}` (it shares the cores with the ranks); torch DDP: "
            "`torch.nn.parallel.DistributedDataParallel` as it comes (gradients copied into "
            "its buckets and back), and with `gradient_as_bucket_view=True` (bucket view), "
            "on process groups of backend \"gradsync\" (the same daemon) and \"gloo\" "
            "(file:// store); FSDP2: `fully_shard` on every Linear, then the root, on the "
            "same two backends, and on gradsync also with "
            "`gradsync.client.torch.fsdp.use_daemon_memory` (its all-gather and "
            "reduce-scatter buffers in daemon memory); each row is compared with the same "
            "wrapper and settings on gloo. No sync: "
            "the ranks run at the same time, each alone (the compute floor). *Gradient "
            "allreduce alone*: one allreduce of the whole gradient's size after the steps "
            "(slowest rank, median of 5): the communication to hide. *Hidden* = "
            "`last_step.hidden_fraction()` (median over steps and ranks); *exposed sync wait* "
            "= `last_step.synced − backward_end`. Other processes used (cores) meanwhile: "
            f"{load}.\n",
            table, "", *notes, *(["", "Problems:", *problems] if problems else []), "",
        ])
        results_file.write_section(args.out, SECTION, text, writer="benchmarks/ddp_step.py")
        log(f"wrote section '{SECTION}' of {args.out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
