"""Heal time: a 100 MB state dict from a live torchft replica to a healing one,
through torchft's HTTPTransport, its PGTransport (on gloo and on gradsync) and
gradsync's GradsyncTransport.

    python -m benchmarks.torchft_heal [--repeat 5] [--transports ...] [--json]

Two replica processes on this node (one private daemon for the gradsync
groups), each with a quorum's process groups configured as torchft's Manager
would (a TCPStore, `configure`).  The state is what the Manager sends: the
~25 M-parameter MLP of benchmarks/ddp_step.py (its state_dict, 100 MB) under
"user", and torchft's own step.  Per transport and repeat: the healing
replica says go, the live one calls `send_checkpoint`, and the time is from go
to `recv_checkpoint` returning on the healing one (its tensors checked against
the live one's); the transports take turns.  Median of the repeats.  Prints a
markdown table.  The same module is the replica program (`--worker`).
"""

from __future__ import annotations

import argparse
import datetime
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

TRANSPORTS = {
    "http": "torchft HTTPTransport",
    "pg-gloo": "torchft PGTransport on ProcessGroupGloo",
    "pg-gradsync": "torchft PGTransport on ProcessGroupGradsync",
    "gradsync": "gradsync GradsyncTransport on ProcessGroupGradsync",
}
STEP = 12


def checksum(state: Any) -> float:
    return float(sum(t.double().sum() for t in state["user"]["model"].values()))


def worker(args: argparse.Namespace) -> int:
    """One replica: rank 0 lives (sends), rank 1 heals (receives and times)."""
    import torch
    from torch.distributed import TCPStore
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.process_group import ProcessGroupGloo

    from gradsync.client.torch.torchft_group import ProcessGroupGradsync
    from gradsync.client.torch.torchft_transport import GradsyncTransport

    torch.set_num_threads(1)
    rank = args.rank
    timeout = datetime.timedelta(seconds=args.timeout_s)
    doc: dict[str, Any] = {"rank": rank, "error": None, "seconds": {}}
    groups: list[Any] = []
    try:
        store = TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=timeout)
        state = {"user": {"model": ddp_step.make_model().state_dict()},
                 "torchft": {"step": STEP, "batches_committed": 2 * STEP}}
        expected = checksum(state)
        gradsync_pg = ProcessGroupGradsync(timeout=timeout)
        gloo_pg = ProcessGroupGloo(timeout=timeout)
        groups = [gradsync_pg, gloo_pg]
        for name, group in (("gradsync", gradsync_pg), ("gloo", gloo_pg)):
            group.configure(f"127.0.0.1:{args.store_port}/torchft/{name}/0",
                            f"replica{rank}", rank, 2, 1)
        transports: dict[str, Any] = {
            "http": HTTPTransport(timeout, num_chunks=0),
            "pg-gloo": PGTransport(gloo_pg, timeout, torch.device("cpu")),
            "pg-gradsync": PGTransport(gradsync_pg, timeout, torch.device("cpu")),
            "gradsync": GradsyncTransport(gradsync_pg, timeout),
        }
        doc["payload_bytes"] = sum(t.numel() * t.element_size()
                                   for t in state["user"]["model"].values())
        for repeat in range(args.repeat):
            for name in args.transports:
                transport, key = transports[name], f"{name}-{repeat}"
                if rank == 0:
                    store.set(f"{key}-metadata", transport.metadata())
                    store.wait([f"{key}-go"])
                    transport.send_checkpoint([1], STEP, state, timeout)
                    store.wait([f"{key}-done"])
                    transport.disallow_checkpoint()
                    continue
                metadata = store.get(f"{key}-metadata").decode()
                store.set(f"{key}-go", "1")
                started = time.perf_counter()
                got = transport.recv_checkpoint(0, metadata, STEP, timeout)
                doc["seconds"].setdefault(name, []).append(time.perf_counter() - started)
                if checksum(got) != expected or got["torchft"]["step"] != STEP:
                    raise RuntimeError(f"{name}: the healed state differs from the live one")
                del got
                store.set(f"{key}-done", "1")
        for transport in transports.values():
            transport.shutdown(wait=False)
    except BaseException as exc:
        doc["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        for group in groups:
            group.shutdown()
    with open(os.path.join(args.out_dir, f"heal-{rank}.json"), "w") as out:
        json.dump(doc, out)
    return 1 if doc["error"] else 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="heals per transport (default 5)")
    parser.add_argument("--transports", type=lambda s: s.split(","), default=list(TRANSPORTS),
                        help=f"comma-separated, from {','.join(TRANSPORTS)}")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--json", action="store_true", help="print the raw results too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        code = worker(args)
        exit_without_destructors(code)
    if any(name not in TRANSPORTS for name in args.transports):
        print(f"torchft_heal: transports come from {list(TRANSPORTS)}", file=sys.stderr)
        return 2
    from torch.distributed import TCPStore

    signals_unwind()
    run_dir = tempfile.mkdtemp(prefix="gsb-heal-", dir="/tmp")
    try:
        with private_daemon() as daemon:
            store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            common = ["--store-port", str(store.port), "--out-dir", run_dir, "--repeat",
                      str(args.repeat), "--transports", ",".join(args.transports),
                      "--timeout-s", str(args.timeout_s)]
            commands = [(module_command("torchft_heal", "--worker", "--rank", str(r), *common),
                         rank_env(GRADSYNC_DAEMON=daemon.endpoint, GRADSYNC_JOB="torchft-heal",
                                  GLOO_SOCKET_IFNAME="lo")) for r in range(2)]
            log_path = os.path.join(run_dir, "heal.log")
            failure = run_all(commands, log_path, args.timeout_s * 4 * len(args.transports))
            docs = []
            for r in range(2):
                path = os.path.join(run_dir, f"heal-{r}.json")
                if os.path.exists(path):
                    with open(path) as source:
                        docs.append(json.load(source))
            errors = [failure] if failure else []
            errors += [f"replica {d['rank']}: {d['error']}" for d in docs if d["error"]]
            if errors or len(docs) < 2:
                ddp_step.log(f"failed: {'; '.join(errors) or 'no result'}\n{log_tail(log_path)}")
                return 1
    except KeyboardInterrupt:
        ddp_step.log("interrupted; replicas and daemon stopped")
        return 130
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    healer = docs[1]
    medians = {name: statistics.median(s) for name, s in healer["seconds"].items()}
    size = docs[0]["payload_bytes"]
    base = medians.get("http")
    print(f"state dict: {size / 1e6:.0f} MB of tensors; median of {args.repeat} heals\n")
    print("| transport | heal time | MB/s | HTTP / this |")
    print("|---|---:|---:|---:|")
    for name, seconds in medians.items():
        ratio = f"{base / seconds:.1f}x" if base else "—"
        print(f"| {TRANSPORTS[name]} | {seconds * 1e3:.0f} ms | {size / seconds / 1e6:.0f} | "
              f"{ratio} |")
    if args.json:
        print(json.dumps(healer, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
