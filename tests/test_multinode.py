"""Allreduce across several daemons on 127.0.0.1: every algorithm against numpy."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from cluster import free_ports, peer_args, run_spread, spawn_spread, start_cluster
from prometheus_client.parser import text_string_to_metric_families

from conftest import DaemonProcess, collect
from gradsync.client.ping import query
from gradsync.daemon.core.membership import coordinator_of

StartDaemon = Callable[..., DaemonProcess]


#: For the larger clusters: every algorithm and count, over fewer dtypes and ops
#: (the two smaller ones run the whole matrix; the schedules themselves are checked
#: for every daemon count in tests/test_schedules.py).
_REDUCED_MATRIX = ["ring,tree,rhd,star,auto", "float32,int32,bfloat16", "sum,avg,max,prod,bxor"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("ranks_per_daemon", "extra", "matrix"),
    [
        ((1, 1), (), []),
        # Small slices: every transfer of the larger counts is cut into many,
        # the last one short (sent by copy, below the zero-copy threshold).
        ((1, 2, 1), ("--pipeline-slice-bytes", "100KiB"), []),
        ((2, 1, 1, 2), (), _REDUCED_MATRIX),
        ((1, 1, 1, 1, 1), (), _REDUCED_MATRIX),
    ],
    ids=["2d-1+1", "3d-1+2+1-small-slices", "4d-2+1+1+2", "5d-1x5"],
)
def test_every_algorithm_matches_numpy(
    start_daemon: StartDaemon, ranks_per_daemon: tuple[int, ...], extra: tuple[str, ...],
    matrix: list[str],
) -> None:
    daemons = start_cluster(start_daemon, len(ranks_per_daemon), *extra)
    results = run_spread(daemons, ranks_per_daemon, "multinode_allreduce.py", matrix,
                         timeout_s=280)
    for result in results:
        summary = result.records()[-1]
        assert summary["failures"] == 0, result.stdout
        assert summary["checked"] >= (300 if matrix else 550)
    for daemon in daemons:
        daemon.assert_alive()
        # --insecure links: the slices went over the plain-TCP data streams.
        counters = query(daemon.endpoint, 5.0)["counters"]
        assert counters["links_stream_sent"] > 0 and counters["links_stream_received"] > 0
        assert counters["links_stream_failed"] == counters["links_stream_refused"] == 0
        # Slices of the running step were read straight into place.
        assert counters["slices_placed"] > 0
        assert counters["links_malformed"] == 0


def _job_entries(daemons: list[DaemonProcess], job: str) -> list[dict[str, Any]]:
    """Each daemon's statistics for `job`."""
    from gradsync.client.cli.stats import fetch_snapshot

    return [fetch_snapshot(d.endpoint + ".stats", 5.0)["jobs"][job] for d in daemons]


def _auto_entries(daemons: list[DaemonProcess], job: str) -> list[dict[str, Any]]:
    """Each daemon's `auto` statistics for `job`, per buffer size."""
    return [entry["auto"] for entry in _job_entries(daemons, job)]


@pytest.mark.timeout(180)
def test_auto_reprices_with_figures_every_member_agreed(start_daemon: StartDaemon) -> None:
    """Past its first epoch a job's `auto` runs on link costs fitted to the ring and
    rhd allreduces the daemons ran, and every member prices and picks alike."""
    from gradsync.daemon.core.cost_epochs import EPOCH_KEYS

    rounds = 48  # 6 keys each: epochs 0 to 8
    daemons = start_cluster(start_daemon, 3)
    results = run_spread(daemons, (1, 2, 1), "multinode_calibrate.py", [str(rounds)],
                         job="calib", timeout_s=150)
    for result in results:
        assert result.records()[-1]["failures"] == 0, result.stdout
    jobs = _job_entries(daemons, "calib")
    entries = [job["auto"] for job in jobs]
    # The figures the job formed with (its first epoch's), the same on every member.
    formed = {(job["formed_costs"]["alpha_s"], job["formed_costs"]["beta_s_per_byte"])
              for job in jobs}
    assert len(formed) == 1 and next(iter(formed))[1] > 0, formed
    # One coordinator, the same for all, picked from the job's name among them.
    from gradsync.client.cli.stats import fetch_snapshot

    endpoints = {peer for d in daemons
                 for peer in fetch_snapshot(d.endpoint + ".stats", 5.0)["peers"]}
    assert len(endpoints) == 3, endpoints
    assert {job["coordinator"] for job in jobs} == {coordinator_of("calib", endpoints)}, jobs
    last_epoch = (6 * rounds - 1) // EPOCH_KEYS
    for offset, size in ((4, "4096"), (5, "262144")):
        priced = {(e[size]["alpha_s"], e[size]["beta_s_per_byte"], e[size]["epoch"])
                  for e in entries}
        assert len(priced) == 1, priced  # the same figures on every member
        ((alpha, beta, epoch),) = priced
        assert epoch == last_epoch and alpha >= 0 and beta > 0
        # The same picks on every member, for the same reasons: the model's
        # alone in epoch 0, then timings (ring's and rhd's from their own keys).
        assert all(e[size]["picks"] == entries[0][size]["picks"] for e in entries)
        basis = entries[0][size]["basis"]
        assert all(e[size]["basis"] == basis for e in entries)
        in_epoch_0 = len([r for r in range(rounds) if 6 * r + offset < EPOCH_KEYS])
        # (Past epoch 0 too while the model's choice has no timing yet, outside
        # the exploring first half of an epoch.)
        assert basis["model"] >= in_epoch_0 and sum(basis.values()) == rounds, basis
        assert basis.get("measured", 0) > 0, basis
        assert entries[0][size]["last_basis"] == "measured"
    assert all(query(d.endpoint, 5.0)["counters"]["malformed"] == 0 for d in daemons)
    table = subprocess.run(
        [sys.executable, "-m", "gradsync.client.cli", "stats", "--daemon", daemons[0].endpoint],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    line = next(line for line in table.splitlines() if "auto at 256.0 KiB:" in line)
    assert f"epoch {last_epoch}" in line and "(measured)" in line, table
    prometheus = subprocess.run(
        [sys.executable, "-m", "gradsync.client.cli", "stats", "--daemon", daemons[0].endpoint,
         "--prometheus"], capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    families = {f.name: f for f in text_string_to_metric_families(prometheus)}
    picked = {(s.labels["bytes"], s.labels["algorithm"]): s.value
              for s in families["gradsync_auto_picks"].samples if s.labels["job"] == "calib"}
    assert picked == {(size, name): float(count) for size, entry in entries[0].items()
                      for name, count in entry["picks"].items()}, picked
    decided = {(s.labels["bytes"], s.labels["basis"]): s.value
               for s in families["gradsync_auto_basis"].samples if s.labels["job"] == "calib"}
    assert decided[("262144", "measured")] == entries[0]["262144"]["basis"]["measured"]


@pytest.mark.timeout(180)
def test_auto_alone_times_its_close_contenders_then_runs_the_fastest(
    start_daemon: StartDaemon,
) -> None:
    """A job that only ever asks for `auto` (a training loop) times, epoch by
    epoch, each algorithm the model prices within `auto_explore_factor` of its
    best, then runs the fastest measured; every member does the same at every
    key.  At factor 1 the model alone decides."""
    from gradsync.daemon.core.cost_epochs import EPOCH_KEYS

    rounds = 150  # 2 keys each: epochs 0 to 9
    # Factor 100: every algorithm is a contender, whatever the links cost.  The
    # smallest member's factor holds for all, so a mixed cluster picks alike.
    for factors, job in ((("100",) * 3, "wide"), (("100", "1", "100"), "model")):
        endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(3)]
        daemons = [start_daemon(*peer_args(i, endpoints, "--insecure"),
                                "--auto-explore-factor", factor)
                   for i, factor in enumerate(factors)]
        results = run_spread(daemons, (1, 2, 1), "multinode_calibrate.py",
                             [str(rounds), "auto"], job=job, timeout_s=150)
        for result in results:
            assert result.records()[-1]["failures"] == 0, result.stdout
        entries = _auto_entries(daemons, job)
        for size in ("4096", "262144"):
            picks, basis = entries[0][size]["picks"], entries[0][size]["basis"]
            assert all(e[size]["picks"] == picks and e[size]["basis"] == basis
                       for e in entries), entries
            if job == "model":
                assert basis == {"model": rounds}, basis
                continue
            assert set(picks) == {"ring", "rhd", "tree", "star"}, picks
            assert basis["model"] == EPOCH_KEYS // 2 and basis.get("explored", 0) > 0, basis
            assert entries[0][size]["last_basis"] == "measured", entries[0][size]
        for daemon in daemons:
            daemon.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_ranks_that_leave_after_their_last_collective_fail_no_one(
    start_daemon: StartDaemon, algorithm: str
) -> None:
    """A rank whose daemon finished the last collective leaves at once, as a training
    script does; the other daemons may still be reading that daemon's last slices.
    Its departure must not fail their collective: the slices arrive before the news.
    A race, so several short jobs (4 per algorithm, at once, each 4 daemons leaving
    twice): before the fix about one job in 100 failed here, so this is a smoke
    test; tests/test_netns.py forces the interleaving by slowing one data stream."""
    daemons = start_cluster(start_daemon, 4)
    jobs = [spawn_spread(daemons, (1, 1, 1, 1), "multinode_finish.py",
                         [str(4 * 1024 * 1024), "2", algorithm],
                         job=f"finish-{algorithm}-{attempt}")
            for attempt in range(4)]
    for ranks in jobs:
        for result in collect(ranks, timeout_s=150):
            assert result.records() == [{"rounds": 2, "wrong": 0}], result.stdout
    for daemon in daemons:
        daemon.assert_alive()
