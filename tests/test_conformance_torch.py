"""torch's own distributed test suite on backend gradsync, as PyTorch's CI runs it on gloo.

The suite is `DistributedTest._DistTestBase` of
`torch.testing._internal.distributed.distributed_test`; upstream, the file
test/distributed/test_distributed_spawn.py mixes it into `TestDistBackend` and runs
it with BACKEND, WORLD_SIZE and TEMP_DIR set, spawning a fresh process per rank for
every test.  Here it runs with BACKEND=gradsync, WORLD_SIZE=2, gradsync in the
suite's feature sets "ddp" and "subgroup", one pytest test per suite test.

Spawning two processes that import torch for each of the 285 tests, plus a daemon
for each, took 21 minutes on 2 cores; here it takes 2 to 3: one gradsyncd serves the
module, and two rank processes (tests/programs/torch_dist_suite_worker.py) import
torch and the suite once and then run test after test, each on a fresh file store
(as torch's MultiProcContinuousTest does).  They are replaced after a failure, a
crash or a hang, since those may leave state behind.  Whether a test is skipped is
decided here, from one collection pass of the worker, so a test that can only skip
never reaches the ranks.

Tests the suite keeps to gloo (or MPI) by name that gradsync can run are run anyway
(REEXPOSED); every other skip must be one of the reviewed reasons (ACCEPTED_GATES,
OUR_SKIPS), which test_every_skip_is_reviewed checks against the suite of the
installed torch.  GRADSYNC_CONFORMANCE_BACKEND=gloo runs the same driver on gloo;
the module ends with a line of counts.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from run_alone import run_file

from conftest import PROGRAMS, DaemonProcess, buffers_of, launch_daemon
from gradsync.client.daemon_process import segments_of

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest", reason="torch's test suite needs expecttest (pip install "
                    "expecttest)")

BACKEND = os.environ.get("GRADSYNC_CONFORMANCE_BACKEND", "gradsync")
if BACKEND not in ("gradsync", "gloo"):
    raise RuntimeError(f"GRADSYNC_CONFORMANCE_BACKEND={BACKEND!r}: gradsync or gloo")
WORLD_SIZE = 2
WORKER = PROGRAMS / "torch_dist_suite_worker.py"
COLLECT_TIMEOUT_S = 120.0
#: How long a test's buffers may stay in the daemon after it ended (freed asynchronously).
BUFFERS_GONE_S = 10.0
START_TIMEOUT_S = 90.0  # a rank imports torch and the suite
TEST_TIMEOUT_S = 120.0  # one suite test on both ranks (upstream allows 300)
GRACE_S = 10.0  # for the other rank to answer once one has failed
STOP_TIMEOUT_S = 10.0

pytestmark = [pytest.mark.conformance, pytest.mark.timeout(TEST_TIMEOUT_S + 60)]

#: Tests the suite keeps to other backends by naming them (gloo: skip_but_pass_in_sandcastle_if
#: (BACKEND != "gloo") or require_backend_is_available({"gloo"}); MPI: CPU all_to_all),
#: whose behaviour is a backend's job and applies to gradsync: their bodies run on
#: gradsync, that gate ignored (any other gate still skips them).
REEXPOSED: dict[str, str] = {
    **dict.fromkeys(
        ["test_monitored_barrier_gloo", "test_monitored_barrier_gloo_rank_0_timeout",
         "test_monitored_barrier_gloo_subgroup"],
        "monitored_barrier on a CPU group: a barrier that names the ranks missing"),
    **dict.fromkeys(
        ["test_barrier_timeout_global", "test_barrier_timeout_full_group"],
        "a barrier only one rank enters times out after the group's timeout"),
    **dict.fromkeys(
        [f"test_all_reduce_coalesced_{group}{op}" for group in ("", "full_group_")
         for op in ("max", "min", "product", "sum")],
        "all_reduce_coalesced of CPU tensors"),
    **dict.fromkeys(
        ["test_accumulate_gradients_no_sync", "test_accumulate_gradients_no_sync_allreduce_hook",
         "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
         "test_accumulate_gradients_no_sync_grad_is_view", "test_get_future"],
        "Work.get_future() of a CPU collective, as torch's DDP and comm hooks use it"),
    **dict.fromkeys(
        ["test_batch_isend_irecv_gloo", "test_batch_isend_irecv_gloo_tags"],
        "batch_isend_irecv of CPU tensors"),
    "test_grads_same_across_ranks_with_no_sync": "DDP no_sync on CPU",
    "test_scatter_object_list": "scatter_object_list on CPU",
    "test_sparse_all_reduce_sum": "all_reduce of a sparse COO tensor (gloo's sparse allreduce)",
    **dict.fromkeys(
        ["test_all_gather_object_default_pg", "test_all_gather_object_subgroup"],
        "all_gather_object on CPU"),
    **dict.fromkeys(
        [f"test_all_to_all_single_{split}_split{variant}" for split in ("equal", "unequal")
         for variant in ("", "_complex", "_full_group")]
        + ["test_all_to_all", "test_all_to_all_complex", "test_all_to_all_full_group"],
        "all_to_all(_single) of CPU tensors, which the suite runs on MPI alone"),
}

#: REEXPOSED tests whose body branches on the backend's name too (`if BACKEND == "mpi" or
#: BACKEND == "gloo":` builds the CPU model, and nothing else does): the suite's BACKEND
#: reads "gloo" while their body runs, on the gradsync process group created before it.
BODY_SEES_GLOO = frozenset(
    ["test_accumulate_gradients_no_sync", "test_accumulate_gradients_no_sync_allreduce_hook",
     "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
     "test_accumulate_gradients_no_sync_grad_is_view"])

#: Tests the suite would run that are skipped here anyway, each with why.
OUR_SKIPS: dict[str, str] = {}

#: The suite's own skip reasons (regular expressions) accepted as "cannot apply here",
#: each with why.  A test skipped for none of them fails test_every_skip_is_reviewed.
ACCEPTED_GATES: dict[str, str] = {
    r"^CUDA is not available\.$|^Need at least \d+ CUDA devices$":
        "needs CUDA devices; the torch under test is the CPU build",
    r"^Skipped due to small world size\.$":
        "needs 8 ranks (skip_if_small_worldsize); this run has 2",
    r"^Test requires (an exact )?world size of [3-9]\d*$": "needs more ranks than the 2 here",
    r"^Only (Nccl|NCCL) (supports|backend supports) |^NCCL (Batch )?Send Recv Only$"
    r"|one of \{'nccl'\}$|tests with NCCL only": "an NCCL-only API or CUDA variant",
    r"pytorch/pytorch/(issues|pull)/\d+|^Skipped due to flakiness$":
        "disabled upstream, on every backend",
    r"^no torchvision$": "needs torchvision, which is not installed",
}


@dataclasses.dataclass(frozen=True)
class SuiteTest:
    """One test of the suite and the gates that skip it (none: it runs)."""

    name: str
    skip: tuple[str, ...]
    gloo_skip: tuple[str, ...]


def worker_environment(folder: str, **extra: str) -> dict[str, str]:
    """What upstream's spawned ranks see: BACKEND, WORLD_SIZE, a file:// INIT_METHOD."""
    return {
        **os.environ, "BACKEND": BACKEND, "WORLD_SIZE": str(WORLD_SIZE), "TEMP_DIR": folder,
        "INIT_METHOD": f"file://{folder}/init_dir/shared_init_file",
        "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1",
        "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",  # its command line is upstream's, not ours
        **extra,
    }


def collect_suite() -> dict[str, SuiteTest]:
    """Every test of the suite in the installed torch, with its gates (one worker pass,
    shared by the xdist workers of a run: each collects this module, and the pass costs
    3 s of CPU)."""
    shared = run_file("suite.json")
    if shared is None:  # outside xdist
        return suite_of(collect_once())
    path = Path(shared)
    lock_path, written = path.with_suffix(".lock"), path.with_suffix(".tmp")
    for leftover in (path, lock_path):  # by the first worker out
        atexit.register(leftover.unlink, missing_ok=True)
    with open(lock_path, "w") as lock:
        # The first worker collects (within COLLECT_TIMEOUT_S); the rest wait, then read.
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not path.exists():
                written.write_text(collect_once())
                written.rename(path)
            return suite_of(path.read_text())
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def suite_of(collected: str) -> dict[str, SuiteTest]:
    tests = json.loads(collected)["tests"]
    return {name: SuiteTest(name, tuple(gates["skip"]), tuple(gates["gloo_skip"]))
            for name, gates in sorted(tests.items())}


def collect_once() -> str:
    """The worker's `collect` pass: JSON of every test and its gates."""
    folder = tempfile.mkdtemp(prefix="gs-suite-")
    try:
        result = subprocess.run(
            [sys.executable, str(WORKER), "collect"], env=worker_environment(folder),
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=COLLECT_TIMEOUT_S)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if result.returncode != 0:
        raise RuntimeError(f"collecting torch's suite failed:\n{result.stderr[-5000:]}")
    return result.stdout


SUITE = collect_suite()


def skip_reason(test: SuiteTest) -> str | None:
    """Why this test is not sent to the ranks (None: it runs); "not reviewed: ..." for a
    gate neither ACCEPTED_GATES nor REEXPOSED knows."""
    if test.name in OUR_SKIPS:
        return OUR_SKIPS[test.name]
    if not test.skip:
        return None
    # A second gate hides behind a gate naming backends (both set one attribute); the
    # suite's view as gloo shows it.
    reasons = test.skip + tuple(r for r in test.gloo_skip if r not in test.skip)
    said = "; ".join(reasons)
    for reason in reasons:
        for pattern, why in ACCEPTED_GATES.items():
            if re.search(pattern, reason):
                return f"{why} (the suite: {said})"
    if test.name in REEXPOSED:
        return None if BACKEND != "gloo" else f"kept from gloo by the suite: {said}"
    return f"not reviewed: {said}"


# -- the rank processes ---------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    outcome: str  # passed, failed or skipped
    detail: str = ""


class Rank:
    """One worker process: its requests, its answers (read by a thread), its log."""

    def __init__(self, rank: int, env: dict[str, str], folder: str,
                 answers: queue.Queue[tuple[int, dict[str, Any] | None]]) -> None:
        self.rank = rank
        self.log_path = Path(folder) / f"rank{rank}.log"
        with open(self.log_path, "ab") as log:
            self.first_offset = log.tell()  # a replaced rank writes on in the same log
            self.process = subprocess.Popen(
                [sys.executable, str(WORKER), "serve", str(rank)], env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self.answers = answers
        threading.Thread(target=self._read, name=f"suite-rank{rank}", daemon=True).start()

    def _read(self) -> None:
        stdout: IO[str] | None = self.process.stdout
        assert stdout is not None
        for line in stdout:
            try:
                self.answers.put((self.rank, json.loads(line)))
            except json.JSONDecodeError:
                continue
        self.answers.put((self.rank, None))  # it exited

    def send(self, request: dict[str, str]) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        with contextlib.suppress(OSError):  # it died: its reader reports that
            stdin.write(json.dumps(request) + "\n")
            stdin.flush()

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def log_since(self, offset: int, limit: int = 6000) -> str:
        with open(self.log_path, "rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
        return text if len(text) <= limit else "...\n" + text[-limit:]

    def dump_stacks(self) -> None:
        """Python stacks into the log (faulthandler on SIGUSR1), for a rank that hangs."""
        if self.process.poll() is not None:
            return
        size = self.log_size()
        self.process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 2.0
        while self.log_size() == size and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self, gently: bool) -> None:
        """End of input and a wait for the exit, or (after a failure) SIGKILL at once."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        if gently:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(STOP_TIMEOUT_S)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(STOP_TIMEOUT_S)


class SuiteRanks:
    """The two ranks that run the suite's tests, started when first needed and
    replaced after any test that may have left state behind."""

    def __init__(self, env: dict[str, str], folder: str,
                 daemon: DaemonProcess | None = None) -> None:
        self.env = env
        self.folder = folder
        self.daemon = daemon
        self.ranks: list[Rank] = []
        self.answers: queue.Queue[tuple[int, dict[str, Any] | None]] = queue.Queue()
        self.count = 0
        #: Why the ranks could not start, once they could not: later tests fail at once.
        self.broken: str | None = None

    def start(self) -> None:
        self.answers = queue.Queue()
        self.ranks = [Rank(rank, self.env, self.folder, self.answers)
                      for rank in range(WORLD_SIZE)]
        deadline = time.monotonic() + START_TIMEOUT_S
        ready: set[int] = set()
        while len(ready) < WORLD_SIZE:
            try:
                rank, answer = self.answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if answer is None:
                break
            ready.add(rank)
        if len(ready) < WORLD_SIZE:
            logs = "\n".join(f"--- rank {r.rank}:\n{r.log_since(r.first_offset)}"
                             for r in self.ranks)
            self.stop(gently=False)
            self.broken = f"the suite's ranks did not start within {START_TIMEOUT_S:g}s:\n{logs}"
            raise AssertionError(self.broken)

    def stop(self, gently: bool = True) -> None:
        for rank in self.ranks:
            rank.stop(gently)
        self.ranks = []

    def run(self, name: str) -> Outcome:
        """One suite test on both ranks, judged as upstream's MultiProcessTestCase does."""
        if self.broken is not None:
            raise AssertionError(f"not run: {self.broken}")
        if not self.ranks:
            self.start()
        self.count += 1
        temp_dir = os.path.join(self.folder, f"t{self.count}")
        for sub in ("barrier", "test_dir", "init_dir"):
            os.makedirs(os.path.join(temp_dir, sub))
        request = {"test": name, "temp_dir": temp_dir,
                   "init_file": os.path.join(temp_dir, "store")}
        if BACKEND != "gloo" and name in BODY_SEES_GLOO:
            request["body_backend"] = "gloo"
        offsets = [rank.log_size() for rank in self.ranks]
        for rank in self.ranks:
            rank.send(request)
        answers, exited = self._wait(name)
        outcome = self._judge(answers, exited, offsets)
        if outcome.outcome == "failed" or not all(a["clean"] for a in answers.values()):
            self.stop(gently=False)  # their state may be anything
        shutil.rmtree(temp_dir, ignore_errors=True)
        return outcome

    def _wait(self, name: str) -> tuple[dict[int, dict[str, Any]], set[int]]:
        answers: dict[int, dict[str, Any]] = {}
        exited: set[int] = set()
        deadline = time.monotonic() + TEST_TIMEOUT_S
        while len(answers) + len(exited) < WORLD_SIZE:
            try:
                rank, answer = self.answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if answer is None:
                exited.add(rank)
            elif answer.get("test") == name:
                answers[rank] = answer
            if answer is None or answer.get("outcome") == "failed":
                deadline = min(deadline, time.monotonic() + GRACE_S)
        return answers, exited

    def _judge(self, answers: dict[int, dict[str, Any]], exited: set[int],
               offsets: list[int]) -> Outcome:
        failed = sorted(r for r, a in answers.items() if a["outcome"] == "failed")
        silent = [r for r in range(WORLD_SIZE) if r not in answers]
        if not failed and not silent:
            first = answers[0]
            return Outcome("skipped" if first["outcome"] == "skipped" else "passed",
                           first["detail"])
        for rank in silent:
            if rank not in exited:
                self.ranks[rank].dump_stacks()
        parts = [f"rank {r} failed:\n{answers[r]['detail']}" for r in failed]
        for rank in silent:
            how = (f"exited with code {self.ranks[rank].process.poll()}" if rank in exited
                   else "gave no answer in time (its Python stacks are in its log below)")
            parts.append(f"rank {rank} {how}")
        parts += [f"--- rank {r.rank}'s log for this test:\n{r.log_since(offsets[r.rank])}"
                  for r in self.ranks]
        return Outcome("failed", "\n".join(parts))


# -- pytest ---------------------------------------------------------------------------


class Tally:
    """Outcomes of this module's suite tests, for the closing line of counts."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.started = time.monotonic()

    def line(self) -> str:
        return (f"torch {torch.__version__} DistributedTest on {BACKEND}, {WORLD_SIZE} ranks: "
                f"{self.counts['passed']} passed, {self.counts['failed']} failed, "
                f"{self.counts['skipped']} skipped in {time.monotonic() - self.started:.0f}s")


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> Iterator[Tally]:
    counts = Tally()
    yield counts
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        print(counts.line())
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        reporter.write_line(counts.line())


@pytest.fixture(scope="module")
def suite_ranks() -> Iterator[SuiteRanks]:
    """The two ranks (and, on gradsync, the one daemon they share), for the module."""
    folder = tempfile.mkdtemp(prefix="gs-", dir="/tmp")
    os.chmod(folder, 0o700)
    daemon: DaemonProcess | None = None
    env = worker_environment(folder)
    ranks = SuiteRanks(env, folder)
    try:
        if BACKEND == "gradsync":
            daemon = ranks.daemon = launch_daemon(folder)
            env.update(GRADSYNC_DAEMON=daemon.endpoint, GRADSYNC_JOB="torch-suite")
        yield ranks
    finally:
        ranks.stop()
        problems = []
        if daemon is not None:
            was_running = daemon.process.poll() is None
            code = daemon.stop()
            if not was_running or code != 0:
                problems.append(f"gradsyncd exited {code}:\n{daemon.log()[-5000:]}")
            leaked = segments_of(daemon.pid)
            if leaked:
                problems.append(f"segments left behind: {leaked}")
        shutil.rmtree(folder, ignore_errors=True)
        assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", sorted(SUITE))
def test_suite(name: str, request: pytest.FixtureRequest, tally: Tally) -> None:
    """One test of torch's DistributedTest on both ranks (skipped here if it cannot apply)."""
    reason = skip_reason(SUITE[name])
    if reason is not None:
        tally.counts["skipped"] += 1
        pytest.skip(reason)
    try:
        ranks: SuiteRanks = request.getfixturevalue("suite_ranks")
        outcome = ranks.run(name)
        if outcome.outcome == "passed" and ranks.daemon is not None:
            # The ranks' sessions end and their segments go a moment after the test
            # reports: wait (up to a deadline) for that, never judge the instant.
            deadline = time.monotonic() + BUFFERS_GONE_S
            while (left := buffers_of(ranks.daemon)) and time.monotonic() < deadline:
                time.sleep(0.05)
            if left:
                outcome = Outcome("failed", f"the test's buffers are still in the daemon "
                                  f"{BUFFERS_GONE_S:g} s after it ended: {left}")
    except BaseException:
        tally.counts["failed"] += 1
        raise
    tally.counts[outcome.outcome] += 1
    if outcome.outcome == "skipped":
        pytest.skip(f"the suite, while running: {outcome.detail}")
    if outcome.outcome == "failed":
        pytest.fail(outcome.detail, pytrace=False)


def test_every_skip_is_reviewed() -> None:
    """Each test skipped here is skipped for a reviewed reason, each gloo runs is run
    (or in OUR_SKIPS), and REEXPOSED, BODY_SEES_GLOO and OUR_SKIPS name tests of this
    torch's suite that need them."""
    reasons = {name: skip_reason(test) for name, test in SUITE.items()}
    unreviewed = sorted(f"{name}: {reason}" for name, reason in reasons.items()
                        if reason is not None and reason.startswith("not reviewed"))
    gloo_only = sorted(name for name, test in SUITE.items()
                       if not test.gloo_skip and reasons[name] is not None
                       and name not in OUR_SKIPS)
    stale = sorted(name for name in {*REEXPOSED, *OUR_SKIPS} if name not in SUITE)
    needless = sorted(name for name in REEXPOSED if BACKEND != "gloo" and name in SUITE
                      and (not SUITE[name].skip or reasons[name] is not None))
    needless += sorted(BODY_SEES_GLOO - set(REEXPOSED))
    assert not unreviewed, f"skipped for reasons in no ACCEPTED_GATES: {unreviewed}"
    assert not gloo_only, f"run on gloo, skipped on {BACKEND} (REEXPOSED?): {gloo_only}"
    assert not stale, f"not tests of torch {torch.__version__}'s suite: {stale}"
    assert not needless, f"in REEXPOSED yet run, or skipped for another gate: {needless}"
