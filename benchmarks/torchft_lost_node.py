"""torchft when a node is lost: time from the failure to the survivors' next
committed step, torchft on gradsync vs torchft on its own ProcessGroupGloo.

Three "nodes" (network namespaces on a bridge, 10.213.50.0/24), one replica
group of one rank on each, the Lighthouse on node 0, and for gradsync one
daemon per node with the shipped defaults (`--insecure` only; `--peer-timeout-s
S` adds that flag, for a tuned figure).  torchft's collective timeout is its
default, 60 s.  Two failures, each in a fresh set of nodes:

* `cut`: replica 2 stops mid-step (the others wait in the step's allreduces)
  and its node's link goes down (`ip link set ... down`): nothing closes, so
  gloo can only wait for the timeout; gradsync's daemons' failure detector
  declares the peer lost and fails the step on every node at once.
* `sigkill`: replica 2 SIGKILLs itself between two allreduces of a step: its
  sockets close, which both see.

The replicas are tests/programs/torchft_replica.py (the tests' own program).
Prints a markdown table; `--json` for the raw records.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import topology
from benchmarks.private_daemon import daemon_cluster
from benchmarks.processes import clean_env

REPLICA = Path(__file__).resolve().parents[1] / "tests" / "programs" / "torchft_replica.py"
LIGHTHOUSE = REPLICA.with_name("lighthouse.py")
STEPS = 12
FAIL_AT = 4
LIGHTHOUSE_PORT = topology.NETNS_BASE_PORT + 90


def records(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def wait_for(path: Path, timeout_s: float, processes: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0, -9) for p in processes):
            raise RuntimeError(f"no {path.name} marker within {timeout_s} s")
        time.sleep(0.05)


def run_once(
    pg: str, failure: str, timeout_s: float, peer_timeout_s: float | None = None
) -> dict[str, Any]:
    """One training run of three replicas with `failure` at step FAIL_AT."""
    with contextlib.ExitStack() as stack:
        topo = stack.enter_context(topology.namespaces(3))
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gs-ft-")))
        markers = folder / "markers"
        markers.mkdir()
        daemons: list[str] = ["-"] * 3
        if pg == "gradsync":
            endpoints = topo.endpoints()[0]
            tuned = [] if peer_timeout_s is None else ["--peer-timeout-s", str(peer_timeout_s)]
            flags = [["--listen", endpoints[i], "--peers", ",".join(endpoints), "--insecure",
                      *tuned] for i in range(3)]
            runs = stack.enter_context(daemon_cluster(flags, [topo.prefix(i) for i in range(3)]))
            daemons = [run.endpoint for run in runs]
        lighthouse = subprocess.Popen(
            [*topo.prefix(0), sys.executable, str(LIGHTHOUSE), str(LIGHTHOUSE_PORT), "2",
             "1000"], stdout=subprocess.PIPE, text=True)
        replicas: list[subprocess.Popen[str]] = []

        def stop_all() -> None:
            for process in [*replicas, lighthouse]:
                if process.poll() is None:
                    process.kill()
                    process.communicate()

        stack.callback(stop_all)  # before the namespaces and daemons go
        assert lighthouse.stdout is not None and lighthouse.stdout.readline() == "ready\n"
        for replica in range(3):
            victim = replica == 2
            mode = ("stall" if failure == "cut" else "1") if victim else "0"
            env = clean_env(GRADSYNC_DAEMON=daemons[replica],
                            TORCHFT_LIGHTHOUSE=f"http://{topo.hosts[0]}:{LIGHTHOUSE_PORT}",
                            GRADSYNC_JOB="bench-torchft", REPLICA_HOST=topo.hosts[replica],
                            REPLICA_PG=pg, REPLICA_TIMEOUT_S=str(timeout_s),
                            REPLICA_INIT_SYNC="0", REPLICA_TRANSPORT="pg",
                            GLOO_SOCKET_IFNAME=topo.interfaces[replica],
                            OMP_NUM_THREADS="1")
            replicas.append(subprocess.Popen(
                [*topo.prefix(replica), sys.executable, str(REPLICA), f"replica{replica}",
                 str(STEPS), str(FAIL_AT if victim else -1), mode, str(markers), "3"],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        try:
            wait_for(markers / "killed", 120, replicas)
        except RuntimeError as exc:
            for process in replicas:
                process.kill()
            said = [process.communicate() for process in replicas]
            raise RuntimeError(f"{exc}\n" + "\n".join(
                f"replica {r}:\n{out[-2000:]}\n{err[-3000:]}"
                for r, (out, err) in enumerate(said))) from None
        if failure == "cut":
            time.sleep(0.5)  # the survivors are in the step's allreduces by now
            failed_at = time.time()
            subprocess.run(["ip", "-n", str(topo.namespaces[2]), "link", "set",
                            topo.interfaces[2], "down"], check=True, timeout=30)
        else:
            out, err = replicas[2].communicate(timeout=60)
            failed_at = next(r["sigkill_t"] for r in records(out) if "sigkill_t" in r)
        survivors = []
        for replica in replicas[:2]:
            out, err = replica.communicate(timeout=timeout_s * 3 + 120)
            if replica.returncode != 0:
                raise RuntimeError(f"a survivor exited {replica.returncode}:\n{out[-3000:]}\n"
                                   f"{err[-3000:]}")
            survivors.append(records(out))
    recoveries = []
    errors = []
    for survivor in survivors:
        after = [r for r in survivor if "step" in r and r["t"] > failed_at]
        committed = next(r for r in after if r["committed"])
        recoveries.append(committed["t"] - failed_at)
        errors.extend(r["error"] for r in after if not r["committed"] and r["error"])
        if committed["participants"] != 2:
            raise RuntimeError(f"first step after the failure had {committed['participants']}")
    finals = [next(r for r in s if "final_step" in r) for s in survivors]
    if finals[0]["checksum"] != finals[1]["checksum"]:
        raise RuntimeError(f"survivors differ: {finals}")
    return {"pg": pg, "failure": failure, "recovery_s": recoveries,
            "error": errors[0] if errors else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="torchft's collective timeout (its default: 60)")
    parser.add_argument("--peer-timeout-s", type=float, default=None,
                        help="gradsyncd's --peer-timeout-s (default: the daemons' own "
                        "default; a figure with it set is a tuned one)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    reason = topology.namespaces_unavailable()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    results = [run_once(pg, failure, args.timeout_s, args.peer_timeout_s)
               for failure in ("cut", "sigkill") for pg in ("gradsync", "gloo")]
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print("| failure | process group | failure to next committed step (s), survivors "
          "0 and 1 | gloo / gradsync | error the survivors' step failed with |")
    print("| --- | --- | --- | --- | --- |")
    by = {(r["failure"], r["pg"]): r for r in results}
    for failure in ("cut", "sigkill"):
        base = max(by[(failure, "gradsync")]["recovery_s"])
        for pg in ("gradsync", "gloo"):
            result = by[(failure, pg)]
            times = " / ".join(f"{t:.1f}" for t in result["recovery_s"])
            ratio = f"{max(result['recovery_s']) / base:.1f}x" if pg == "gloo" else "-"
            said = (result["error"] or "").replace("|", "/").replace("\n", " ")[:160]
            print(f"| {failure} | {pg} | {times} | {ratio} | {said} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
