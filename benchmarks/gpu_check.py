"""GPU check: gradsync's device buffers on one GPU, within --budget-s (default 390 s).

    python -m benchmarks.gpu_check --out DIR

Starts a private gradsyncd in a temp folder, then runs rank programs
(`python -m benchmarks.gpu_rank`) as subprocesses that share GPU 0 through CUDA IPC:

1. all_reduce with 2 and 4 ranks: sum, avg, min, max, prod × float16,
   bfloat16, float32, float64, int8, uint8, int32, int64 (avg: floats) × 1,
   1000 and 2^20 elements, on `Client.empty(device=0)` slabs, ordinary cupy
   arrays and torch tensors (on side streams; staged through the scratch slab)
   and numpy arrays (the host path, as a control), against float64 references;
2. the other collectives with 2 ranks: broadcast, reduce, all_gather,
   reduce_scatter, gather, scatter, all_to_all (rooted ones from root 0 and 1) ×
   float32, bfloat16, float16 × 1 and 1000 elements per rank, on
   `Client.empty(device=0)` slabs, ordinary cupy arrays and torch tensors,
   against host references (copies exact, sums within the dtype's rounding);
3. `DistributedDataParallel` on a CUDA model against one process trained on
   the whole batch ("unsupported" while DDP refuses CUDA modules);
4. timing, reported and not asserted: device copy bandwidth, the hand-over of
   an ordinary cupy array (a copy into the scratch slab and one back), and
   all_reduce of `empty(device=0)` buffers with 2 and 4 ranks, against the
   issue's targets (hand-over ≥ 80 % of copy bandwidth, reduction ≥ 70 %);
5. failure: a rank SIGKILLs itself after submitting an all_reduce (2 and 4
   ranks) or before (2 ranks); the others must get a GradsyncError within
   the collective deadline (20 s) plus a margin; then the daemon must serve a
   new job, and exit 0 on SIGTERM with no shared-memory segment left.

Prints a short table last; with --out, writes gpu_check.json (every number),
gpu_check.md (a section for benchmarks/RESULTS.md) and logs/ (the daemon's
log, the ranks' non-empty stderr).  Exit status: 0 when every correctness
check passed ("unsupported" included), 1 otherwise, 2 at once when this
machine has no cupy or no CUDA device.  Run it from the repository root;
gradsync need not be installed when <repo>/.mypy-src is on PYTHONPATH
(`PYTHONPATH=.mypy-src python -m benchmarks.gpu_check ...`): it goes first on
the children's PYTHONPATH either way.
`--host` runs the same plumbing on host buffers, without a GPU (for work on
this script; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from typing import Any

from benchmarks.plan import format_size
from benchmarks.processes import clean_env, module_command, signals_unwind, stop_group
from benchmarks.report import format_time
from gradsync.client.daemon_process import DaemonProcess, DaemonStartError, start_daemon

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SRC = os.path.join(REPO, ".mypy-src")  # gradsync/{protocol,daemon,client}: symlinks to the code

MIB = 1 << 20
MATRIX_SIZES = (1, 1000, 1 << 20)
HOST_MATRIX_SIZES = (1, 1000, 1 << 16)
#: Elements per rank (chunk) of the collectives phase.
COLLECTIVE_CHUNKS = (1, 1000)
COLLECTIVES_WORLD = 2
TIMING_SIZES = tuple(MIB << (2 * i) for i in range(6))  # 1 MiB .. 1 GiB
HOST_TIMING_SIZES = (MIB, 4 * MIB, 16 * MIB)
TIMING_SAMPLES = 7
#: The targets are judged from this size up.
LARGE = 256 * MIB
HANDOVER_TARGET = 0.80
REDUCTION_TARGET = 0.70
#: Collective deadline of the failure phases, and how long the survivors' error may take.
FAIL_TIMEOUT_S = 20.0
FAIL_DEADLINE_S = FAIL_TIMEOUT_S + 15.0
#: Per phase: the longest its ranks may run (the first one compiles the daemon's kernels).
PHASE_TIMEOUT_S = {"allreduce": 180.0, "collectives": 90.0, "ddp": 120.0, "copy": 120.0,
                   "reduce": 90.0, "fail": 75.0, "new-job": 60.0}
#: After a rank exits unexpectedly, the others get this long to report, not the whole timeout.
GRACE_S = 30.0
MIN_PHASE_S = 20.0
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
OK_STATUSES = ("pass", "unsupported")
SECTION = "gpu_check"  # of benchmarks/RESULTS.md


@dataclasses.dataclass
class Check:
    """One correctness check: pass, fail, unsupported or skipped (no time left)."""

    name: str
    status: str
    detail: str = ""


def child_env() -> dict[str, str]:
    """This environment without GRADSYNC_* (flags say everything), .mypy-src first on
    PYTHONPATH, unbuffered output."""
    paths = [SRC, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return clean_env(PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)), PYTHONUNBUFFERED="1",
                     OMP_NUM_THREADS="1")


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -- the daemon --------------------------------------------------------------------------


class Daemon:
    """The private gradsyncd: started in `folder` by the project's launcher
    (`gradsync.client.daemon_process`), awaited by pinging, stopped by SIGTERM."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.endpoint = f"ipc://{folder}/d.sock"
        self.log_path = os.path.join(folder, "gradsyncd.log")
        self.run: DaemonProcess | None = None
        self.exit_code: int | None = None
        self.killed = False
        self.leaked: list[str] = []

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self.run.process if self.run is not None else None

    def start(self) -> None:
        """Start it and wait until it answers a ping; DaemonStartError if it does not."""
        self.run = start_daemon(self.endpoint, folder=self.folder, log_path=self.log_path,
                                env=child_env(), cwd=REPO, new_session=True)
        try:
            self.run.wait_ready(READY_TIMEOUT_S, poll_s=0.05)
        except DaemonStartError as exc:
            raise DaemonStartError(f"{exc}: {self.log_tail()}", exc.exit_code) from None

    def alive(self) -> bool:
        return self.run is not None and self.run.alive()

    def stop(self) -> None:
        """SIGTERM (SIGKILL after a grace), then sweep its /dev/shm segments."""
        if self.run is None:
            return
        self.exit_code = self.run.stop(STOP_TIMEOUT_S)
        self.killed = self.run.killed
        self.leaked = self.run.sweep_segments()

    def log_tail(self, lines: int = 8) -> str:
        try:
            with open(self.log_path, errors="replace") as log:
                return one_line(" | ".join(log.read().splitlines()[-lines:]), 800)
        except OSError:
            return ""


# -- rank programs -----------------------------------------------------------------------


@dataclasses.dataclass
class Rank:
    rank: int
    process: subprocess.Popen[bytes]
    out_path: str
    err_path: str

    def record(self) -> dict[str, Any] | None:
        """The last JSON line the rank printed, if any."""
        with contextlib.suppress(OSError), open(self.out_path, errors="replace") as out:
            for line in reversed(out.read().splitlines()):
                if line.startswith("{"):
                    with contextlib.suppress(ValueError):
                        record = json.loads(line)
                        return record if isinstance(record, dict) else None
        return None

    def stderr_tail(self, chars: int = 400) -> str:
        """The end of its stderr on one line (a traceback's last lines: the error)."""
        try:
            with open(self.err_path, errors="replace") as err:
                text = " ".join(err.read()[-chars * 8 :].split())
        except OSError:
            return ""
        return text if len(text) <= chars else "…" + text[-chars + 1 :]


@dataclasses.dataclass
class Phase:
    """One run of a rank program on `world` ranks, and how its processes ended."""

    name: str
    ranks: list[Rank]
    problem: str | None  # None: every rank exited as expected
    seconds: float

    def records(self) -> list[dict[str, Any] | None]:
        return [rank.record() for rank in self.ranks]

    def failed_check(self, name: str) -> Check:
        """The check `name` when this phase gave no result: skipped (no time) or failed."""
        return Check(name, "fail" if self.ranks else "skipped", self.failure())

    def failure(self) -> str:
        """Why the phase gives no result: the problem, and the first rank's error."""
        parts = [self.problem or "a rank printed no result"]
        for rank in self.ranks:
            if rank.process.returncode not in (0, -signal.SIGKILL) or rank.record() is None:
                tail = rank.stderr_tail()
                if tail:
                    parts.append(f"rank {rank.rank}: {tail}")
                    break
        return "; ".join(parts)


def wait_ranks(ranks: Sequence[Rank], timeout_s: float, killed: Iterable[int]) -> str | None:
    """None once every rank exited as expected (0; SIGKILL for `killed`); else what went
    wrong.  After an unexpected exit the others get GRACE_S, not the whole timeout."""
    expected = {rank.rank: -signal.SIGKILL if rank.rank in set(killed) else 0 for rank in ranks}
    deadline = time.monotonic() + timeout_s
    while True:
        codes = {rank.rank: rank.process.poll() for rank in ranks}
        bad = {r: c for r, c in codes.items() if c is not None and c != expected[r]}
        shown = ", ".join(f"rank {r} exited {c}" for r, c in sorted(bad.items()))
        if all(code is not None for code in codes.values()):
            return shown or None
        if bad:
            deadline = min(deadline, time.monotonic() + GRACE_S)
        if time.monotonic() > deadline:
            hung = [r for r, c in sorted(codes.items()) if c is None]
            return "; ".join(filter(None, [shown, f"rank(s) {hung} still running: stopped"]))
        time.sleep(0.05)


class Runner:
    """Runs rank programs against the daemon, one phase at a time, within the time budget."""

    def __init__(self, daemon: Daemon, folder: str, deadline: float, host: bool) -> None:
        self.daemon = daemon
        self.folder = folder
        self.deadline = deadline
        self.host = host
        self.phases: list[Phase] = []

    def run(self, name: str, role: str, world: int, args: Sequence[str] = (),
            killed: Sequence[int] = ()) -> Phase:
        timeout_s = min(PHASE_TIMEOUT_S.get(name, PHASE_TIMEOUT_S[role]),
                        self.deadline - time.monotonic())
        if timeout_s < MIN_PHASE_S:
            phase = Phase(name, [], "skipped: the run's time budget is spent", 0.0)
        else:
            phase = self._run(name, role, world, args, killed, timeout_s)
        self.phases.append(phase)
        print(f"gpu_check: {name} ({world} rank{'s' if world > 1 else ''}): "
              f"{phase.problem or 'done'}, {phase.seconds:.1f} s", flush=True)
        return phase

    def _run(self, name: str, role: str, world: int, args: Sequence[str],
             killed: Sequence[int], timeout_s: float) -> Phase:
        ranks: list[Rank] = []
        start = time.monotonic()
        try:
            for rank in range(world):
                ranks.append(self._spawn(name, role, rank, world, args))
            problem = wait_ranks(ranks, timeout_s, killed)
        finally:
            for rank in ranks:
                stop_group(rank.process)
        return Phase(name, ranks, problem, time.monotonic() - start)

    def _spawn(self, name: str, role: str, rank: int, world: int, args: Sequence[str]) -> Rank:
        command = [
            *module_command("gpu_rank", role), "--daemon", self.daemon.endpoint,
            "--job", f"gpu-check-{name}", "--rank", str(rank), "--world", str(world),
            "--device", "host" if self.host else "cuda", *args,
        ]
        out_path = os.path.join(self.folder, f"{name}-r{rank}.out")
        err_path = os.path.join(self.folder, f"{name}-r{rank}.err")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                       env=child_env(), cwd=REPO, start_new_session=True)
        return Rank(rank, process, out_path, err_path)


# -- correctness -------------------------------------------------------------------------


def case_label(case: dict[str, Any]) -> str:
    """`kind op dtype[count] (what went wrong, on which ranks)`."""
    text = f"{case['kind']} {case['op']} {case['dtype']}[{case['count']}]"
    problems: dict[str, list[int]] = {}
    for rank in case["ranks"]:
        if rank.get("error"):
            problem = one_line(rank["error"], 160)
        elif not rank["ok"]:
            err = f", max err {rank['max_err']:.3g}" if "max_err" in rank else ""
            problem = f"{rank.get('wrong')} wrong{err}"
        else:
            continue
        problems.setdefault(problem, []).append(rank["rank"])
    shown = "; ".join(f"rank {','.join(map(str, ranks))}: {problem}"
                      for problem, ranks in problems.items())
    return f"{text} ({shown})" if shown else text


def merge_cases(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per case: right only if right on every rank."""
    merged = []
    for per_rank in zip(*(record["cases"] for record in records), strict=False):
        first = per_rank[0]
        ranks = [{"rank": index, **{k: v for k, v in case.items()
                                    if k not in ("kind", "op", "dtype", "count")}}
                 for index, case in enumerate(per_rank)]
        merged.append({"kind": first["kind"], "op": first["op"], "dtype": first["dtype"],
                       "count": first["count"], "ok": all(c["ok"] for c in per_rank),
                       "ranks": ranks})
    return merged


def matrix_check(name: str, phase: Phase) -> tuple[Check, dict[str, Any]]:
    """A check from an `allreduce` phase: every case right on every rank."""
    records = phase.records()
    if phase.problem or not records or any(r is None for r in records):
        return phase.failed_check(name), {"seconds": phase.seconds}
    present = [r for r in records if r is not None]
    cases = merge_cases(present)
    wrong = [case for case in cases if not case["ok"]]
    detail = f"{len(cases) - len(wrong)}/{len(cases)} cases right"
    if len({len(r["cases"]) for r in present}) > 1:
        wrong.append({"kind": "-", "op": "-", "dtype": "-", "count": "-", "ranks": []})
        detail += "; ranks ran different numbers of cases"
    if wrong:
        shown = "; ".join(case_label(case) for case in wrong[:5])
        detail += f"; wrong: {shown}" + (f"; … {len(wrong) - 5} more" if len(wrong) > 5 else "")
    status = "pass" if cases and not wrong else "fail"
    return Check(name, status, detail), {"seconds": phase.seconds, "cases": cases}


def check_matrix(runner: Runner, world: int) -> tuple[Check, dict[str, Any]]:
    from benchmarks.gpu_rank import DEVICE_KINDS, HOST_KINDS

    sizes = HOST_MATRIX_SIZES if runner.host else MATRIX_SIZES
    kinds = HOST_KINDS if runner.host else DEVICE_KINDS
    phase = runner.run(f"allreduce-{world}", "allreduce", world,
                       ["--sizes", ",".join(map(str, sizes)), "--kinds", ",".join(kinds)])
    return matrix_check(f"all_reduce matrix, {world} ranks", phase)


def check_collectives(runner: Runner) -> tuple[Check, dict[str, Any]]:
    """broadcast .. all_to_all, every root, on device buffers (host ones with --host)."""
    from benchmarks.gpu_rank import (
        COLLECTIVE_DEVICE_KINDS,
        COLLECTIVE_DTYPES,
        COLLECTIVES,
        HOST_KINDS,
    )

    world = COLLECTIVES_WORLD
    kinds = HOST_KINDS if runner.host else COLLECTIVE_DEVICE_KINDS
    phase = runner.run(f"collectives-{world}", "collectives", world,
                       ["--collectives", ",".join(COLLECTIVES),
                        "--dtypes", ",".join(COLLECTIVE_DTYPES),
                        "--sizes", ",".join(map(str, COLLECTIVE_CHUNKS)),
                        "--kinds", ",".join(kinds), "--timeout-s", "30"])
    return matrix_check(f"collectives (broadcast .. all_to_all), {world} ranks", phase)


def check_ddp(runner: Runner) -> tuple[list[Check], dict[str, Any]]:
    phase = runner.run("ddp", "ddp", 2)
    records = phase.records()
    name = "DDP, 2 ranks, vs one process"
    if phase.problem or any(r is None for r in records) or not records:
        return [phase.failed_check(name)], {}
    present = [r for r in records if r is not None]
    refusals = [r["unsupported"] for r in present if "unsupported" in r]
    if refusals:
        status = "unsupported" if len(refusals) == len(present) else "fail"
        return [Check(name, status, one_line(refusals[0]))], {"unsupported": refusals[0]}
    checks = []
    for scenario in present[0]["scenarios"]:
        runs = [r["scenarios"][scenario] for r in present]
        worst, tolerance = max(run["err"] for run in runs), runs[0]["tolerance"]
        same = len({run["digest"] for run in runs}) == 1
        same_start = len({run["initial"] for run in runs}) == 1
        status = "pass" if worst <= tolerance and same and same_start else "fail"
        detail = (f"max error {worst:.2g} (tolerance {tolerance:g}); ranks "
                  f"{'identical' if same else 'DIFFER'}"
                  f"{'' if same_start else '; rank 0 not broadcast at construction'}")
        checks.append(Check(f"DDP {scenario}, 2 ranks, vs one process", status, detail))
    return checks, {"scenarios": {s: [r["scenarios"][s] for r in present]
                                  for s in present[0]["scenarios"]}}


def check_failure(runner: Runner, mode: str, world: int) -> tuple[Check, dict[str, Any]]:
    """The last rank SIGKILLs itself; every other rank must get a GradsyncError in time."""
    name = f"rank killed {mode.replace('-', ' ')}, {world} ranks: the others get an error"
    lock = os.path.join(runner.folder, f"victim-{mode}-{world}.lock")
    phase = runner.run(f"fail-{mode}-{world}", "fail", world,
                       ["--mode", mode, "--lock", lock, "--timeout-s", f"{FAIL_TIMEOUT_S:g}"],
                       killed=[world - 1])
    survivors = phase.records()[:-1]
    if phase.problem or not survivors or any(r is None for r in survivors):
        return phase.failed_check(name), {}
    present = [r for r in survivors if r is not None]
    in_time = all(r["error"] and r["seconds"] <= FAIL_DEADLINE_S for r in present)
    detail = "; ".join(
        f"rank {r['rank']}: {r['error'] or 'NO ERROR'} after {r['seconds']:.1f} s"
        + ("" if r["unchanged"] else ", buffer changed")
        + ("" if r.get("victim_died", True) else ", victim still alive")
        for r in present)
    return Check(name, "pass" if in_time else "fail", detail), {"survivors": present}


def check_new_job(runner: Runner) -> tuple[list[Check], dict[str, Any]]:
    alive = runner.daemon.alive()
    kinds = "host-empty,numpy" if runner.host else "empty,cupy,numpy"
    phase = runner.run("new-job", "allreduce", 2,
                       ["--ops", "sum,max", "--dtypes", "float32,int32", "--sizes", "1000",
                        "--kinds", kinds])
    check, data = matrix_check("the daemon serves a new job after the failures", phase)
    survived = Check("the daemon survived the killed ranks", "pass" if alive else "fail",
                     "" if alive else runner.daemon.log_tail())
    return [survived, check], data


def daemon_checks(daemon: Daemon) -> list[Check]:
    if daemon.process is None:
        return []
    clean = daemon.exit_code == 0 and not daemon.killed
    detail = "" if clean else (f"exit status {daemon.exit_code}"
                               f"{' (SIGKILLed after ignoring SIGTERM)' if daemon.killed else ''}"
                               f": {daemon.log_tail()}")
    return [
        Check("gradsyncd exits 0 on SIGTERM", "pass" if clean else "fail", detail),
        Check("no shared-memory segment left", "fail" if daemon.leaked else "pass",
              ", ".join(daemon.leaked)),
    ]


# -- timing ------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def measure_copy(runner: Runner, sizes: Sequence[int]) -> tuple[Check, list[dict[str, Any]]]:
    """Copy, hand-over and empty() round trip, world 1."""
    phase = runner.run("copy", "copy", 1,
                       ["--sizes", ",".join(map(str, sizes)), "--samples", str(TIMING_SAMPLES)])
    name = "timing, 1 rank: hand-over and empty() results right"
    record = phase.records()[0] if phase.ranks else None
    if phase.problem or record is None:
        return phase.failed_check(name), []
    rows = []
    for row in record["rows"]:
        size = row["bytes"]
        copy_s, handover_s = median(row["copy_s"]), median(row["handover_s"])
        copy_bw = size / copy_s
        rows.append({"bytes": size, "copy_s": copy_s, "copy_gbps": copy_bw / 1e9,
                     "handover_s": handover_s, "handover_gbps": 2 * size / handover_s / 1e9,
                     "handover_pct": 100 * (2 * size / handover_s) / copy_bw,
                     "round_trip_s": median(row["round_trip_s"]), "repeat": row["repeat"],
                     "correct": row["correct"], "samples": row})
    wrong = [format_size(r["bytes"]) for r in rows if not r["correct"]]
    return Check(name, "fail" if wrong else "pass", f"wrong at {', '.join(wrong)}" if wrong
                 else f"{len(rows)} sizes"), rows


def measure_reduction(runner: Runner, world: int, sizes: Sequence[int],
                      copy_rows: Sequence[dict[str, Any]]) -> tuple[Check, list[dict[str, Any]]]:
    """All-reduce of empty(device=0) slabs: per sample the slowest rank, then the median."""
    phase = runner.run(f"reduce-{world}", "reduce", world,
                       ["--sizes", ",".join(map(str, sizes)), "--samples", str(TIMING_SAMPLES)])
    name = f"timing, {world} ranks: all_reduce results right"
    records = phase.records()
    if phase.problem or not records or any(r is None for r in records):
        return phase.failed_check(name), []
    present = [r for r in records if r is not None]
    copy_bw = {row["bytes"]: row["copy_gbps"] * 1e9 for row in copy_rows}
    rows = []
    for index, size in enumerate(sizes):
        per_rank = [r["rows"][index] for r in present]
        slowest = [max(samples) for samples in zip(*(p["seconds"] for p in per_rank),
                                                   strict=True)]
        seconds = median(slowest)
        algbw = size / seconds
        needed = 2 * world * size / seconds  # every slot read once and written once
        moved = 5 * (world - 1) * size / seconds  # pairwise combines + copies back
        reference = copy_bw.get(size)
        rows.append({
            "ranks": world, "bytes": size, "time_s": seconds, "algbw_gbps": algbw / 1e9,
            "algbw_pct": 100 * algbw / reference if reference else None,
            "rw_gbps": needed / 1e9,
            "rw_pct": 100 * needed / (2 * reference) if reference else None,
            "moved_pct": 100 * moved / (2 * reference) if reference else None,
            "correct": all(p["correct"] for p in per_rank), "slowest_s": slowest,
        })
    wrong = [format_size(r["bytes"]) for r in rows if not r["correct"]]
    return Check(name, "fail" if wrong else "pass", f"wrong at {', '.join(wrong)}" if wrong
                 else f"{len(rows)} sizes"), rows


def targets(copy_rows: Sequence[dict[str, Any]],
            reduction_rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, judged on the sizes from LARGE up: met, missed, or not measured."""
    def judge(what: str, target: float, pcts: list[float | None]) -> dict[str, Any]:
        known = [p for p in pcts if p is not None]
        worst = min(known) if known else None
        verdict = "not measured" if worst is None else (
            "met" if worst >= 100 * target else "missed")
        return {"what": what, "target_pct": 100 * target, "worst_pct": worst,
                "verdict": verdict}

    found = [judge("hand-over (2 × bytes / time) vs copy", HANDOVER_TARGET,
                   [r["handover_pct"] for r in copy_rows if r["bytes"] >= LARGE])]
    for world in sorted({r["ranks"] for r in reduction_rows}):
        found.append(judge(f"reduction, {world} ranks (r+w) vs copy", REDUCTION_TARGET,
                           [r["rw_pct"] for r in reduction_rows
                            if r["ranks"] == world and r["bytes"] >= LARGE]))
    return found


# -- the run -----------------------------------------------------------------------------


def run_phases(runner: Runner, checks: list[Check], data: dict[str, Any]) -> None:
    """Correctness first, then timing, then the failures (they may break the daemon)."""
    for world in (2, 4):
        check, found = check_matrix(runner, world)
        checks.append(check)
        data[f"allreduce_{world}"] = found
    check, data[f"collectives_{COLLECTIVES_WORLD}"] = check_collectives(runner)
    checks.append(check)
    ddp_checks, data["ddp"] = check_ddp(runner)
    checks.extend(ddp_checks)

    sizes = HOST_TIMING_SIZES if runner.host else TIMING_SIZES
    check, copy_rows = measure_copy(runner, sizes)
    checks.append(check)
    reduction_rows: list[dict[str, Any]] = []
    for world in (2, 4):
        check, rows = measure_reduction(runner, world, sizes, copy_rows)
        checks.append(check)
        reduction_rows.extend(rows)
    data["timing"] = {"copy": copy_rows, "reduction": reduction_rows,
                      "targets": targets(copy_rows, reduction_rows)}

    data["failures"] = {}
    for mode, world in (("after-submit", 2), ("after-submit", 4), ("before-submit", 2)):
        check, found = check_failure(runner, mode, world)
        checks.append(check)
        data["failures"][f"{mode}-{world}"] = found
    new_job_checks, data["new_job"] = check_new_job(runner)
    checks.extend(new_job_checks)


def run_with_daemon(folder: str, deadline: float,
                    host: bool) -> tuple[list[Check], dict[str, Any], list[Phase]]:
    """Start the daemon, run every phase, stop it: the checks, the numbers, the phases."""
    checks: list[Check] = []
    data: dict[str, Any] = {}
    daemon = Daemon(folder)
    runner = Runner(daemon, folder, deadline, host)
    try:
        daemon.start()
        run_phases(runner, checks, data)
    except DaemonStartError as exc:
        checks.append(Check("gradsyncd starts and answers", "fail", str(exc)))
    finally:
        daemon.stop()
        checks.extend(daemon_checks(daemon))
    return checks, data, runner.phases


def machine(host: bool) -> dict[str, Any]:
    """What ran: GPU, CUDA, library versions."""
    info: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    for package in ("numpy", "torch"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info[package] = importlib.metadata.version(package)
    if host:
        info["gpu"] = "none (--host: host buffers)"
        return info
    try:
        import cupy

        runtime = cupy.cuda.runtime
        properties = runtime.getDeviceProperties(0)
        name = properties["name"]
        info["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
        info["gpu_memory_gib"] = round(properties["totalGlobalMem"] / 2**30, 1)
        info["cupy"] = cupy.__version__
        for key, version in (("cuda_runtime", runtime.runtimeGetVersion()),
                             ("cuda_driver", runtime.driverGetVersion())):
            info[key] = f"{version // 1000}.{version % 1000 // 10}"
    except Exception as exc:  # a description only: never fail the run for it
        info.setdefault("gpu", f"unknown ({type(exc).__name__}: {exc})")
    return info


def describe_machine(info: dict[str, Any]) -> str:
    parts = [str(info.get("gpu", "?"))]
    if "gpu_memory_gib" in info:
        parts[0] += f" ({info['gpu_memory_gib']} GiB)"
    if "cuda_runtime" in info:
        parts.append(f"CUDA {info['cuda_runtime']} (driver {info.get('cuda_driver', '?')})")
    parts += [f"{name} {info[name]}" for name in ("cupy", "torch", "numpy") if name in info]
    parts.append(f"Python {info['python']}, {info['cpus']} cores")
    return ", ".join(parts)


def preflight() -> str | None:
    """Why this machine cannot run the check (no cupy, no CUDA device), or None."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a cupy that cannot load its CUDA libraries
        return f"cupy is not importable ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no driver, no device
        return f"no usable CUDA device ({type(exc).__name__}: {exc})"
    return None if count > 0 else "no CUDA device"


# -- reporting ---------------------------------------------------------------------------


def pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f} %"


def gbps(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def table_cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(result: dict[str, Any]) -> str:
    """The gpu_check section for benchmarks/RESULTS.md."""
    lines = [
        "# GPU check: device buffers on one GPU", "",
        f"Recorded {result['date']}, {result['seconds']:.0f} s in all, on "
        f"{describe_machine(result['machine'])}. Reproduce from the repository root "
        "(through the device tool: see benchmarks/README.md, \"GPU check\"):", "",
        "```", result["command"], "```", "",
        "| check | result | detail |", "|---|---|---|",
    ]
    lines += [f"| {c['name']} | {c['status']} | {table_cell(c['detail'])} |"
              for c in result["checks"]]
    timing = result["data"].get("timing", {})
    if timing.get("copy"):
        lines += [
            "", "Timing, float32, median of the samples (slowest rank per sample). copy: "
            "`cupy.copyto` device to device, bytes copied per second. hand-over: a 1-rank "
            "all_reduce of an ordinary cupy array, 2 × bytes per second (a copy into the "
            "scratch slab and one back). empty() op: a 1-rank all_reduce of an "
            "`empty(device=0)` slab (no copy: the round trip to the daemon).", "",
            "| size | copy GB/s | hand-over GB/s | hand-over % copy | empty() op |",
            "|---:|---:|---:|---:|---:|",
        ]
        lines += [f"| {format_size(r['bytes'])} | {gbps(r['copy_gbps'])} | "
                  f"{gbps(r['handover_gbps'])} | {pct(r['handover_pct'])} | "
                  f"{format_time(r['round_trip_s'])} |" for r in timing["copy"]]
    if timing.get("reduction"):
        lines += [
            "", "all_reduce (sum) of `empty(device=0)` slabs. algbw = bytes / time. r+w = the "
            "2·N·bytes every in-place reduction of N slots reads and writes, per second, "
            "against the copy's 2·bytes. pairwise = what the daemon's kernels move now "
            "(N−1 combines and N−1 copies back: 5(N−1)·bytes), against the copy's.", "",
            "| ranks | size | time | algbw GB/s | algbw % copy | r+w GB/s | r+w % copy "
            "| pairwise % copy |", "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [f"| {r['ranks']} | {format_size(r['bytes'])} | {format_time(r['time_s'])} | "
                  f"{gbps(r['algbw_gbps'])} | {pct(r['algbw_pct'])} | {gbps(r['rw_gbps'])} | "
                  f"{pct(r['rw_pct'])} | {pct(r['moved_pct'])} |" for r in timing["reduction"]]
    if timing.get("targets"):
        lines += ["", f"Targets, from {format_size(LARGE)} up (reported, not asserted):", ""]
        lines += [f"- {t['what']} ≥ {t['target_pct']:.0f} %: {t['verdict']}"
                  f" (worst {pct(t['worst_pct'])})" for t in timing["targets"]]
    return "\n".join(lines) + "\n"


def with_pct(bandwidth: float, percent: float | None) -> str:
    return f"{gbps(bandwidth)} ({pct(percent)})"


def timing_lines(timing: dict[str, Any]) -> list[str]:
    """Bandwidth per size (GB/s, % of copy) and the targets, for the console."""
    reduction = timing.get("reduction", [])
    by_size = {r["bytes"]: r for r in timing.get("copy", [])}
    if not by_size and not reduction:
        return []
    worlds = sorted({r["ranks"] for r in reduction})
    header = f"  {'size':>8} {'copy GB/s':>10} {'hand-over':>16} {'empty() op':>11}"
    header += "".join(f" {f'{w} ranks algbw':>18} {'r+w':>6}" for w in worlds)
    lines = ["", header]
    for size in sorted({*by_size, *(r["bytes"] for r in reduction)}):
        row = by_size.get(size)
        line = f"  {format_size(size):>8} "
        line += (f"{gbps(row['copy_gbps']):>10} "
                 f"{with_pct(row['handover_gbps'], row['handover_pct']):>16} "
                 f"{format_time(row['round_trip_s']):>11}" if row else f"{'–':>39}")
        for world in worlds:
            match = [r for r in reduction if r["ranks"] == world and r["bytes"] == size]
            line += (f" {with_pct(match[0]['algbw_gbps'], match[0]['algbw_pct']):>18}"
                     f" {pct(match[0]['rw_pct']):>6}" if match else f" {'–':>25}")
        lines.append(line)
    for target in timing.get("targets", []):
        lines.append(f"  target: {target['what']} ≥ {target['target_pct']:.0f} % from "
                     f"{format_size(LARGE)}: {target['verdict']} "
                     f"(worst {pct(target['worst_pct'])})")
    return lines


def console(result: dict[str, Any], out: str | None) -> str:
    """The short table printed last."""
    checks = result["checks"]
    width = max((len(c["name"]) for c in checks), default=10)
    lines = [f"gradsync GPU check: {describe_machine(result['machine'])}; "
             f"{result['seconds']:.0f} s", ""]
    lines += [f"  {c['status']:<11} {c['name']:<{width}}  {one_line(c['detail'], 160)}"
              for c in checks]
    lines += timing_lines(result["data"].get("timing", {}))
    failed = [c["name"] for c in checks if c["status"] not in OK_STATUSES]
    lines.append("")
    lines.append(f"gpu_check: {len(failed)} of {len(checks)} checks did not pass: "
                 f"{'; '.join(failed)}" if failed
                 else f"gpu_check: all {len(checks)} correctness checks passed")
    if out:
        lines.append(f"gpu_check: results in {out}/gpu_check.json, gpu_check.md, logs/")
    return "\n".join(lines)


def save(out: str, result: dict[str, Any], folder: str) -> None:
    """gpu_check.json, gpu_check.md and logs/ (the daemon's log, non-empty rank stderr)."""
    logs = os.path.join(out, "logs")
    os.makedirs(logs, exist_ok=True)
    with open(os.path.join(out, "gpu_check.json"), "w") as file:
        json.dump(result, file, indent=1, default=str)
    with open(os.path.join(out, "gpu_check.md"), "w") as file:
        file.write(markdown(result))
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if (name.endswith(".log") or name.endswith(".err")) and os.path.getsize(path) > 0:
            shutil.copy(path, os.path.join(logs, name))


def record(markdown_path: str) -> int:
    """Write an earlier run's gpu_check.md as the gpu_check section of RESULTS.md."""
    from benchmarks import results_file

    with open(markdown_path) as source:
        text = source.read()
    target = os.path.join(HERE, "RESULTS.md")
    results_file.write_section(target, SECTION, text, "benchmarks/gpu_check.py")
    print(f"gpu_check: wrote {markdown_path} into {target} as section {SECTION!r}")
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", metavar="DIR", help="write gpu_check.json, gpu_check.md, logs/")
    parser.add_argument("--budget-s", type=float, default=390.0,
                        help="no phase starts after this many seconds; each is cut to fit")
    parser.add_argument("--record", metavar="GPU_CHECK_MD",
                        help="no run: put this gpu_check.md (from --out of an earlier run) "
                             "into benchmarks/RESULTS.md as its gpu_check section")
    parser.add_argument("--host", action="store_true",
                        help="host buffers, no GPU: exercises this script's plumbing only")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.record:
        return record(args.record)
    if not args.host:
        reason = preflight()
        if reason is not None:
            print(f"gpu_check: cannot run here: {one_line(reason, 200)}; it needs cupy and an "
                  "NVIDIA GPU", file=sys.stderr)
            return 2
    signals_unwind()
    started = time.monotonic()
    folder = tempfile.mkdtemp(prefix="gsg-", dir="/tmp")  # short: socket paths < 108 bytes
    os.chmod(folder, 0o700)
    try:
        checks, data, phases = run_with_daemon(folder, started + args.budget_s, args.host)
        result = {
            "command": shlex.join(["python", "-m", "benchmarks.gpu_check",
                                   *(sys.argv[1:] if argv is None else argv)]),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "seconds": time.monotonic() - started,
            "machine": machine(args.host),
            "checks": [dataclasses.asdict(check) for check in checks],
            "phases": [{"name": p.name, "seconds": p.seconds, "problem": p.problem,
                        "exit_codes": [r.process.returncode for r in p.ranks]} for p in phases],
            "data": data,
        }
        if args.out:
            save(args.out, result, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(console(result, args.out), flush=True)
    return 0 if all(c.status in OK_STATUSES for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
