"""`gradsync launch` and `gradsync ping`, run as real commands.

Every launcher runs in a session of its own with a private TMPDIR and
XDG_RUNTIME_DIR, so the test can tell what it left behind (nothing), can
kill the whole process tree if it hangs, and never meets a daemon that
happens to run at the user's default endpoint.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import free_ports, peer_args

from conftest import (
    PROGRAMS,
    DaemonProcess,
    assert_lock_released,
    launch_daemon,
    poll_until,
    segments_of,
)
from gradsync.protocol.version import __version__

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "allreduce_numpy.py"
CLI = [sys.executable, "-m", "gradsync.client.cli"]
COMMAND_TIMEOUT_S = 60.0
PRIVATE_DAEMON = re.compile(r"started a private gradsyncd \(pid (\d+)\) at (ipc://\S+)")
# Variables a surrounding launcher or shell may have set that would change what we test.
_INHERITED = (
    "GRADSYNC_DAEMON", "GRADSYNC_JOB", "GRADSYNC_TIMEOUT_S", "GRADSYNC_SOCKET",
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
)


# -- helpers ----------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    """True if `pid` is a running (not zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.fixture
def sandbox(short_tmp: str) -> Iterator[dict[str, Path]]:
    """Private TMPDIR, XDG_RUNTIME_DIR and marker folders inside one short folder."""
    folders = {name: Path(short_tmp) / name for name in ("tmp", "run", "marks")}
    for folder in folders.values():
        folder.mkdir(mode=0o700)
    yield folders


def clean_env(sandbox: dict[str, Path], **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _INHERITED}
    env["TMPDIR"] = str(sandbox["tmp"])
    env["XDG_RUNTIME_DIR"] = str(sandbox["run"])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def start_cli(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*CLI, *args], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # lets a hung test kill launcher, ranks and daemon at once
    )


def finish(
    process: subprocess.Popen[str], timeout_s: float = COMMAND_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Wait for the command (and every process holding its pipes) within a deadline."""
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        raise AssertionError(
            f"{process.args!r} did not finish within {timeout_s}s\nstdout:\n{out}\nstderr:\n{err}"
        ) from None
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return finish(start_cli(args, env))


def wait_for_files(paths: list[Path], process: subprocess.Popen[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(path.exists() for path in paths):
        if process.poll() is not None:
            result = finish(process)
            raise AssertionError(
                f"launcher exited {result.returncode} before {paths} appeared\n"
                f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
            )
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            result = finish(process)
            raise AssertionError(f"{paths} did not appear within {timeout_s}s\n{result.stderr}")
        time.sleep(0.01)


def private_daemon(stderr: str) -> tuple[int, str]:
    """Pid and endpoint of the daemon the launcher says it started."""
    match = PRIVATE_DAEMON.search(stderr)
    assert match, f"launch did not start a private daemon:\n{stderr}"
    return int(match.group(1)), match.group(2)


def assert_private_daemon_gone(stderr: str, sandbox: dict[str, Path]) -> None:
    """The launcher's daemon stopped, unlinked its segments and its socket folder."""
    pid, endpoint = private_daemon(stderr)
    assert endpoint.startswith(f"ipc://{sandbox['tmp']}/"), endpoint
    assert not pid_alive(pid), f"private gradsyncd {pid} still running"
    assert segments_of(pid) == [], f"segments of gradsyncd {pid} left in /dev/shm"
    assert list(sandbox["tmp"].iterdir()) == [], "launch left files in TMPDIR"
    assert "private gradsyncd exited with status" not in stderr, stderr


def records(stdout: str) -> list[dict[str, Any]]:
    """The JSON lines the ranks printed, in rank order."""
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return sorted(lines, key=lambda record: int(record["rank"]))


def marker_pid(path: Path) -> int:
    return int(path.read_text())


def children_of(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc, no psutil needed)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            children.append(int(entry.name))
    return children


# -- launch -----------------------------------------------------------------


@pytest.mark.timeout(90)
def test_launch_runs_the_example_on_a_private_daemon(sandbox: dict[str, Path]) -> None:
    started = time.monotonic()
    result = run_cli(
        ["launch", "--nproc-per-node", "2", "examples/allreduce_numpy.py"], clean_env(sandbox)
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "OK: weights identical on all 2 ranks" in result.stdout, result.stdout
    assert "FAIL" not in result.stdout + result.stderr
    assert_private_daemon_gone(result.stderr, sandbox)
    assert elapsed < 30, f"the example took {elapsed:.1f}s"


@pytest.mark.timeout(90)
def test_launch_sets_rank_environment_and_job(sandbox: dict[str, Path]) -> None:
    env = clean_env(sandbox)
    env.pop("OMP_NUM_THREADS", None)  # the suite sets it (conftest); a user may not
    result = run_cli(  # torchrun's spelling of --nproc-per-node works too
        ["launch", "--nproc_per_node", "3", "--job", "named-job",
         str(PROGRAMS / "launch_report.py")],
        env,
    )
    assert result.returncode == 0, result.stderr
    assert "OMP_NUM_THREADS=1 for each of the 3 ranks (it is not set)" in result.stderr
    daemon_pid, endpoint = private_daemon(result.stderr)
    ranks = records(result.stdout)
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    for record in ranks:
        assert record["world_size"] == 3
        assert record["local_rank"] == record["rank"]
        assert record["local_world_size"] == 3
        assert record["job"] == "named-job"
        assert record["daemon"] == record["env_daemon"] == endpoint
        assert record["daemon_pid"] == daemon_pid
        assert record["sum"] == [0 + 1 + 2, 3, 1 + 10 + 100]
        assert record["omp_num_threads"] == "1"  # as torchrun does, for several ranks
    assert_private_daemon_gone(result.stderr, sandbox)


@pytest.mark.timeout(90)
def test_failing_rank_stops_the_others_and_sets_the_exit_status(
    sandbox: dict[str, Path],
) -> None:
    marks = sandbox["marks"]
    started = time.monotonic()
    result = run_cli(
        ["launch", "--nproc-per-node", "2", str(PROGRAMS / "launch_rank_fails.py"), str(marks)],
        clean_env(sandbox),
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 3, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "rank 1 exited with status 3; stopping the other ranks" in result.stderr
    # Rank 0 was waiting in a collective that could never complete; launch ended it.
    assert (marks / "blocked-0").exists()
    assert not pid_alive(marker_pid(marks / "blocked-0")), "rank 0 outlived the launcher"
    assert elapsed < 30, f"launch took {elapsed:.1f}s to give up on a blocked rank"
    assert_private_daemon_gone(result.stderr, sandbox)


@pytest.mark.timeout(90)
def test_a_failing_rank_on_another_node_is_named_by_its_global_rank(
    sandbox: dict[str, Path],
) -> None:
    """On node 1 of a job of 2 ranks per node, local rank 0 is rank 2."""
    script = sandbox["marks"] / "fail_first.py"
    script.write_text("import os, sys, time\n"
                      "sys.exit(3) if os.environ['LOCAL_RANK'] == '0' else time.sleep(60)\n")
    result = run_cli(
        ["launch", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", str(script)],
        clean_env(sandbox),
    )
    assert result.returncode == 3, result.stderr
    assert ("rank 2 (local rank 0) exited with status 3; stopping the other ranks"
            in result.stderr), result.stderr


@pytest.mark.timeout(90)
def test_sigterm_to_launch_is_forwarded_and_everything_stops(
    sandbox: dict[str, Path],
) -> None:
    marks = sandbox["marks"]
    launcher = start_cli(
        ["launch", "--nproc-per-node", "2", str(PROGRAMS / "launch_block.py"), str(marks)],
        clean_env(sandbox),
    )
    wait_for_files([marks / "ready-0", marks / "ready-1"], launcher, COMMAND_TIMEOUT_S)
    rank_pids = [marker_pid(marks / f"ready-{rank}") for rank in (0, 1)]

    launcher.send_signal(signal.SIGTERM)  # the launcher alone, not its process group
    result = finish(launcher, 30)

    assert result.returncode == 128 + signal.SIGTERM, (
        f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    for rank, pid in enumerate(rank_pids):
        assert (marks / f"term-{rank}").exists(), f"rank {rank} never got SIGTERM"
        assert not pid_alive(pid), f"rank {rank} (pid {pid}) still running"
    assert_private_daemon_gone(result.stderr, sandbox)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["flag", "environment"])
def test_launch_uses_a_running_daemon(
    daemon: DaemonProcess, sandbox: dict[str, Path], how: str
) -> None:
    if how == "flag":
        args, env = ["--daemon", daemon.endpoint], clean_env(sandbox, OMP_NUM_THREADS="3")
    else:
        args, env = [], clean_env(sandbox, GRADSYNC_DAEMON=daemon.endpoint,
                                  OMP_NUM_THREADS="3")
    result = run_cli(
        ["launch", "--nproc-per-node", "2", *args, str(PROGRAMS / "launch_report.py")], env
    )
    assert result.returncode == 0, result.stderr
    assert "started a private gradsyncd" not in result.stderr
    ranks = records(result.stdout)
    assert [r["rank"] for r in ranks] == [0, 1]
    for record in ranks:
        assert record["daemon_pid"] == daemon.pid
        assert record["daemon"] == daemon.endpoint
        assert record["sum"] == [1, 2, 11]
        assert record["omp_num_threads"] == "3"  # a value of the user's stays
    assert "OMP_NUM_THREADS=1" not in result.stderr
    daemon.assert_alive()
    assert list(sandbox["tmp"].iterdir()) == []


@pytest.mark.timeout(90)
def test_launch_starts_a_daemon_at_a_given_endpoint_if_none_answers(
    sandbox: dict[str, Path],
) -> None:
    socket_path = sandbox["run"] / "own.sock"
    endpoint = f"ipc://{socket_path}"
    result = run_cli(
        ["launch", "--nproc-per-node", "2", "--daemon", endpoint,
         str(PROGRAMS / "launch_report.py")],
        clean_env(sandbox),
    )
    assert result.returncode == 0, result.stderr
    daemon_pid, started_at = private_daemon(result.stderr)
    assert started_at == endpoint
    assert all(record["daemon_pid"] == daemon_pid for record in records(result.stdout))
    assert not pid_alive(daemon_pid)
    assert segments_of(daemon_pid) == []
    assert not socket_path.exists()
    assert_lock_released(f"{socket_path}.lock")


@pytest.mark.timeout(30)
def test_launch_refuses_zero_ranks(sandbox: dict[str, Path]) -> None:
    result = run_cli(["launch", "--nproc-per-node", "0", str(EXAMPLE)], clean_env(sandbox))
    assert result.returncode == 2
    assert "--nproc-per-node must be at least 1" in result.stderr
    assert list(sandbox["tmp"].iterdir()) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "usage"),
    [(["launch", "--bogus", "x.py"], "usage: gradsync launch"),
     (["launch", "--nproc-per", "2", "x.py"], "usage: gradsync launch"),  # no abbreviations
     (["ping", "--timeout", "1"], "usage: gradsync ping"),
     (["stats", "--js"], "usage: gradsync stats")],
)
def test_a_bad_flag_is_refused_with_its_subcommands_usage(
    sandbox: dict[str, Path], args: list[str], usage: str
) -> None:
    result = run_cli(args, clean_env(sandbox))
    assert result.returncode == 2, result
    assert result.stderr.startswith(usage), result.stderr
    assert "unrecognized arguments" in result.stderr
    assert list(sandbox["tmp"].iterdir()) == []  # nothing was started


@pytest.fixture
def default_daemon(sandbox: dict[str, Path]) -> Iterator[DaemonProcess]:
    """A daemon at the default endpoint of the sandbox ($XDG_RUNTIME_DIR/gradsync/...)."""
    folder = sandbox["run"] / "gradsync"
    folder.mkdir(mode=0o700)
    daemon = launch_daemon(str(folder), name="gradsyncd")
    yield daemon
    assert daemon.stop() == 0, daemon.log()
    assert segments_of(daemon.pid) == []


@pytest.mark.timeout(90)
def test_launch_uses_the_daemon_at_the_default_endpoint(
    default_daemon: DaemonProcess, sandbox: dict[str, Path]
) -> None:
    env = clean_env(sandbox)
    assert run_cli(["ping"], env).returncode == 0
    result = run_cli(
        ["launch", "--nproc-per-node", "2", str(PROGRAMS / "launch_report.py")], env
    )
    assert result.returncode == 0, result.stderr
    assert all(r["daemon_pid"] == default_daemon.pid for r in records(result.stdout)), (
        result.stderr
    )


@pytest.mark.timeout(90)
def test_sigterm_while_the_private_daemon_starts_stops_it(sandbox: dict[str, Path]) -> None:
    launcher = start_cli(
        ["launch", "--nproc-per-node", "2", str(EXAMPLE)], clean_env(sandbox)
    )
    deadline = time.monotonic() + COMMAND_TIMEOUT_S
    while not children_of(launcher.pid):  # the daemon is forked first, the ranks later
        assert launcher.poll() is None and time.monotonic() < deadline
        time.sleep(0.005)
    daemon_pid = children_of(launcher.pid)[0]
    launcher.send_signal(signal.SIGTERM)
    try:
        # Not finish(): an orphaned daemon would hold the output pipes open.
        try:
            returncode = launcher.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            raise AssertionError("launch ignored SIGTERM for 30s") from None
        assert returncode == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while pid_alive(daemon_pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not pid_alive(daemon_pid), "launch left its private gradsyncd running"
        assert list(sandbox["tmp"].iterdir()) == [], "launch left files in TMPDIR"
    finally:
        if pid_alive(daemon_pid):  # clean up after the bug: stop the orphan properly
            os.kill(daemon_pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while pid_alive(daemon_pid) and time.monotonic() < deadline:
                time.sleep(0.01)
        finish(launcher, 30)


# -- ping -------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_ping_reports_version_and_pid_of_a_live_daemon(
    daemon: DaemonProcess, sandbox: dict[str, Path]
) -> None:
    result = run_cli(["ping", "--daemon", daemon.endpoint], clean_env(sandbox))
    assert result.returncode == 0, result.stderr
    assert __version__ in result.stdout
    assert f"pid {daemon.pid}" in result.stdout
    assert daemon.endpoint in result.stdout

    by_env = run_cli(["ping"], clean_env(sandbox, GRADSYNC_DAEMON=daemon.endpoint))
    assert by_env.returncode == 0, by_env.stderr
    assert f"pid {daemon.pid}" in by_env.stdout


@pytest.mark.timeout(60)
def test_ping_without_a_daemon_fails_naming_the_endpoint(
    sandbox: dict[str, Path],
) -> None:
    endpoint = f"ipc://{sandbox['run']}/nobody.sock"
    result = run_cli(["ping", "--daemon", endpoint], clean_env(sandbox))
    assert result.returncode == 1
    assert result.stdout == ""
    assert endpoint in result.stderr
    assert "no gradsync daemon answers" in result.stderr

    # --wait asks until its time is up, then fails the same way.
    started = time.monotonic()
    waited = run_cli(["ping", "--wait", "0.5", "--daemon", endpoint], clean_env(sandbox))
    assert time.monotonic() - started >= 0.5
    assert waited.returncode == 1 and waited.stdout == ""
    assert endpoint in waited.stderr and "waited 0.5s" in waited.stderr, waited.stderr

    # No --daemon, no GRADSYNC_DAEMON: the default endpoint under XDG_RUNTIME_DIR.
    default = run_cli(["ping"], clean_env(sandbox))
    assert default.returncode == 1
    assert f"ipc://{sandbox['run']}/gradsync/gradsyncd.sock" in default.stderr


@pytest.mark.timeout(60)
def test_ping_a_killed_daemon_fails(daemon: DaemonProcess, sandbox: dict[str, Path]) -> None:
    daemon.process.kill()  # leaves its socket file behind: connecting is refused
    daemon.process.wait(30)
    assert os.path.exists(daemon.socket_path)
    result = run_cli(["ping", "--daemon", daemon.endpoint], clean_env(sandbox))
    assert result.returncode == 1
    assert daemon.endpoint in result.stderr
    assert "no gradsync daemon answers" in result.stderr


@pytest.mark.timeout(60)
def test_ping_wait_retries_until_a_starting_daemon_answers(
    start_daemon: Any, short_tmp: str, sandbox: dict[str, Path]
) -> None:
    """`ping --wait` started before the daemon: it keeps asking and succeeds."""
    endpoint = f"ipc://{short_tmp}/d0.sock"  # where start_daemon's first daemon listens
    pinger = start_cli(["ping", "--wait", "30", "--daemon", endpoint], clean_env(sandbox))
    daemon = start_daemon()
    assert daemon.endpoint == endpoint
    result = finish(pinger)
    assert result.returncode == 0, result.stderr
    assert f"pid {daemon.pid}" in result.stdout


@pytest.mark.timeout(120)
def test_two_node_launch_numbers_ranks_like_torchrun(sandbox: dict[str, Path]) -> None:
    """Two launches (one per "node"), each with a private daemon that has peers."""
    ports = free_ports(2)
    endpoints = [f"tcp://127.0.0.1:{port}" for port in ports]
    launchers = []
    for node in range(2):
        run_dir = sandbox["run"] / f"node{node}"
        run_dir.mkdir(mode=0o700)
        env = clean_env(sandbox, XDG_RUNTIME_DIR=str(run_dir))
        node_rank = "--node-rank" if node == 0 else "--node_rank"  # torchrun's spelling
        launchers.append(start_cli(
            ["launch", "--nnodes", "2", node_rank, str(node), "--nproc-per-node", "2",
             "--job", "two-nodes", "--listen", endpoints[node], "--peers", ",".join(endpoints),
             "--insecure", str(PROGRAMS / "launch_report.py")],
            env,
        ))
    results = [finish(launcher) for launcher in launchers]
    seen = []
    for node, result in enumerate(results):
        assert result.returncode == 0, result.stderr
        for record in records(result.stdout):
            assert record["world_size"] == 4 and record["local_world_size"] == 2
            assert record["rank"] == node * 2 + record["local_rank"]
            assert record["sum"] == [0 + 1 + 2 + 3, 4, 1 + 10 + 100 + 1000]
            seen.append(record["rank"])
    assert sorted(seen) == [0, 1, 2, 3]


@pytest.mark.timeout(120)
def test_a_two_node_launch_on_daemons_with_peers_ends_without_a_warning(
    start_daemon: Any, sandbox: dict[str, Path]
) -> None:
    """The usual multi-node run: a daemon with peers on each node, one launch per node.
    Nothing goes wrong, so nothing may warn: not the launchers, not the daemons as
    the ranks leave after their last collective (their leaving is the job's end)."""
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    daemons = [start_daemon(*peer_args(i, endpoints, "--insecure")) for i in range(2)]
    launchers = [
        start_cli(["launch", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                   "--job", "clean-end", "--daemon", daemons[node].endpoint,
                   str(PROGRAMS / "launch_report.py")], clean_env(sandbox))
        for node in range(2)
    ]
    for result in [finish(launcher) for launcher in launchers]:
        assert result.returncode == 0, result.stderr
        assert "gradsync launch:" not in result.stderr, result.stderr
    poll_until(lambda: all("job 'clean-end' ended" in d.log() for d in daemons), 30,
               "both daemons to see the job end")
    # The only warnings expected: the two at start that --insecure links are insecure.
    warnings = [line for daemon in daemons for line in daemon.log().splitlines()
                if " WARNING " in line and "insecure" not in line.lower()]
    assert warnings == [], "\n".join(warnings)


@pytest.mark.timeout(60)
def test_the_readmes_repository_layout_names_every_example_and_command(
    sandbox: dict[str, Path],
) -> None:
    """The layout stays true: every examples/*.py, and exactly the CLI's subcommands."""
    readme = (REPO / "README.md").read_text()
    layout = readme.split("## Repository layout", 1)[1].split("\n## ", 1)[0]
    examples = sorted(path.name for path in (REPO / "examples").glob("*.py"))
    assert [name for name in examples if name not in layout] == [], layout
    usage = run_cli(["--help"], clean_env(sandbox)).stdout
    listed = re.search(r"\{([a-z,]+)\}", usage)
    assert listed, usage
    cli_line = re.search(r"CLI: ([a-z, ]+)$", layout, re.MULTILINE)
    assert cli_line, layout
    assert sorted(cli_line.group(1).split(", ")) == sorted(listed.group(1).split(","))
