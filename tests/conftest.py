"""Fixtures: real daemons in subprocesses, real rank processes.

Daemons listen on short ipc:// paths in a private temp folder, are awaited by
pinging (never fixed sleeps), and are stopped with SIGTERM; teardown asserts a
clean exit and that none of their segments is left in /dev/shm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from run_alone import room_lock
from zygote import DAEMON_PRELOAD, ENABLE_VARIABLE, Zygote

from gradsync.client import daemon_process
from gradsync.client.daemon_process import segments_of

if __name__ != "conftest":
    raise ImportError(f"tests/conftest.py imported as {__name__}: import it as `conftest`, as "
                      "pytest does; a second copy would start zygotes that no one stops")

PROGRAMS = Path(__file__).parent / "programs"
#: Every process the suite starts runs torch with one intra-op thread, as torchrun's
#: ranks do (the session's environment, so the zygotes too): two ranks with torch's
#: default, a thread per core, on two cores spin-wait on each other's cores (a 2-rank
#: DDP step of a small MLP took 10 ms instead of 1 ms, on gloo as on gradsync).
os.environ.setdefault("OMP_NUM_THREADS", "1")
#: Forks rank processes from a warm interpreter (tests/zygote.py); started on first use,
#: stopped at the end of the session.  GRADSYNC_TEST_ZYGOTE=0: every rank starts fresh.
RANK_ZYGOTE = Zygote(enabled=os.environ.get(ENABLE_VARIABLE, "1") != "0")
#: Fork the tests' gradsyncd the same way: its libraries loaded (numpy, ZeroMQ, uvloop:
#: about 0.15 s of CPU a daemon), and for a daemon with peers ml_dtypes too (0.45 s),
#: which it loads as it starts; one without peers loads it only at its first bfloat16
#: request (tests/test_cli_imports.py looks), so its zygote has not.
DAEMON_ZYGOTES = {
    peered: Zygote(enabled=RANK_ZYGOTE.enabled, what="peered daemon" if peered else "daemon",
                   preload=DAEMON_PRELOAD + (("ml_dtypes",) if peered else ()))
    for peered in (False, True)
}
ZYGOTES = (RANK_ZYGOTE, *DAEMON_ZYGOTES.values())
NETNS_EXEC = ["ip", "netns", "exec"]


def zygotes_summary() -> str:
    """What the session's zygotes forked (empty where none was used)."""
    return "; ".join(z.summary() for z in ZYGOTES if z.forked or z.fallbacks)


#: Tests marked `alone` run with no other test beside them on the other xdist workers.
ROOM = room_lock()
READY_TIMEOUT_S = 20.0
#: GRADSYNC_FAST_PATH for each path a small synchronous allreduce can take: the
#: shared-memory fast path with its compiled publish-and-spin (the default), the
#: same steps in Python (where that module was not built), the socket.
FAST_PATH_SETTINGS = {"fast": "1", "fast-python": "python", "socket": "0"}
#: Python source that makes a process an install without the compiled fast page module:
#: its import fails, as where no C compiler built it (run first, or as a sitecustomize).
WITHOUT_THE_FASTPAGE_MODULE = """
import sys


class NotBuilt:
    def find_spec(self, name, path=None, target=None):
        if name == "gradsync.protocol._fastpage":
            raise ImportError("gradsync.protocol._fastpage was not built (a test)")


sys.meta_path.insert(0, NotBuilt())
"""


def fast_pages_of(endpoint: str) -> set[str]:
    """Segment names of the jobs' fast pages on a running daemon (from its statistics)."""
    from gradsync.client.cli.stats import fetch_snapshot

    jobs = fetch_snapshot(endpoint + ".stats", 10.0)["jobs"]
    return {job["fast_page"] for job in jobs.values() if job.get("fast_page")}


def buffers_of(daemon: DaemonProcess) -> list[str]:
    """The daemon's segments that hold clients' buffers: all but the jobs' fast pages."""
    pages = fast_pages_of(daemon.endpoint)
    return [name for name in segments_of(daemon.pid) if name not in pages]


def poll_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.01)


def assert_lock_released(lock_path: str) -> None:
    """The daemon's lock file may remain, but no live daemon may hold it."""
    if not os.path.exists(lock_path):
        return
    fd = os.open(lock_path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if still held
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class DaemonProcess(daemon_process.DaemonProcess):
    """A gradsyncd subprocess started by a test (the library's launcher, with asserts)."""

    endpoint: str
    folder: str
    log_path: Path

    @property
    def socket_path(self) -> str:
        return self.endpoint[len("ipc://") :]

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit status.  Fails if SIGTERM was ignored."""
        code = super().stop(timeout_s)
        if self.killed:
            raise AssertionError(f"gradsyncd ignored SIGTERM for {timeout_s}s:\n{self.log()}")
        return code

    def assert_alive(self) -> None:
        assert self.process.poll() is None, f"gradsyncd died:\n{self.log()}"


def wait_until_ready(endpoint: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    """Wait for a gradsyncd the test started itself; fails (killing it) with its log."""
    try:
        DaemonProcess(endpoint, str(log_path.parent), process, log_path).wait_ready(
            READY_TIMEOUT_S, poll_s=0.01
        )
    except daemon_process.DaemonStartError as exc:
        if exc.exit_code is None:
            process.kill()
        raise AssertionError(f"{exc}:\n{log_path.read_text()}") from None


def launch_daemon(
    folder: str,
    *args: str,
    env: dict[str, str] | None = None,
    name: str = "d",
    prefix: Sequence[str] = (),
) -> DaemonProcess:
    """gradsyncd ARGS in `folder` (log NAME.log), under `prefix` (e.g. `ip netns exec NS`);
    forked by a daemon zygote where it can, else started as the launcher starts it."""
    log_path = Path(folder) / f"{name}.log"
    endpoint = f"ipc://{folder}/{name}.sock"
    environment = {**os.environ, **(env or {})}
    netns = prefix[3] if len(prefix) == 4 and list(prefix[:3]) == NETNS_EXEC else None
    if prefix and netns is None:  # a prefix a fork cannot stand for
        process = daemon_process.start_daemon(endpoint, args, folder=folder, log_path=log_path,
                                              prefix=prefix, env=environment).process
    else:
        peered = any(arg == "--listen" or arg.startswith("--listen=") for arg in args)
        with open(log_path, "wb") as log:
            process = DAEMON_ZYGOTES[peered].process(
                daemon_process.daemon_command(endpoint, args), environment, netns,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    daemon = DaemonProcess(endpoint, folder, process, log_path, prefix_words=len(prefix))
    wait_until_ready(daemon.endpoint, daemon.process, daemon.log_path)
    return daemon


@contextlib.contextmanager
def private_folder() -> Iterator[str]:
    """A short private folder (Unix socket paths are limited to 107 bytes), removed after."""
    folder = tempfile.mkdtemp(prefix="gs-", dir="/tmp")
    os.chmod(folder, 0o700)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def short_tmp() -> Iterator[str]:
    """A short private folder (Unix socket paths are limited to 107 bytes)."""
    with private_folder() as folder:
        yield folder


def stop_problems(daemon: DaemonProcess) -> list[str]:
    """SIGTERM a daemon the test left running: what is wrong with how it went (an exit
    status other than 0, segments left behind).  One the test killed on purpose has its
    leftovers swept."""
    was_running = daemon.process.poll() is None
    code = daemon.stop()
    if not was_running:
        daemon.sweep_segments()
        return []
    problems = [f"gradsyncd exited {code} on SIGTERM:\n{daemon.log()}"] if code != 0 else []
    leaked = segments_of(daemon.pid)
    if leaked:
        problems.append(f"segments left behind: {leaked}")
    return problems


@pytest.fixture
def start_daemon(short_tmp: str) -> Iterator[object]:
    """Factory: start daemons; each must exit 0 on SIGTERM and leave no segment."""
    started: list[DaemonProcess] = []

    def start(
        *args: str, env: dict[str, str] | None = None, prefix: Sequence[str] = ()
    ) -> DaemonProcess:
        daemon = launch_daemon(short_tmp, *args, env=env, name=f"d{len(started)}", prefix=prefix)
        started.append(daemon)
        return daemon

    yield start
    problems = [problem for daemon in started for problem in stop_problems(daemon)]
    assert not problems, "\n".join(problems)


@pytest.fixture
def daemon(start_daemon: object) -> DaemonProcess:
    """One daemon with default settings."""
    return start_daemon()  # type: ignore[operator, no-any-return]


@pytest.fixture(scope="module")
def module_daemon() -> Iterator[DaemonProcess]:
    """One daemon with default settings, shared by a module's tests (each isolates its
    jobs by name); at the module's end it must exit 0 on SIGTERM and leave no segment."""
    with private_folder() as folder:
        started = launch_daemon(folder, name="m")
        try:
            yield started
            started.assert_alive()  # no test here kills it
        finally:
            problems = stop_problems(started)
        assert not problems, "\n".join(problems)


# -- the fast tier ------------------------------------------------------------

#: The fast tier, `python -m pytest -m fast`: test modules (file-name patterns)
#: that need no daemon process.  Add a module here to put it in; in a listed
#: module, a test that asks for one of FULL_TIER_FIXTURES stays in the full suite.
FAST_MODULES = (
    "test_calibration.py",
    "test_checkpoint_memory.py",
    "test_checkpoint_metadata.py",
    "test_checkpoint_persist.py",
    "test_checkpoint_store.py",
    "test_codec_lane.py",
    "test_config.py",
    "test_core_*.py",
    "test_cost_model.py",
    "test_cuda_source.py",
    "test_environment.py",
    "test_executor.py",
    "test_fast_page_compiled.py",
    "test_keygen.py",
    "test_node_address.py",
    "test_peer_protocol.py",
    "test_protocol_requests.py",
    "test_protocol_units.py",
    "test_run_alone.py",
    "test_schedules.py",
    "test_socket_io.py",
    "test_state_codec.py",
    "test_wire_codec.py",
)
#: What a test asks for when it runs gradsyncd (start_daemon and daemon stand on short_tmp).
FULL_TIER_FIXTURES = frozenset({"short_tmp", "start_daemon", "daemon"})


#: The tree's Python folders whose modules the suite's processes import.
BYTECODE_FOLDERS = ("protocol", "client", "daemon", "tests", "examples")


def pytest_configure(config: pytest.Config) -> None:
    """With PYTHONDONTWRITEBYTECODE set, no process writes bytecode, so every daemon and
    rank process compiled the whole tree again as it imported it (about 0.1 s of CPU per
    daemon, hundreds of daemons a run).  The controller compiles it once, before the
    workers start; each process then reads it as any import does."""
    if not sys.dont_write_bytecode or hasattr(config, "workerinput"):
        return
    import compileall

    root = Path(__file__).parent.parent
    for folder in BYTECODE_FOLDERS:
        compileall.compile_dir(root / folder, quiet=2)
    compileall.compile_dir(root / "benchmarks", maxlevels=0, quiet=2)  # not out/


def listed_as_fast(path: Path) -> bool:
    return any(fnmatch.fnmatchcase(path.name, pattern) for pattern in FAST_MODULES)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under `-m fast` alone, modules outside the tier are not even imported (seconds saved)."""
    name = collection_path.name
    if config.option.markexpr != "fast" or not (name.startswith("test_") and name.endswith(".py")):
        return None
    return None if listed_as_fast(collection_path) else True


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if listed_as_fast(item.path) and not FULL_TIER_FIXTURES & set(
            getattr(item, "fixturenames", ())
        ):
            item.add_marker(pytest.mark.fast)


def starts_a_daemon(args: Any) -> bool:
    """Whether a command line runs gradsyncd, or `gradsync launch` / `gradsync demo`
    (which start one)."""
    if isinstance(args, str | bytes | os.PathLike):
        text = os.fsdecode(args)
        try:
            words = shlex.split(text)
        except ValueError:
            words = text.split()
    else:
        words = [os.fsdecode(word) for word in args]
    for index, word in enumerate(words):
        after = words[index + 1 :]
        module = after[0] if word == "-m" and after else ""
        if os.path.basename(word) == "gradsyncd" or module.startswith("gradsync.daemon"):
            return True
        if os.path.basename(word) == "gradsync" or module.startswith("gradsync.client.cli"):
            command = [w for w in (after[1:] if module else after) if not w.startswith("-")]
            return bool(command) and command[0] in ("launch", "demo")
    return False


@pytest.fixture(autouse=True)
def fast_tier_runs_no_daemon(request: pytest.FixtureRequest) -> None:
    """A test of the fast tier fails the moment it would start a daemon process."""
    if request.node.get_closest_marker("fast") is None:
        return
    where = (f"{request.node.nodeid} is in the fast tier (python -m pytest -m fast), "
             "which starts no daemon process")
    asked = sorted(FULL_TIER_FIXTURES & set(request.fixturenames))
    if asked:
        pytest.fail(f"{where}, but asks for {', '.join(asked)}: take it out of the tier "
                    "(FAST_MODULES in tests/conftest.py)", pytrace=False)

    class PopenWithoutDaemons(subprocess.Popen):  # type: ignore[type-arg]
        def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
            if starts_a_daemon(args):
                pytest.fail(f"{where}, but starts one: {args!r}; give the test the short_tmp "
                            "fixture (it then runs in the full suite only) or take its module "
                            "out of FAST_MODULES in tests/conftest.py", pytrace=False)
            super().__init__(args, *rest, **kwargs)

    monkeypatch: pytest.MonkeyPatch = request.getfixturevalue("monkeypatch")
    monkeypatch.setattr(subprocess, "Popen", PopenWithoutDaemons)


@dataclasses.dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str

    def records(self) -> list[dict[str, object]]:
        """JSON records the rank program printed, one or more per line.

        Ranks launched together (torchrun) share one stdout, and two ranks'
        lines can land on one line; each object on it is decoded.
        """
        decoder = json.JSONDecoder()
        found: list[dict[str, object]] = []
        for line in self.stdout.splitlines():
            position = 0
            while line.startswith("{", position):
                record, position = decoder.raw_decode(line, position)
                found.append(record)
        return found


def records_by_scenario(
    results: Sequence[RankResult], scenarios: Sequence[str]
) -> dict[str, list[dict[str, Any]]]:
    """Rank programs' JSON records grouped by "scenario"; each scenario once per rank."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        for record in result.records():
            grouped.setdefault(str(record["scenario"]), []).append(record)
    assert sorted(grouped) == sorted(scenarios), results[0].stdout + results[0].stderr
    for name, records in grouped.items():
        assert len(records) == len(results), f"{name}: {records}"
    return grouped


@pytest.fixture(autouse=True)
def environment_restored() -> Iterator[None]:
    """What a test (or a framework it ran in-process: torchrun's launcher, Lightning)
    put in os.environ leaves with it: later tests, and their rank processes, start
    from the session's environment (a changed PYTHON*/OMP_* variable also made the
    zygote start ranks fresh)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outside pytest-timeout's clock
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    with ROOM.hold(item.get_closest_marker("alone") is not None, item.nodeid):
        yield


#: Each xdist worker's zygote summary, as the controller got it.
WORKER_ZYGOTES: list[str] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    for zygote in ZYGOTES:
        zygote.stop()
    ROOM.remove()
    worker_output = getattr(session.config, "workeroutput", None)  # on an xdist worker
    summary = zygotes_summary()
    if worker_output is not None and summary:
        worker_output["zygote"] = summary


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist's controller: a worker ended; keep its zygote summary for the report."""
    summary = getattr(node, "workeroutput", {}).get("zygote")
    if summary:
        WORKER_ZYGOTES.append(f"{node.gateway.id}: {summary}")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    summary = zygotes_summary()
    if summary:
        terminalreporter.write_line(summary)
    for line in WORKER_ZYGOTES:
        terminalreporter.write_line(line)


def spawn_rank(
    program: str,
    args: Sequence[str],
    endpoint: str,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    job: str,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    """One process of tests/programs/PROGRAM with torchrun-style variables (forked by the
    session's zygote where it can: a subprocess.Popen all the same)."""
    rank_env = {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GRADSYNC_DAEMON": endpoint,
        "GRADSYNC_JOB": job,
        **(env or {}),
    }
    return RANK_ZYGOTE.popen([sys.executable, str(PROGRAMS / program), *args], env=rank_env)


def spawn_ranks(
    endpoint: str,
    program: str,
    nranks: int,
    args: Sequence[str] = (),
    job: str = "test",
    env: dict[str, str] | None = None,
) -> list[subprocess.Popen[str]]:
    """Start `nranks` processes of PROGRAM, all on one daemon."""
    return [
        spawn_rank(program, args, endpoint, rank, nranks, rank, nranks, job, env)
        for rank in range(nranks)
    ]


def collect(
    processes: Sequence[subprocess.Popen[str]], timeout_s: float, grace_after_failure_s: float = 30
) -> list[RankResult]:
    """Wait for every rank; once one has failed, the others get a grace period, not the
    whole timeout (a rank waiting on a dead peer would otherwise hide the real error)."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in processes):
            deadline = min(deadline, time.monotonic() + grace_after_failure_s)
        time.sleep(0.05)
    results = []
    for rank, process in enumerate(processes):
        try:
            out, err = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            report = []
            for index, other in enumerate(processes):
                other_out, other_err = other.communicate()
                report.append(f"--- rank {index} (exit {other.returncode}):\n"
                              f"{other_out[-2000:]}\n{other_err[-3000:]}")
            raise AssertionError(
                f"rank {rank} hung past {timeout_s}s\n" + "\n".join(report)
            ) from None
        results.append(RankResult(rank, process.returncode, out, err))
    return results


def run_ranks(
    endpoint: str,
    program: str,
    nranks: int,
    args: Sequence[str] = (),
    timeout_s: float = 90.0,
    **kwargs: object,
) -> list[RankResult]:
    """Run rank programs to completion; every rank must exit 0."""
    results = collect(spawn_ranks(endpoint, program, nranks, args, **kwargs), timeout_s)  # type: ignore[arg-type]
    assert_all_exited_0(results)
    return results


def assert_all_exited_0(results: Sequence[RankResult], context: str = "") -> None:
    """Every rank exited 0; otherwise show the first failure's output and `context`."""
    for result in results:
        assert result.returncode == 0, (
            f"rank {result.rank} exited {result.returncode}\n"
            f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}\n{context}"
        )
