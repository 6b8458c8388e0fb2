"""`--failure-detector timeout`: the upper bound alone, no fast suspicion.

With the default (`adaptive`) a silent peer is declared in about 2 s
(tests/test_multinode_failures.py, tests/test_torchft_lost_node.py).  With
`timeout` a SIGSTOPped peer (its kernel keeps its connections open, so only its
silence tells) is declared at about `--peer-timeout-s`: by the detector's bound
or by ZeroMQ's own heartbeats, which run with the same bound (between 3/4 of it
and all of it after the last message); no one is suspected or asked about.  A
killed peer is noticed at once either way (its kernel closes the connections).
The decisions themselves, from a fake clock, are at the end.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cluster import free_ports, peer_args

from conftest import DaemonProcess, poll_until
from gradsync.client.cli.stats import fetch_snapshot
from gradsync.client.ping import query
from gradsync.daemon.config import ConfigError, load_config
from gradsync.daemon.core.failure_detector import (
    Action,
    DetectorTimings,
    FailureDetector,
    Verdict,
)
from gradsync.daemon.main import main

StartDaemon = Callable[..., DaemonProcess]
#: Long enough that a declaration at its start (ZeroMQ's heartbeats: 3/4 of it
#: after the last message, which came up to a second before the stop) stands well
#: clear of the adaptive detector's 2 s.
PEER_TIMEOUT_S = 6.0


def peers_of(daemon: DaemonProcess) -> dict[str, dict[str, object]]:
    snapshot = fetch_snapshot(daemon.endpoint + ".stats", 5.0)
    return dict(snapshot["peers"])


@pytest.mark.timeout(120)
def test_timeout_detector_declares_a_stopped_peer_at_the_peer_timeout(
    start_daemon: StartDaemon,
) -> None:
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    daemons = [
        start_daemon(
            *peer_args(
                i,
                endpoints,
                "--insecure",
                "--peer-timeout-s",
                str(PEER_TIMEOUT_S),
                "--failure-detector",
                "timeout",
            )
        )
        for i in range(2)
    ]
    watcher, victim = daemons
    poll_until(
        lambda: all(peers_of(d)[endpoints[1 - i]]["state"] == "up" for i, d in enumerate(daemons)),
        30,
        "both links up",
    )
    # The setting shows: statistics, the peer's threshold, the start-up log.
    snapshot = fetch_snapshot(watcher.endpoint + ".stats", 5.0)
    assert snapshot["config"]["failure_detector"] == "timeout", snapshot["config"]
    assert snapshot["config"]["peer_timeout_s"] == PEER_TIMEOUT_S
    assert snapshot["peers"][endpoints[1]]["suspect_after_s"] == PEER_TIMEOUT_S
    assert re.search(
        r"failure detector 'timeout': a silent peer is declared after 6s "
        r"\(heartbeats every 1s, to every peer\)",
        watcher.log(),
    ), watcher.log()

    # When the watcher last heard the victim, at the latest: an age read before the stop.
    asked = time.monotonic()
    heard_age_s = float(peers_of(watcher)[endpoints[1]]["heartbeat_age_s"])  # type: ignore[arg-type]
    last_heard = asked - heard_age_s
    struck = time.monotonic()
    victim.process.send_signal(signal.SIGSTOP)
    try:
        poll_until(
            lambda: query(watcher.endpoint, 5.0)["counters"]["links_peer_lost"] >= 1,
            PEER_TIMEOUT_S + 20,
            "the stopped peer to be declared",
        )
        declared = time.monotonic()
    finally:
        victim.process.send_signal(signal.SIGCONT)
    log = watcher.log()
    took_s, silent_s = declared - struck, declared - last_heard
    print(
        f"stopped peer declared {took_s:.1f} s after the stop, {silent_s:.1f} s after it was "
        f"last heard (peer timeout {PEER_TIMEOUT_S:g} s)"
    )
    # Not the adaptive ~2 s of silence: 3/4 of the bound at least (ZeroMQ's heartbeats;
    # a loaded machine only declares later), less half a second for the heartbeats
    # ZeroMQ read before we did.  At most the bound plus a wide margin for load.
    assert silent_s > 0.75 * PEER_TIMEOUT_S - 0.5, (silent_s, log)
    assert took_s < PEER_TIMEOUT_S + 10, (took_s, log)
    counters = query(watcher.endpoint, 5.0)["counters"]
    assert counters["links_peer_suspected"] == 0, (counters, log)
    assert "suspected" not in log, log
    # Declared by the bound: the detector's ("the peer timeout") or ZeroMQ's heartbeats.
    lost = re.findall(rf"peer {re.escape(endpoints[1])} lost: (.*)", log)
    assert lost and ("(the peer timeout)" in lost[0] or lost[0] == "its connection closed"), log
    # Woken, it comes back.
    poll_until(
        lambda: peers_of(watcher)[endpoints[1]]["state"] == "up",
        30,
        "the woken peer's link to come up again",
    )


def test_a_bad_failure_detector_is_refused_naming_the_key_and_the_choices(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--failure-detector", "phi"]) == 2
    error = capsys.readouterr().err
    assert "bad value for 'failure_detector' in command-line flags" in error, error
    assert "must be one of adaptive, timeout, got 'phi'" in error, error

    toml = tmp_path / "gradsyncd.toml"
    toml.write_text('failure_detector = "fixed"\n')
    with pytest.raises(
        ConfigError,
        match=r"'failure_detector' in config file .*adaptive, "
        r"timeout, got 'fixed'",
    ):
        load_config(environ={}, toml_path=str(toml))
    with pytest.raises(ConfigError, match="GRADSYNC_FAILURE_DETECTOR"):
        load_config(environ={"GRADSYNC_FAILURE_DETECTOR": ""})
    assert load_config(environ={}).failure_detector == "adaptive"
    assert (
        load_config(environ={"GRADSYNC_FAILURE_DETECTOR": "Timeout"}).failure_detector == "timeout"
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_timeout_detector_declares_at_the_bound_and_asks_no_one() -> None:
    """Fake clock: a peer silent for less than the bound is left alone, whatever
    its gaps were; at the bound it is declared lost (no question to the others)."""
    timings = DetectorTimings.for_timeout(4.0, "timeout")
    assert (timings.ping_ivl_s, timings.upper_s, timings.stall_s) == (1.0, 4.0, 4.0)
    assert DetectorTimings.for_timeout(0.4, "timeout").ping_ivl_s == pytest.approx(0.1)
    clock = Clock()
    detector = FailureDetector(timings, clock)
    for peer in ("a", "b", "c"):
        detector.watch(peer)
    for _ in range(8):  # a regular peer, heard every second
        clock.now += 1.0
        for peer in ("a", "b", "c"):
            detector.heard(peer)
        assert detector.tick() == []
    silent_from = clock.now
    actions: list[tuple[float, Action]] = []
    for _ in range(5):
        clock.now += 1.0
        detector.heard("b")
        detector.heard("c")
        actions += [(clock.now - silent_from, action) for action in detector.tick()]
    assert len(actions) == 1, actions
    at, verdict = actions[0]
    assert isinstance(verdict, Verdict) and verdict.peer == "a", verdict
    assert at == pytest.approx(4.0)
    assert verdict.kind == "lost" and verdict.bound and not verdict.silent_to
    assert verdict.describe("me") == "silent for 4.0s (the peer timeout)"
    assert detector.counts.suspected == 0
