"""DiLoCo over a slow link: torchft's DiLoCo and Streaming DiLoCo on gradsync (exact,
bf16, fp8) and on gloo, against torch DDP syncing every step, same model and data.

    python -m benchmarks.torchft_diloco [--steps 60] [--sync-every 10] [--rate 2gbit]

Two "nodes" (network namespaces joined by a veth pair shaped with tbf to
`--rate` each way, benchmarks/topology.py), one rank on each.  Every variant
gets fresh namespaces, and for gradsync one `--insecure` daemon per node:

* DiLoCo (torchft `DiLoCo`, one fragment, sync every `--sync-every` inner
  steps): a Lighthouse on node 0, one replica group of one rank per node,
  torchft's Manager (synchronous quorum) on `ProcessGroupGradsync`, with
  GRADSYNC_COMPRESSION unset, bf16 and fp8, and on torchft's `ProcessGroupGloo`;
* Streaming DiLoCo (`--fragments` fragments, `--delay` = fragment_sync_delay:
  a fragment's allreduce overlaps that many inner steps) on gradsync and gloo;
* torch DDP, 2 ranks, backend gradsync and gloo: an allreduce every step.

Every variant trains the same MLP (benchmarks/diloco_replica.py, the rank
program) from the same seed on the same batches: AdamW inside, Nesterov SGD
(lr 0.7, momentum 0.9) outside.  Time per outer step = `--sync-every` inner
steps and the sync, end to end as the later rank sees it, median over the
outer steps after `--warmup`; for DDP the same number of steps.  Blocked in
sync = the seconds per outer step spent in DiLoCo's optimizer hook (pseudo-
gradient, allreduce, outer step; Streaming: the prepare and the wait).  Loss = MSE on
a fixed held-out batch after `--steps` inner steps, mean of the two ranks.
Prints a markdown table (`--json`: the raw records on stdout, the table on
stderr); `--repeat N` runs every variant N times, in turns, and tables the
run other processes loaded least.  About 4 minutes a round on 2 cores.  Needs
root and iproute2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import topology
from benchmarks.machine import LoadMeter, cpu_model, load_average
from benchmarks.private_daemon import daemon_cluster
from benchmarks.processes import clean_env, module_command, signals_unwind, stop_group

ROOT = Path(__file__).resolve().parents[1]
LIGHTHOUSE = ROOT / "tests" / "programs" / "lighthouse.py"
LIGHTHOUSE_PORT = topology.NETNS_BASE_PORT + 90
MASTER_PORT = topology.NETNS_BASE_PORT + 50
#: The Lighthouse's heartbeat timeout: generous, the 2 cores are busy.
HEARTBEAT_MS = 5000


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of training: torchft DiLoCo or DDP, on which process group."""

    name: str
    mode: str  # "diloco" or "ddp"
    pg: str  # "gradsync" or "gloo"
    compression: str | None = None
    streaming: bool = False

    def label(self, fragments: int, delay: int) -> str:
        if self.mode == "ddp":
            return f"torch DDP on {self.pg}, every step"
        kind = (f"Streaming DiLoCo ({fragments} fragments, delay {delay})" if self.streaming
                else "DiLoCo")
        return f"{kind} on {self.pg}" + (f", {self.compression}" if self.compression else "")


VARIANTS = {v.name: v for v in (
    Variant("diloco-gradsync", "diloco", "gradsync"),
    Variant("diloco-gradsync-bf16", "diloco", "gradsync", "bf16"),
    Variant("diloco-gradsync-fp8", "diloco", "gradsync", "fp8"),
    Variant("diloco-gloo", "diloco", "gloo"),
    Variant("streaming-gradsync", "diloco", "gradsync", streaming=True),
    Variant("streaming-gloo", "diloco", "gloo", streaming=True),
    Variant("ddp-gradsync", "ddp", "gradsync"),
    Variant("ddp-gloo", "ddp", "gloo"),
)}


def _tail(path: Path, chars: int = 2500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _wait(ranks: list[subprocess.Popen[bytes]], logs: list[Path], deadline_s: float) -> None:
    """Wait for every rank to exit 0; raise (the others stopped) on a failure or the deadline."""
    deadline = time.monotonic() + deadline_s
    while any(rank.poll() is None for rank in ranks):
        failed = [i for i, rank in enumerate(ranks) if rank.returncode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            time.sleep(1.0 if failed else 0.0)  # let the other say what it saw
            for rank in ranks:
                stop_group(rank, grace_s=5)
            what = (f"rank {failed[0]} exited {ranks[failed[0]].returncode}" if failed
                    else f"no result within {deadline_s:g} s")
            raise RuntimeError(what + "".join(
                f"\n--- rank {i}:\n{_tail(log)}" for i, log in enumerate(logs)))
        time.sleep(0.1)
    failed = [i for i, rank in enumerate(ranks) if rank.returncode != 0]
    if failed:
        raise RuntimeError(f"rank {failed[0]} exited {ranks[failed[0]].returncode}\n"
                           f"{_tail(logs[failed[0]])}")


def run_variant(variant: Variant, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Both ranks' records of one training run of `variant` in fresh namespaces."""
    with contextlib.ExitStack() as stack:
        topo = stack.enter_context(topology.namespaces(2, rate=args.rate))
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gs-diloco-")))
        daemons = ["-", "-"]
        if variant.pg == "gradsync":
            endpoints = topo.endpoints()[0]
            flags = [["--listen", endpoints[i], "--peers", ",".join(endpoints), "--insecure"]
                     for i in range(2)]
            runs = stack.enter_context(daemon_cluster(flags, [topo.prefix(i) for i in range(2)]))
            daemons = [run.endpoint for run in runs]
        processes: list[subprocess.Popen[bytes]] = []

        def stop_all() -> None:
            for process in processes:
                stop_group(process, grace_s=5)
                if process.stdout is not None:
                    process.stdout.close()

        stack.callback(stop_all)  # before the daemons and the namespaces go
        if variant.mode == "diloco":
            lighthouse = subprocess.Popen(
                [*topo.prefix(0), sys.executable, str(LIGHTHOUSE), str(LIGHTHOUSE_PORT), "2",
                 str(HEARTBEAT_MS)], stdout=subprocess.PIPE,
                stderr=stack.enter_context(open(folder / "lighthouse.log", "wb")),
                start_new_session=True)
            processes.append(lighthouse)
            assert lighthouse.stdout is not None
            ready, _, _ = select.select([lighthouse.stdout], [], [], 30.0)
            if not ready or lighthouse.stdout.readline() != b"ready\n":
                raise RuntimeError(f"the Lighthouse did not start (exit {lighthouse.poll()})")
        ranks: list[subprocess.Popen[bytes]] = []
        logs: list[Path] = []
        for rank in range(2):
            config = {"mode": variant.mode, "pg": variant.pg, "rank": rank,
                      "steps": args.steps, "sync_every": args.sync_every,
                      "fragments": args.fragments if variant.streaming else 1,
                      "delay": args.delay if variant.streaming else 0,
                      "batch": args.batch, "width": args.width, "layers": args.layers,
                      "host": topo.hosts[rank], "timeout_s": args.timeout_s}
            env = clean_env(
                GRADSYNC_DAEMON=daemons[rank], GRADSYNC_JOB="bench-diloco",
                TORCHFT_LIGHTHOUSE=f"http://{topo.hosts[0]}:{LIGHTHOUSE_PORT}",
                MASTER_ADDR=topo.hosts[0], MASTER_PORT=str(MASTER_PORT),
                GLOO_SOCKET_IFNAME=topo.interfaces[rank], OMP_NUM_THREADS="1",
                PYTHONPATH=str(ROOT))
            if variant.compression:
                env["GRADSYNC_COMPRESSION"] = variant.compression
            log = folder / f"rank{rank}.log"
            out = folder / f"rank{rank}.json"
            logs.append(log)
            with open(log, "wb") as errors, open(out, "wb") as results:
                ranks.append(subprocess.Popen(
                    [*topo.prefix(rank),
                     *module_command("diloco_replica", json.dumps(config))],
                    cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=results,
                    stderr=errors, start_new_session=True))
            processes.append(ranks[-1])
        _wait(ranks, logs, args.deadline_s)
        return [json.loads((folder / f"rank{rank}.json").read_text().strip().splitlines()[-1])
                for rank in range(2)]


def summarize(variant: Variant, records: list[dict[str, Any]],
              args: argparse.Namespace) -> dict[str, Any]:
    """Median outer-step time (the later rank's clock), sync time, loss, agreement."""
    every, outer = args.sync_every, args.steps // args.sync_every
    # End of outer step k: the later rank's end of inner step (k+1) H - 1.
    ends = [max(r["ends"][(k + 1) * every - 1] for r in records) for k in range(outer)]
    times = [ends[k] - ends[k - 1] for k in range(max(1, args.warmup), outer)]
    syncs = [max(sum(r["in_sync"][k * every:(k + 1) * every]) for r in records)
             for k in range(max(1, args.warmup), outer)] if variant.mode == "diloco" else []
    expected = outer * (args.fragments if variant.streaming else 1)
    committed = [r["committed"] for r in records]
    return {
        "variant": variant.name, "label": variant.label(args.fragments, args.delay),
        "outer_s": statistics.median(times), "outer_s_all": times,
        "inner_s": statistics.median(times) / every,
        "sync_s": statistics.median(syncs) if syncs else None,
        "eval_loss": statistics.fmean(r["eval_loss"] for r in records),
        "eval_losses": [r["eval_loss"] for r in records],
        "train_loss_last_outer": statistics.fmean(
            x for r in records for x in r["losses"][-every:]),
        "replicas_equal": records[0]["checksum"] == records[1]["checksum"],
        "committed": committed,
        "all_committed": variant.mode == "ddp" or all(c == expected for c in committed),
        "errored": [r["errored"] for r in records if r["errored"]],
        "parameters": records[0]["parameters"],
        "wall_s": max(r["ends"][-1] for r in records) - min(r["started"] for r in records),
    }


def least_disturbed(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Of one variant's repeats, the successful one other processes loaded least."""
    done = [r for r in runs if "error" not in r] or runs
    return min(done, key=lambda r: float(r["foreign_cores"]))


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """The markdown table of the run."""
    lines = [f"| variant | s per outer step ({args.sync_every} inner steps + sync) | s per inner "
             f"step equivalent | blocked in sync, s per outer step | loss after {args.steps} "
             "inner steps | ranks' weights equal | others' load (cores) |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for result in results:
        if "error" in result:
            said = result["error"].splitlines()[0].replace("|", "/")[:150]
            lines.append(f"| {result['label']} | failed: {said} | | | | | |")
            continue
        sync = "-" if result["sync_s"] is None else f"{result['sync_s']:.2f}"
        flags = "" if result["all_committed"] else f" (committed {result['committed']})"
        lines.append(f"| {result['label']} | {result['outer_s']:.2f} | {result['inner_s']:.3f} | "
                     f"{sync} | {result['eval_loss']:.5f}{flags} | "
                     f"{'yes' if result['replicas_equal'] else 'no'} | "
                     f"{result['foreign_cores']:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="inner steps per variant")
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1, help="outer steps left out of the median")
    parser.add_argument("--fragments", type=int, default=2, help="Streaming DiLoCo's fragments")
    parser.add_argument("--delay", type=int, default=2,
                        help="Streaming DiLoCo's fragment_sync_delay (inner steps)")
    parser.add_argument("--rate", default="2gbit", help="the link, each way (tc syntax)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="per rank")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated, of: " + ", ".join(VARIANTS))
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="torchft's (and DDP's) collective timeout")
    parser.add_argument("--deadline-s", type=float, default=300.0,
                        help="the most one variant's ranks may take")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of all variants; the table shows, per variant, the "
                        "round other processes loaded least")
    parser.add_argument("--json", action="store_true",
                        help="print the raw records (the table then goes to stderr)")
    args = parser.parse_args(argv)
    topology.check_rate(args.rate)
    chosen = [VARIANTS[name] for name in args.variants.split(",") if name]
    if args.steps % args.sync_every or args.steps // args.sync_every <= max(1, args.warmup):
        parser.error("--steps must be a multiple of --sync-every, with outer steps after "
                     "--warmup")
    if any(v.streaming for v in chosen) and (
            args.sync_every % args.fragments or args.layers % args.fragments
            or args.delay >= args.sync_every // args.fragments):
        parser.error("Streaming DiLoCo needs --fragments to divide --sync-every and --layers, "
                     "and --delay < sync_every / fragments")
    reason = topology.namespaces_unavailable(shaped=True)
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    signals_unwind()
    topology.sweep_stale()
    load_before = load_average()
    runs: list[dict[str, Any]] = []
    for round_ in range(args.repeat):  # variants take turns, round by round
        for variant in chosen:
            meter = LoadMeter()
            try:
                result = summarize(variant, run_variant(variant, args), args)
            except (RuntimeError, OSError, ValueError, KeyError, IndexError) as exc:
                result = {"variant": variant.name, "error": str(exc),
                          "label": variant.label(args.fragments, args.delay)}
            result.update(foreign_cores=meter.foreign_cores(), round=round_)
            runs.append(result)
            print(f"round {round_}, {variant.name}: " + (
                f"failed: {result['error']}" if "error" in result else
                f"{result['outer_s']:.2f} s per outer step, others' load "
                f"{result['foreign_cores']:.1f} cores"), file=sys.stderr, flush=True)
    results = [least_disturbed([r for r in runs if r["variant"] == v.name]) for v in chosen]
    load_after = load_average()
    parameters = next((r["parameters"] for r in results if "parameters" in r), "?")
    # With --json the records go to stdout, the table to stderr.
    out = sys.stderr if args.json else sys.stdout
    print(f"{cpu_model()}, {os.cpu_count()} cores; two network namespaces, veth shaped "
          f"to {args.rate} each way; {parameters} float32 parameters "
          f"({args.layers} x Linear({args.width}, {args.width})), batch {args.batch} "
          f"per rank; load average before {load_before}, after {load_after}\n", file=out)
    print("\n".join(table(results, args)), file=out)
    if args.json:
        print(json.dumps({"load_before": load_before, "load_after": load_after,
                          "cpu": cpu_model(), "cores": os.cpu_count(), "args": vars(args),
                          "results": results, "runs": runs}, indent=1))
    return 1 if any("error" in r or not r["all_committed"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
