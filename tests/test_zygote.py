"""The rank zygote (tests/zygote.py): a forked child is what a fresh `python PROGRAM`
would have been, and its Popen behaves as subprocess.Popen does.

Each behaviour runs both ways, forked by the session's zygote and as a fresh process,
and the two must agree.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from zygote import ZygoteProcess

from conftest import DAEMON_ZYGOTES, RANK_ZYGOTE

pytestmark = pytest.mark.skipif(not RANK_ZYGOTE.enabled, reason="GRADSYNC_TEST_ZYGOTE=0")

Outcome = tuple[int, str, str]


def program(folder: Path, code: str) -> Path:
    path = folder / "program.py"
    path.write_text(textwrap.dedent(code))
    return path


def forked(path: Path, *args: str, env: dict[str, str] | None = None) -> ZygoteProcess:
    # The zygote's own environment, not this process's: earlier tests in the session
    # may have set start-up variables here (OMP_NUM_THREADS, ...) that it refuses.
    process = RANK_ZYGOTE.popen([sys.executable, str(path), *args],
                                env={**RANK_ZYGOTE.environ, **(env or {})})
    assert isinstance(process, ZygoteProcess)
    return process


def fresh(path: Path, *args: str, env: dict[str, str] | None = None
          ) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(path), *args],
                            env={**RANK_ZYGOTE.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def outcome(process: subprocess.Popen[str]) -> Outcome:
    out, err = process.communicate(timeout=60)
    return process.returncode, out, err


def both_ways(path: Path, *args: str, env: dict[str, str] | None = None) -> Outcome:
    """The outcome forked and fresh, asserted equal."""
    child = forked(path, *args, env=env)
    assert child.forked, RANK_ZYGOTE.summary()
    got = outcome(child)
    assert got == outcome(fresh(path, *args, env=env))
    return got


PROBE = """
    import ctypes, json, os, signal, sys, tempfile, threading
    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    def fds():
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                found.append(f"{fd} {os.readlink(f'/proc/self/fd/{fd}').split(':')[0]}")
            except OSError:  # listdir's own, closed by now
                pass
        return sorted(found)
    sigs = {}
    for s in sorted(signal.valid_signals()):
        try:
            sigs[int(s)] = str(signal.getsignal(s))
        except (OSError, ValueError):
            pass
    print(json.dumps({
        "argv": sys.argv, "orig_argv": sys.orig_argv, "path0": sys.path[0],
        "cwd": os.getcwd(), "name": __name__, "file": __file__, "package": __package__,
        "spec": None if __spec__ is None else [__spec__.name, __spec__.origin],
        "variable": os.environ.get("ZYGOTE_PROBE"),
        "c_env": getenv(b"ZYGOTE_PROBE").decode(),
        "tmp": tempfile.gettempdir(), "signals": sigs,
        "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "buffering": [sys.stdout.line_buffering, sys.stderr.line_buffering],
        "encodings": [sys.stdout.encoding, sys.stderr.encoding, sys.stdin.encoding],
        "fds": fds(), "threads": threading.active_count(),
        "tasks": len(os.listdir("/proc/self/task")), "umask": os.umask(0o22),
        "main_module": sys.modules["__main__"].__dict__ is globals(),
    }))
"""


def test_a_forked_child_starts_as_a_fresh_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = program(tmp_path, PROBE)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    env = {"ZYGOTE_PROBE": "x y", "TMPDIR": str(tmp_path)}
    child = forked(path, "a", "b c", env=env)
    assert child.forked, RANK_ZYGOTE.summary()
    ours = json.loads(outcome(child)[1])
    theirs = json.loads(outcome(fresh(path, "a", "b c", env=env))[1])
    assert {name: value for name, value in ours.items() if theirs[name] != value} == {}, theirs


def test_a_module_run_as_python_dash_m_is_forked_as_a_fresh_interpreter_runs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """How the daemon zygotes start gradsyncd: `python -m gradsync.daemon`."""
    (tmp_path / "probe_module.py").write_text(textwrap.dedent(PROBE))
    monkeypatch.chdir(tmp_path)
    zygote = DAEMON_ZYGOTES[False]
    args = [sys.executable, "-m", "probe_module", "a", "b c"]
    env = {**zygote.environ, "ZYGOTE_PROBE": "x y", "TMPDIR": str(tmp_path)}
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    child = zygote.process(args, env, **pipes)
    assert isinstance(child, ZygoteProcess) and child.forked, zygote.summary()
    ours = json.loads(outcome(child)[1])
    theirs = json.loads(outcome(subprocess.Popen(args, env=env, **pipes))[1])
    assert {name: value for name, value in ours.items() if theirs[name] != value} == {}, theirs
    assert ours["name"] == "__main__" and ours["argv"][0] == str(tmp_path / "probe_module.py")


def test_random_generators_differ_between_children(tmp_path: Path) -> None:
    path = program(tmp_path, """
        import random, numpy
        print(random.random(), numpy.random.random())
    """)
    first, second = (outcome(forked(path))[1].split() for _ in range(2))
    assert first[0] != second[0] and first[1] != second[1]


@pytest.mark.parametrize("code", [
    "import sys; sys.exit(3)",
    "import sys; sys.exit('bye')",
    "import sys; sys.exit(None)",
    "import sys; print('out'); sys.exit(256 + 7)",
    "def f():\n    raise ValueError('boom')\nf()",
    "raise KeyboardInterrupt",
    "import os; os.kill(os.getpid(), 9)",
    "import os; print('lost', end=''); os._exit(5)",
    "print('no newline', end='')",
    "x = (",
    "import atexit; atexit.register(print, 'at exit')",
    "import threading, time\n"
    "threading.Thread(target=lambda: (time.sleep(0.3), print('late', flush=True))).start()",
    "import sys; sys.stdout = open(sys.argv[1], 'w'); print('to a file, never closed')",
    "import sys; kept = open(sys.argv[1], 'w'); kept.write('to a file, never closed\\n')",
    "try:\n    {}['key']\nexcept KeyError:\n    raise RuntimeError('while handling')",
])
def test_exits_as_a_fresh_interpreter_does(tmp_path: Path, code: str) -> None:
    path = program(tmp_path, code + "\n")
    target = tmp_path / "written"
    both_ways(path, str(target))
    if "open(" in code:
        assert target.read_text() == "to a file, never closed\n"


def test_the_popen_api(tmp_path: Path) -> None:
    path = program(tmp_path, """
        import signal, sys, time
        signal.signal(signal.SIGUSR1, lambda *a: (print("usr1", flush=True), sys.exit(4)))
        print("started", flush=True)
        print("err", file=sys.stderr, flush=True)
        time.sleep(60)
    """)
    process = forked(path)
    assert process.args == [sys.executable, str(path)] and process.pid > 0
    assert process.stdout is not None and process.stdout.readline() == "started\n"
    assert process.poll() is None  # (poll returns returncode)
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.2)
    with pytest.raises(subprocess.TimeoutExpired):
        process.communicate(timeout=0.2)
    process.send_signal(signal.SIGUSR1)
    out, err = process.communicate(timeout=30)  # resumes what the first call read
    assert (process.returncode, out, err) == (4, "usr1\n", "err\n")
    process.kill()  # reaped: nothing to signal, no error
    for stop, code in ((ZygoteProcess.kill, -9), (ZygoteProcess.terminate, -15)):
        process = forked(path)
        assert process.stdout is not None and process.stdout.readline() == "started\n"
        stop(process)
        assert process.wait(timeout=30) == code and process.poll() == code
        process.communicate()


def test_what_a_fork_cannot_give_starts_fresh(tmp_path: Path) -> None:
    path = program(tmp_path, "import os; print(os.environ['PYTHONHASHSEED'], hash('x'))")
    before = sum(RANK_ZYGOTE.fallbacks.values())
    process = forked(path, env={"PYTHONHASHSEED": "7"})
    assert not process.forked
    returncode, out, _ = outcome(process)
    assert returncode == 0 and out.split()[0] == "7"
    assert sum(RANK_ZYGOTE.fallbacks.values()) == before + 1


def test_a_thread_count_of_its_own_is_forked_by_a_zygote_started_with_it(tmp_path: Path) -> None:
    threads = "1" if RANK_ZYGOTE.environ.get("OMP_NUM_THREADS") != "1" else "2"
    path = program(tmp_path, "import os, torch; "
                             "print(os.environ['OMP_NUM_THREADS'], torch.get_num_threads())")
    before = sum(RANK_ZYGOTE.fallbacks.values())
    children = [forked(path, env={"OMP_NUM_THREADS": threads}) for _ in range(2)]
    assert all(child.forked for child in children), RANK_ZYGOTE.summary()
    for child in children:
        returncode, out, err = outcome(child)
        assert returncode == 0, err
        assert out.split() == [threads, threads]
    assert sum(RANK_ZYGOTE.fallbacks.values()) == before
    assert f"OMP_NUM_THREADS={threads}: a zygote of its own" in RANK_ZYGOTE.summary()


def test_a_child_asked_into_a_network_namespace_is_forked_there(tmp_path: Path) -> None:
    """As `ip netns exec` would start it: its sockets live in the namespace (it sees
    the node's own address), and a namespace that does not exist is refused."""
    from benchmarks.topology import namespaces, namespaces_unavailable

    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    path = program(tmp_path, """\
        import os, socket
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((os.environ["PEER"], 9))  # no packet: picks the route only
            print(os.readlink("/proc/self/ns/net"), probe.getsockname()[0])
        """)
    with namespaces(2) as topo:
        node = topo.namespaces[1]
        assert node is not None
        expected = os.stat(f"/run/netns/{node}").st_ino
        child = RANK_ZYGOTE.popen([sys.executable, str(path)], netns=node,
                                  env={**RANK_ZYGOTE.environ, "PEER": topo.hosts[0]})
        assert isinstance(child, ZygoteProcess) and child.forked, RANK_ZYGOTE.summary()
        returncode, out, err = outcome(child)
        assert returncode == 0, err
        assert out.split() == [f"net:[{expected}]", topo.hosts[1]]
    before = sum(RANK_ZYGOTE.fallbacks.values())
    gone = RANK_ZYGOTE.popen([sys.executable, str(path)], netns=node,
                             env={**RANK_ZYGOTE.environ, "PEER": topo.hosts[0]})
    assert not gone.forked  # type: ignore[attr-defined]
    assert outcome(gone)[0] != 0  # and `ip netns exec` fails as well
    assert sum(RANK_ZYGOTE.fallbacks.values()) == before + 1


def test_a_forked_child_costs_less_than_a_fresh_one(tmp_path: Path) -> None:
    path = program(tmp_path, "import torch, gradsync.client.torch")
    started = time.monotonic()
    assert outcome(forked(path))[0] == 0
    assert time.monotonic() - started < 5  # fresh: ~2 s of CPU, far more on a loaded machine


def test_a_malformed_request_is_refused_and_the_zygote_serves_on(tmp_path: Path) -> None:
    path = program(tmp_path, "print('served')")
    assert outcome(forked(path))[0] == 0  # started
    for message in (b"not json", b"[1, 2]", json.dumps({"argv": [sys.executable]}).encode()):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
            connection.settimeout(30)
            connection.connect(str(RANK_ZYGOTE.socket_path))
            socket.send_fds(connection, [message], [0, 1, 2])
            assert "refused" in json.loads(connection.recv(65536)), message
    child = forked(path)
    assert child.forked and outcome(child) == (0, "served\n", "")
