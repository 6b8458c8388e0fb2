"""The statistics endpoint: snapshots that match what was done, the PUB stream,
JSON and Prometheus output, and read-only behaviour."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families
from zmq.utils.monitor import recv_monitor_message

from conftest import DaemonProcess, collect, poll_until, spawn_ranks
from gradsync.client.cli.stats import fetch_snapshot, render_table
from gradsync.protocol import messages

CLI = [sys.executable, "-m", "gradsync.client.cli"]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(120)
def test_snapshot_matches_a_known_workload(daemon: DaemonProcess, short_tmp: str) -> None:
    folder = Path(short_tmp) / "work"
    folder.mkdir()
    # The socket path: the daemon runs (and times) these collectives itself.  (What the
    # fast path shows, for the collectives the ranks run among themselves:
    # tests/test_fast_path.py.)
    ranks = spawn_ranks(daemon.endpoint, "stats_workload.py", 2, [str(folder)], job="known",
                        env={"GRADSYNC_FAST_PATH": "0"})
    try:
        poll_until(lambda: len(list(folder.glob("ready-*"))) == 2, 60, "the workload")
        snapshot = json.loads(cli("stats", "--daemon", daemon.endpoint, "--json").stdout)
        job = snapshot["jobs"]["known"]
        assert job["active"] is True
        assert job["done"] == {"allreduce/local": 5, "broadcast/local": 3}, job["done"]
        assert job["bytes_reduced"] == 5 * 4096 * 2 + 3 * 2048 * 2
        assert set(job["members"]) == {"0", "1"}
        assert all(m["state"] == "connected" for m in job["members"].values())
        assert job["in_flight"] == []
        assert job["latency"]["<=4096"]["count"] == 8  # 4 KiB and 2 KiB: one size class
        assert snapshot["pid"] == daemon.pid and snapshot["shm"]["in_use"] > 0
        table = cli("stats", "--daemon", daemon.endpoint)
        assert table.returncode == 0 and "job 'known' (active)" in table.stdout, table.stdout
        assert "up to 4.0 KiB:     8 collectives  p50" in table.stdout, table.stdout
        prometheus = cli("stats", "--daemon", daemon.endpoint, "--prometheus").stdout
        families = {f.name: f for f in text_string_to_metric_families(prometheus)}
        done = {s.labels["collective"]: s.value
                for s in families["gradsync_collectives"].samples}
        assert done == {"allreduce/local": 5.0, "broadcast/local": 3.0}, done
        live = cli("top", "--daemon", daemon.endpoint, "--iterations", "2")
        assert live.returncode == 0 and live.stdout.count("job 'known'") == 2, live.stdout
    finally:
        (folder / "release").write_text("go")
        collect(ranks, timeout_s=30)
    ended = fetch_snapshot(daemon.endpoint + ".stats", 5.0)
    assert ended["jobs"]["known"]["active"] is False


@pytest.mark.timeout(10)
def test_the_table_says_in_words_what_in_flight_collectives_wait_for() -> None:
    """In-flight entries as the daemon lists them, at each stage; no raw dicts."""
    snapshot = {
        "version": "0", "pid": 1, "uptime_s": 1.0, "shm": {"in_use": 0, "segments": 0},
        "jobs": {"j": {"active": True, "members": {"0": {}}, "done": {}, "errors": {},
                       "in_flight": [
            {"key": 1, "age_s": 2.5, "waiting_for_ranks": [1, 3]},
            {"key": 2, "step": 0, "steps": 2, "algorithm": "ring", "waiting_for_peers": ["B"]},
            {"key": 3, "step": 1, "steps": 2, "algorithm": "ring", "waiting_for_peers": ["B"]},
            {"key": 4, "step": 3, "steps": 2, "algorithm": "tree", "waiting_for_peers": []},
        ]}},
    }
    rows = [line.strip() for line in render_table(snapshot).splitlines() if "in flight" in line]
    assert rows == [
        "in flight: key 1 for 2.5s, waiting for local ranks 1, 3",
        "in flight: key 2, ring: agreeing with its peers before step 1 of 2, waiting for peers B",
        "in flight: key 3, ring: step 1 of 2, waiting for peers B",
        "in flight: key 4, tree: all 2 steps done, writing back",
    ], rows


@pytest.mark.timeout(60)
def test_stats_endpoint_is_read_only(daemon: DaemonProcess) -> None:
    context = zmq.Context()
    try:
        sock = context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(daemon.endpoint + ".stats")
        for request in (messages.request("alloc", 1, nbytes=4096),
                        messages.request("collective", 2), {"not": "a message"}, [1, 2]):
            sock.send(msgpack.packb(request))
            reply = msgpack.unpackb(sock.recv())
            assert reply["kind"] == "error", reply
        sock.send(b"\xc1 garbage")
        assert msgpack.unpackb(sock.recv())["kind"] == "error"
    finally:
        context.destroy(linger=0)
    snapshot = fetch_snapshot(daemon.endpoint + ".stats", 5.0)
    assert snapshot["shm"]["in_use"] == 0 and snapshot["jobs"] == {}


@pytest.mark.timeout(60)
def test_stats_without_a_daemon_fails_clearly(short_tmp: str) -> None:
    result = cli("stats", "--daemon", f"ipc://{short_tmp}/none.sock", "--timeout-s", "0.5")
    assert result.returncode == 1 and "no statistics from" in result.stderr, result.stderr


@pytest.mark.timeout(60)
def test_a_stalled_collective_is_reported_once(start_daemon: object) -> None:
    daemon: DaemonProcess = start_daemon("--stall-warn-s", "0.3")  # type: ignore[operator]
    ranks = spawn_ranks(daemon.endpoint, "fail_missing.py", 1, job="stall",
                        env={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GRADSYNC_TIMEOUT_S": "3"})
    collect(ranks, timeout_s=30)
    reports = [line for line in daemon.log().splitlines() if "has waited" in line]
    assert len(reports) == 1, reports
    assert "job 'stall'" in reports[0] and "1 local ranks not connected" in reports[0], reports


def wait_for_tracing(pub_endpoint: str) -> None:
    """Block until the daemon's published snapshot says a trace is recording."""
    context = zmq.Context()
    try:
        sub_socket = context.socket(zmq.SUB)
        sub_socket.setsockopt(zmq.SUBSCRIBE, b"")
        sub_socket.setsockopt(zmq.RCVTIMEO, 5000)
        sub_socket.connect(pub_endpoint)
        deadline = time.monotonic() + 20
        while not msgpack.unpackb(sub_socket.recv()).get("tracing"):
            assert time.monotonic() < deadline, "the trace never started"
    finally:
        context.destroy(linger=0)


@pytest.mark.timeout(120)
def test_trace_covers_every_phase_of_known_collectives(
    start_daemon: object, short_tmp: str
) -> None:
    """One daemon per "node", two of them: local phases on the job track, steps per link."""
    from cluster import free_ports, peer_args, run_spread

    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    daemons = [start_daemon(*peer_args(i, endpoints, "--insecure"))  # type: ignore[operator]
               for i in range(2)]
    out = Path(short_tmp) / "trace.json"
    tracer = subprocess.Popen(
        [*CLI, "trace", "--daemon", daemons[0].endpoint, "--seconds", "6", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    wait_for_tracing(daemons[0].endpoint + ".stats.pub")
    # While it records, other readers are answered, and a second trace is refused.
    assert fetch_snapshot(daemons[0].endpoint + ".stats", 3.0)["tracing"] is True
    second = cli("trace", "--daemon", daemons[0].endpoint, "--seconds", "1",
                 "--out", str(Path(short_tmp) / "second.json"))
    assert second.returncode == 1 and "already recording" in second.stderr, second.stderr
    folder = Path(short_tmp) / "work"
    folder.mkdir()
    (folder / "release").write_text("go")  # the workload does not wait at the end
    run_spread(daemons, (1, 1), "stats_workload.py", [str(folder)], job="traced")
    _, stderr = tracer.communicate(timeout=60)
    assert tracer.returncode == 0, stderr
    trace = json.loads(out.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in events}
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert "job traced" in tracks and f"link {endpoints[1]}" in tracks, tracks
    runs = [e for e in events if e["name"] in ("allreduce (run)", "broadcast (run)")]
    assert len(runs) == 5 + 3, sorted(names)
    assert sum(1 for e in events if e["name"] == "wait for local ranks") == 8
    assert sum(1 for e in events if e["name"] == "local phase") == 8
    assert sum(1 for e in events if e["name"] == "write-back") == 8
    assert any(" step " in e["name"] for e in events), sorted(names)
    # Bytes per peer and run, on the wire and before compression (none here: equal).
    sent = [e["args"] for e in events if e["name"].endswith(" sent")]
    assert sent and all(a["bytes_sent"] == a["bytes_before_compression"] > 0 for a in sent)
    assert {a["compression"] for a in sent} == {"none"}, sent
    assert all(e["dur"] >= 0 for e in events)
    # Bytes per peer: daemon 0 sent its allreduce halves and the broadcasts (it is
    # the root), and received the other daemon's allreduce data.
    traffic = fetch_snapshot(daemons[0].endpoint + ".stats", 5.0)["jobs"]["traced"]
    exchanged = traffic["peer_bytes"][endpoints[1]]
    assert exchanged["sent"] >= exchanged["received"] + 3 * 2048 > 3 * 2048, exchanged


def keygen(folder: Path, name: str) -> None:
    subprocess.run([*CLI, "keygen", str(folder), "--name", name], check=True,
                   capture_output=True, timeout=60)


@pytest.mark.timeout(120)
def test_tcp_stats_endpoint_is_behind_curve_keys(start_daemon: object, short_tmp: str) -> None:
    from cluster import free_ports

    keys, authorized, strangers = (Path(short_tmp) / n for n in ("keys", "authorized", "eve"))
    for folder in (keys, authorized, strangers):
        folder.mkdir(mode=0o700)
    keygen(keys, "node0")
    keygen(keys, "ops")
    keygen(strangers, "eve")
    for name in ("node0", "ops"):
        (authorized / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    port = free_ports(1)[0]
    endpoint = f"tcp://127.0.0.1:{port}"

    open_to_all = subprocess.run(
        [sys.executable, "-m", "gradsync.daemon", "--socket", f"ipc://{short_tmp}/open.sock",
         "--stats", endpoint], capture_output=True, text=True, timeout=30,
        stdin=subprocess.DEVNULL,
    )
    assert open_to_all.returncode == 2, open_to_all
    assert "--curve-secret" in open_to_all.stderr and endpoint in open_to_all.stderr

    daemon: DaemonProcess = start_daemon(  # type: ignore[operator]
        "--stats", endpoint, "--curve-secret", str(keys / "node0.key_secret"),
        "--curve-authorized", str(authorized),
    )
    ops = ["--curve-secret", str(keys / "ops.key_secret"),
           "--curve-server-key", str(keys / "node0.key")]
    reader = cli("stats", "--stats", endpoint, "--json", *ops)
    assert reader.returncode == 0, reader.stderr
    assert json.loads(reader.stdout)["pid"] == daemon.pid
    live = cli("top", "--stats", endpoint, "--iterations", "1", *ops)
    assert live.returncode == 0 and f"pid {daemon.pid}" in live.stdout, live.stderr

    eve = cli("stats", "--stats", endpoint, "--timeout-s", "1",
              "--curve-secret", str(strangers / "eve.key_secret"),
              "--curve-server-key", str(keys / "node0.key"))
    assert eve.returncode == 1 and "--curve-server-key" in eve.stderr, eve.stderr
    plain = cli("stats", "--stats", endpoint, "--timeout-s", "1")
    assert plain.returncode == 1, plain.stdout
    half = cli("stats", "--stats", endpoint, "--curve-secret", str(keys / "ops.key_secret"))
    assert half.returncode == 1 and "pass both" in half.stderr, half.stderr

    def refused() -> int:
        reply = json.loads(cli("stats", "--stats", endpoint, "--json", *ops).stdout)
        return int(reply["counters"]["stats_rejected_keys"])

    poll_until(lambda: refused() >= 1, 20, "the daemon to count the refused reader")
    assert "refused a statistics reader" in daemon.log()


@pytest.mark.timeout(60)
def test_tcp_stats_endpoint_without_keys_needs_insecure(
    start_daemon: object, short_tmp: str
) -> None:
    from cluster import free_ports

    endpoint = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    daemon: DaemonProcess = start_daemon("--stats", endpoint, "--insecure")  # type: ignore[operator]
    assert fetch_snapshot(endpoint, 5.0)["pid"] == daemon.pid
    assert "INSECURE" in daemon.log()


@pytest.mark.timeout(120)
def test_peer_heartbeat_age_tracks_a_stopped_peer(start_daemon: object) -> None:
    """The age stays small while the peer answers, grows while it is stopped (for
    a second: the failure detector would declare it lost after 2 s), and the
    table and Prometheus show it."""
    from cluster import free_ports, peer_args

    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    daemons: list[DaemonProcess] = [
        start_daemon(*peer_args(i, endpoints, "--insecure"))  # type: ignore[operator]
        for i in range(2)
    ]
    stats = daemons[0].endpoint + ".stats"

    def peer() -> dict[str, Any]:
        return dict(fetch_snapshot(stats, 5.0)["peers"][endpoints[1]])

    poll_until(lambda: peer()["state"] == "up" and (peer()["heartbeat_age_s"] or 9) < 1.0, 30,
               "the peer to be up and heard from")
    poll_until(lambda: peer()["data_stream"] == "plain", 30, "the data stream to the peer")
    table = cli("stats", "--daemon", daemons[0].endpoint).stdout
    assert f"peer {endpoints[1]}: up" in table and "heard " in table, table
    assert "data stream plain" in table, table
    prometheus = cli("stats", "--daemon", daemons[0].endpoint, "--prometheus").stdout
    families = {f.name: f for f in text_string_to_metric_families(prometheus)}
    ages = families["gradsync_peer_heartbeat_age_seconds"].samples
    assert ages[0].labels["peer"] == endpoints[1] and 0 <= ages[0].value < 2.5, ages
    streams = families["gradsync_peer_data_stream_open"].samples
    assert [(s.labels["peer"], s.value) for s in streams] == [(endpoints[1], 1.0)], streams
    assert peer()["suspected"] is False and peer()["suspect_after_s"] >= 1.5
    daemons[1].process.send_signal(signal.SIGSTOP)
    try:
        poll_until(lambda: peer()["heartbeat_age_s"] >= 0.8, 10, "the age to grow")
        assert peer()["state"] == "up"
    finally:
        daemons[1].process.send_signal(signal.SIGCONT)
    poll_until(lambda: peer()["heartbeat_age_s"] < 0.5, 30, "the peer to be heard again")
    assert peer()["state"] == "up"


def _dropped_after_sending(context: zmq.Context[Any], kind: int, endpoint: str,
                           send: Callable[[zmq.Socket[Any]], None]) -> bool:
    """Whether the daemon drops the connection of a socket that sent what `send` sends."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    events = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    events.setsockopt(zmq.RCVTIMEO, 15_000)
    sock.connect(endpoint)
    try:
        assert recv_monitor_message(events)["event"] == zmq.EVENT_CONNECTED
        send(sock)
        try:
            return recv_monitor_message(events)["event"] == zmq.EVENT_DISCONNECTED
        except zmq.Again:
            return False
    finally:
        sock.disable_monitor()
        events.close(linger=0)
        sock.close(linger=0)


@pytest.mark.timeout(120)
def test_stats_endpoints_drop_oversize_frames_and_many_frames(daemon: DaemonProcess) -> None:
    """Requests and subscriptions are a few bytes: a connection sending a MiB-sized request
    or a long subscription is dropped (ZMQ_MAXMSGSIZE) instead of being buffered, so fuzz
    of MiB frames leaves the daemon's memory where it was; a message of thousands of
    frames is counted as malformed; the daemon keeps serving."""
    requests = daemon.endpoint + ".stats"
    context = zmq.Context()
    try:
        rss_before = _rss_kib(daemon.pid)
        for size_mib in (1, 2, 4, 8, 8, 8, 8, 8):
            big = b"\x00" * (size_mib * 1024 * 1024)
            assert _dropped_after_sending(context, zmq.DEALER, requests,
                                          lambda sock, big=big: sock.send_multipart([b"", big]))
        assert _rss_kib(daemon.pid) - rss_before < 8 * 1024
        assert _dropped_after_sending(
            context, zmq.SUB, requests + ".pub",
            lambda sock: sock.setsockopt(zmq.SUBSCRIBE, b"x" * 8192))
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(requests)
        for _ in range(5):
            dealer.send_multipart([b"", *([b"x"] * 5000)])
        poll_until(lambda: fetch_snapshot(requests, 5.0)["counters"]["malformed"] >= 5, 60.0,
                   "every many-frame message is counted as malformed")
        dealer.close(linger=0)
    finally:
        context.destroy(linger=0)
    assert fetch_snapshot(requests, 5.0)["shm"]["in_use"] == 0
    daemon.assert_alive()


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")
