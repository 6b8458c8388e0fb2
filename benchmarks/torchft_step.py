"""Training step under torchft: torchft on gradsync vs torchft on its ProcessGroupGloo,
and what torchft costs over plain torch DDP on each.

    python -m benchmarks.torchft_step [--steps 20] [--warmup 5] [--batch 16] [--json]

The model, data and step of benchmarks/ddp_step.py (the ~25 M-parameter MLP,
one core per rank), on N replicas of one rank each (default 2) on this node:

* torchft: a Lighthouse (from the torchft wheel, in this process), one
  `Manager` per replica (min_replica_size N, its defaults otherwise: async
  quorum, 60 s timeout), one `Manager.allreduce` per gradient (what survives a
  failure on torchft 0.2.0; see docs/fault-tolerance.md), torchft's
  `Optimizer` (should_commit on every step);  on `ProcessGroupGradsync` (one
  private daemon) and on torchft's `ProcessGroupGloo`;
* plain torch DDP on the same two backends (ddp_step's own runs, bucket 25 MB).

Step = zero_grad (torchft: the quorum) + forward + backward + gradient
averaging + optimizer step (torchft: the commit vote); time per step = median
over the timed steps of the slowest replica.  Prints a markdown table.  The
same module is the replica program (`--worker`).  Run from the repository root.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks import ddp_step
from benchmarks.private_daemon import private_daemon
from benchmarks.processes import (
    exit_without_destructors,
    log_tail,
    module_command,
    rank_env,
    run_all,
    signals_unwind,
)
from benchmarks.report import format_time

GROUPS = ("gradsync", "gloo")
#: The plain DDP run of ddp_step on each group.
PLAIN = {"gradsync": "torch-gradsync", "gloo": "gloo"}


def worker(args: argparse.Namespace) -> int:
    """One torchft replica: train, time each step, write its JSON."""
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, Optimizer
    from torchft.process_group import ProcessGroupGloo

    from gradsync.client.torch.torchft_group import ProcessGroupGradsync

    torch.set_num_threads(1)
    doc: dict[str, Any] = {"replica": args.replica, "error": None}
    manager = None
    try:
        model = ddp_step.make_model()
        inner = torch.optim.SGD(model.parameters(), lr=1e-4)
        timeout = datetime.timedelta(seconds=args.timeout_s)
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        pg = (ProcessGroupGradsync(timeout=timeout) if args.group == "gradsync"
              else ProcessGroupGloo(timeout=timeout))
        manager = Manager(
            pg=pg, min_replica_size=args.replicas, hostname="127.0.0.1",
            load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                           inner.load_state_dict(state["optim"])),
            state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
            replica_id=f"replica{args.replica}", store_addr="127.0.0.1",
            store_port=store.port, rank=0, world_size=1, lighthouse_addr=args.lighthouse,
            timeout=timeout)
        optimizer = Optimizer(manager, inner)
        gen = torch.Generator().manual_seed(1000 + args.replica)  # different data per replica
        x = torch.randn(args.batch, ddp_step.WIDTHS[0], generator=gen)
        y = torch.randn(args.batch, ddp_step.WIDTHS[-1], generator=gen)
        steps: list[float] = []
        for step in range(args.warmup + args.steps):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=False)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            works = [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]
            for work in works:
                work.wait()
            optimizer.step()  # the commit vote: every step commits here (no failures)
            if step >= args.warmup:
                steps.append(time.perf_counter() - start)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        doc.update(steps_s=steps, checksum=float(flat.double().sum()),
                   nparams=int(flat.numel()), final_step=manager.current_step(),
                   participants=manager.num_participants())
    except BaseException as exc:
        doc["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        if manager is not None:
            manager.shutdown(wait=False)
    with open(os.path.join(args.out_dir, f"torchft-{args.group}-{args.replica}.json"),
              "w") as out:
        json.dump(doc, out)
    return 1 if doc["error"] else 0


def run_torchft(group: str, args: argparse.Namespace, run_dir: str,
                endpoint: str) -> dict[str, Any]:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.replicas)
    try:
        commands = [(module_command(
            "torchft_step", "--worker", "--group", group, "--replica", str(r),
            "--replicas", str(args.replicas), "--lighthouse", lighthouse.address(),
            "--out-dir", run_dir, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--batch", str(args.batch), "--timeout-s", str(args.timeout_s)),
            rank_env(GRADSYNC_DAEMON=endpoint, GRADSYNC_JOB=f"torchft-step-{group}",
                     GLOO_SOCKET_IFNAME="lo"))
            for r in range(args.replicas)]
        log_path = os.path.join(run_dir, f"torchft-{group}.log")
        failure = run_all(commands, log_path, args.timeout_s * 3)
    finally:
        lighthouse.shutdown()
    docs, errors = [], [failure] if failure else []
    for r in range(args.replicas):
        path = os.path.join(run_dir, f"torchft-{group}-{r}.json")
        if not os.path.exists(path):
            errors.append(f"replica {r}: no result")
            continue
        with open(path) as source:
            docs.append(json.load(source))
        if docs[-1]["error"]:
            errors.append(f"replica {r}: {docs[-1]['error']}")
    if errors:
        ddp_step.log(f"torchft on {group} failed: {'; '.join(errors)}\n{log_tail(log_path)}")
        return {"error": "; ".join(errors)}
    per_step = np.max([d["steps_s"] for d in docs], axis=0)
    return {"step_s": float(np.median(per_step)), "p10_s": float(np.percentile(per_step, 10)),
            "p90_s": float(np.percentile(per_step, 90)), "nparams": docs[0]["nparams"],
            "checksums": [d["checksum"] for d in docs],
            "final_steps": [d["final_step"] for d in docs],
            "participants": [d["participants"] for d in docs]}


def render(torchft: dict[str, dict[str, Any]], plain: dict[str, dict[str, Any]]) -> str:
    lines = ["| run | step time (median) | p10 to p90 | gloo / gradsync | "
             "torchft / plain DDP, same group |", "|---|---:|---:|---:|---:|"]
    for label, results in (("torchft", torchft), ("torch DDP", plain)):
        for group in GROUPS:
            res = results.get(group, {})
            if "step_s" not in res:
                lines.append(f"| {label} on {group} | failed | — | — | — |")
                continue
            gloo = results.get("gloo", {}).get("step_s")
            ratio = f"{gloo / res['step_s']:.2f}x" if gloo and group == "gradsync" else "—"
            base = plain.get(group, {}).get("step_s")
            cost = (f"{res['step_s'] / base:.2f}x" if base and label == "torchft" else "—")
            lines.append(f"| {label} on {group} | {format_time(res['step_s'])} | "
                         f"{format_time(res['p10_s'])} to {format_time(res['p90_s'])} | "
                         f"{ratio} | {cost} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank (default 16)")
    parser.add_argument("--replicas", type=int, default=2, help="replicas (default 2)")
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="torchft's timeout (its default: 60)")
    parser.add_argument("--json", action="store_true", help="print the raw results too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--group", choices=GROUPS, help=argparse.SUPPRESS)
    parser.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        code = worker(args)
        exit_without_destructors(code)
    signals_unwind()
    run_dir = tempfile.mkdtemp(prefix="gsb-ftstep-", dir="/tmp")
    plain_args = ddp_step.parse_args(["--steps", str(args.steps), "--warmup", str(args.warmup),
                                      "--batch", str(args.batch), "--nproc",
                                      str(args.replicas)])
    torchft: dict[str, dict[str, Any]] = {}
    plain: dict[str, dict[str, Any]] = {}
    try:
        with private_daemon() as daemon:
            for group in GROUPS:  # the four runs take turns on the same daemon
                ddp_step.log(f"torchft on {group} ...")
                torchft[group] = run_torchft(group, args, run_dir, daemon.endpoint)
                ddp_step.log(f"torch DDP on {group} ...")
                plain[group] = ddp_step.run_mode(PLAIN[group], plain_args, run_dir,
                                                 daemon.endpoint)
    except KeyboardInterrupt:
        ddp_step.log("interrupted; replicas and daemon stopped")
        return 130
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(render(torchft, plain))
    if args.json:
        print(json.dumps({"torchft": torchft, "plain": plain}, indent=1))
    expected = args.warmup + args.steps
    wrong = [g for g, r in torchft.items()
             if "checksums" in r and (max(r["checksums"]) - min(r["checksums"])
                                      > 1e-6 * max(1.0, abs(r["checksums"][0]))
                                      or set(r["final_steps"]) != {expected})]
    for group in wrong:
        print(f"WRONG: torchft on {group}: replicas ended different or a step was not "
              f"committed: {torchft[group]['checksums']}, steps {torchft[group]['final_steps']}")
    failed = [g for g, r in [*torchft.items(), *plain.items()] if "error" in r]
    return 1 if wrong or failed else 0


if __name__ == "__main__":
    sys.exit(main())
