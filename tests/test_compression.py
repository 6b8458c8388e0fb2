"""Compressed allreduce across real daemons: every rank bit-identical, within bounds.

1 to 4 daemons, every algorithm, bf16 and fp8, float32 and float64, sum and
avg, odd sizes, NaN/Inf/-0.0 and values far beyond fp8's range
(tests/programs/compressed_allreduce.py; the bound: compression_bounds.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from cluster import free_ports, peer_args, run_spread

from conftest import DaemonProcess

StartDaemon = Callable[..., DaemonProcess]


def start_cluster(start_daemon: StartDaemon, count: int, *extra: str) -> list[DaemonProcess]:
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(count)]
    return [start_daemon(*peer_args(i, endpoints, "--insecure", *extra)) for i in range(count)]


def _by_case(records: list[list[dict[str, Any]]]) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    cases: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for rank_records in records:
        for record in rank_records:
            if "case" in record:
                cases.setdefault(tuple(record["case"]), []).append(record)
    return cases


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("ranks_per_daemon", "algorithms", "counts", "extra"),
    [
        ((2,), "ring", "1,1000", ()),
        ((2, 1), "ring,tree,rhd,star", "1,7,1000,50001,300001", ()),
        ((1, 1, 1), "ring,tree,rhd,star", "7,257,12001", ("--pipeline-slice-bytes", "20KiB")),
        ((1, 2, 1, 1), "ring,tree,rhd,star", "1,1000,30001", ()),
    ],
    ids=["1d", "2d", "3d-small-slices", "4d"],
)
def test_every_rank_ends_bit_identical_within_the_bound(
    start_daemon: StartDaemon, ranks_per_daemon: tuple[int, ...], algorithms: str, counts: str,
    extra: tuple[str, ...],
) -> None:
    daemons = start_cluster(start_daemon, len(ranks_per_daemon), *extra)
    results = run_spread(daemons, ranks_per_daemon, "compressed_allreduce.py",
                         ["bf16,fp8", algorithms, counts, str(len(daemons))], timeout_s=220)
    records = [result.records() for result in results]
    cases = _by_case(records)
    assert len(cases) == 2 * len(algorithms.split(",")) * 2 * 2 * len(counts.split(","))
    for case, per_rank in cases.items():
        assert len(per_rank) == len(results), case
        assert len({record["digest"] for record in per_rank}) == 1, (case, per_rank)
        assert per_rank[0]["over"] == 0, (case, per_rank[0])
        assert per_rank[0]["specials"] == 0, (case, per_rank[0])
        assert per_rank[0]["not_bf16"] == 0, (case, per_rank[0])
    bad = records[0][0]["bad"]
    assert "int32" in bad[0] and "max" in bad[1] and "'int4'" in bad[2], bad
    assert "float16" in bad[3] and "needs a compression" in bad[4] and "int64" in bad[5], bad
    for daemon in daemons:
        daemon.assert_alive()


@pytest.mark.timeout(120)
def test_error_feedback_keeps_the_sum_of_many_steps_exact(start_daemon: StartDaemon) -> None:
    """fp8 rounds each step's sum by up to 2^-4: 40 equal steps drift by 40 such
    roundings without feedback, by about one with it; the residual is counted
    while its buffer lives and dropped once freed.  The statistics show each
    peer's bytes on the wire and before compression, and a compressed
    reduce-scatter stays within fp8's rounding."""
    from gradsync.client.cli.stats import fetch_snapshot

    daemons = start_cluster(start_daemon, 2)
    results = run_spread(daemons, (1, 1), "error_feedback_ranks.py", ["fp8", "40"],
                         timeout_s=100)
    for result in results:
        record = result.records()[-1]
        assert record["with"] < 0.1 * record["without"], record
        assert record["with"] < 3 * 2.0**-4, record  # the roundings still held, at most
        held = record["error_feedback"]
        assert held["buffers"] >= 1 and held["bytes_held"] >= 50_000 * 4, held
        assert 0 < record["scatter_error"] < 0.07, record
        (peer,) = record["peers"].values()
        for way in ("sent", "received"):
            wire, raw = peer[f"bytes_{way}"], peer[f"bytes_{way}_uncompressed"]
            assert 0.25 <= wire / raw <= 0.26, peer  # 1 + 4/256 bytes per 4
    from gradsync.client.cli.stats import render_table

    table = render_table(fetch_snapshot(daemons[0].endpoint + ".stats", 5.0))
    assert "before compression)" in table, table
    for daemon in daemons:
        # The job ended, its segments were freed, and the residuals with them.
        assert fetch_snapshot(daemon.endpoint + ".stats", 5.0)["error_feedback"] == {
            "buffers": 0, "bytes_held": 0}
        daemon.assert_alive()


@pytest.mark.timeout(200)
@pytest.mark.frameworks
def test_torch_ddp_trains_as_well_compressed(start_daemon: StartDaemon) -> None:
    """torch DDP on backend gradsync over 2 daemons, 200 steps: bf16 and fp8 with
    error feedback end within 1 % of the uncompressed run's loss, with every rank's
    parameters bit-identical, and so do gradsync's own DDP with bf16 and FSDP2
    (reduce-scatter) with bf16 against FSDP2 uncompressed; torch's
    fp16_compress_hook on gloo is printed beside."""
    from test_torch_backend import rendezvous_env

    daemons = start_cluster(start_daemon, 2)
    results = run_spread(daemons, (1, 1), "compressed_training.py", ["200"], timeout_s=180,
                         env=rendezvous_env())
    records = [result.records()[-1] for result in results]
    losses = records[0]["losses"]
    print(f"held-out loss: {records[0]['initial']:.4f} at first, after 200 steps",
          json.dumps(losses), "seconds per run:", records[0]["seconds"])
    assert losses["gradsync"] < 0.5 * records[0]["initial"]  # it learned
    exact = losses["gradsync"]
    for name in ("gradsync_bf16", "gradsync_fp8_ef", "ours_bf16"):
        assert abs(losses[name] - exact) <= 0.01 * exact, losses
    assert abs(losses["fsdp2_bf16"] - losses["fsdp2"]) <= 0.01 * losses["fsdp2"], losses
    # fp8 + error feedback fed residuals back once torch's buckets were daemon memory.
    assert all(record["error_feedback"]["buffers"] >= 1 for record in records), records
    for name in losses:
        assert len({record["digests"][name] for record in records}) == 1, name
    assert losses["gloo_fp16_hook"] < 2 * exact, losses  # it trained (printed to compare)
